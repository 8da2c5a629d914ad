"""The embedded side of bench/serve.py: `LLM.generate` over the workload in a process of its
own, and the latency-bound case through the engine itself, recorded as the service's clients
record it (bench/serve_clients.Record), so both sides go through one summary.

Torch is imported inside the child process only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from bench.serve_clients import Job, Record


def _latency_records(engine, jobs: list[Job], streams: int, params) -> list[Record]:
    """`streams` requests at a time, each started when one ends (as the service's
    latency-bound client does), driven by `engine.step()`; a record per request with the time
    every step's output reached the caller."""
    pending = list(jobs)
    records: dict[str, Record] = {}
    active = 0
    while pending or engine.has_unfinished():
        while pending and active < streams:
            job = pending.pop(0)
            request_id = engine.add_request(job.prompt, params(job))
            records[request_id] = Record(job.index, time.monotonic())
            active += 1
        for out in engine.step():
            record = records[out.request_id]
            if out.delta_token_ids:
                record.arrivals.append(time.monotonic())
                record.counts.append(len(out.delta_token_ids))
            if out.finished:
                record.completion_tokens = len(out.token_ids)
                active -= 1
    return sorted(records.values(), key=lambda r: r.index)


def _build_llm(model_dir: str, device: str, engine_kwargs: dict):
    from scheduler_svc import LLM

    null_ms = engine_kwargs.pop("null_model_ms", None)
    if null_ms is None:
        return LLM(model=model_dir, device=device, **engine_kwargs)
    # The engine over the emulated device, overlapped as the service's is.
    from bench.null_model import NullRunner
    from scheduler_svc.config import EngineConfig
    from scheduler_svc.engine import LLMEngine

    blocks = engine_kwargs.pop("num_gpu_blocks") or 8192
    runner = NullRunner(model_dir, null_ms, blocks)
    config = EngineConfig(model=model_dir, device="cpu", num_gpu_blocks=blocks, async_scheduling=True, **engine_kwargs)
    return LLM.from_engine(LLMEngine(config, model=runner))


def _embedded_main(model_dir: str, device: str, engine_kwargs: dict, cases: dict, streams: int, conn) -> None:
    import torch

    from scheduler_svc import SamplingParams

    def params(job: Job) -> SamplingParams:
        return SamplingParams(temperature=job.temperature, max_tokens=job.max_tokens, ignore_eos=True)

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    llm = _build_llm(model_dir, device, engine_kwargs)
    warm, jobs = cases["warm"], cases["jobs"]
    llm.generate([j.prompt for j in warm], [params(j) for j in warm])
    parity_ids = [llm.generate([j.prompt], params(j))[0].token_ids for j in cases["parity"]]  # one at a time
    llm.engine.reset_prefix_cache()
    sync()
    start = time.perf_counter()
    outs = llm.generate([j.prompt for j in jobs], [params(j) for j in jobs])
    sync()
    seconds = time.perf_counter() - start
    latency = _latency_records(llm.engine, cases["latency"], streams, params)
    conn.send(
        {
            "seconds": seconds,
            "tokens": sum(len(o.token_ids) for o in outs),
            "counts": [len(o.token_ids) for o in outs],
            "parity": parity_ids,
            "latency": latency,
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "CPU",
            "num_device_blocks": llm.engine.model.num_device_blocks,
        }
    )
    conn.close()


def run_embedded(model_dir: str, args: argparse.Namespace, cases: dict[str, list[Job]]) -> dict:
    """cases: warm, jobs (the throughput case), parity, latency. Returns the child's result."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    kwargs = dict(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=args.num_gpu_blocks,
    )
    if args.null_model is not None:
        kwargs["null_model_ms"] = args.null_model
    proc = ctx.Process(target=_embedded_main, args=(model_dir, args.device, kwargs, cases, args.latency_streams, child))
    proc.start()
    child.close()
    try:
        result = parent.recv()
    except EOFError:
        raise SystemExit(f"the embedded run failed (exit {proc.join() or proc.exitcode})") from None
    proc.join()
    return result
