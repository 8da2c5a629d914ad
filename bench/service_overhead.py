"""Service mode vs embedded mode on the CPU: per-step cost of the two internal RPCs and
throughput on the same workload (bundled stories260k, greedy, ignore_eos).

    python bench/service_overhead.py --out bench/results/service_cpu.md
    python bench/service_overhead.py --num-seqs 16 --redis   # also with a throwaway redis-server

Modes, all on one workload (every request added before the first step, so the engine
takes the same steps in each):
- embedded: LLMEngine in this process (the reference; its model time per step is timed).
- service, engine here: a ServiceEngine in this process over the KV-cache and model
  services (separate processes, gRPC on loopback): ApplyStep and Step timed per call.
- service, Generate: a scheduler process too; all requests streamed concurrently through
  the public API (what a user sees).
The RPC overhead of a step is ApplyStep's time plus (remote Step time - local model time).
ApplyStep's time is what the engine spends on it outside the model call (sending it, and
waiting for an answer still missing once the model step is back): it overlaps the model call.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import secrets
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts.rpc import free_port  # noqa: E402

NUM_DEVICE_BLOCKS, NUM_HOST_BLOCKS = 1024, 256


def make_workload(num_seqs: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(16, 200))] for _ in range(num_seqs)]
    return prompts, [rng.randint(64, 256) for _ in range(num_seqs)]


def median_run(fn, repeats: int) -> dict:
    """The run with the median wall time of `repeats` (timings here are noisy)."""
    runs = sorted((fn() for _ in range(repeats)), key=lambda r: r["seconds"])
    return runs[len(runs) // 2]


def run_engine(engine, prompts, max_tokens) -> tuple[float, int, dict[str, list[int]]]:
    from scheduler_svc import SamplingParams

    ids = [
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
        for p, m in zip(prompts, max_tokens)
    ]
    outputs: dict[str, list[int]] = {}
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        steps += 1
    return time.perf_counter() - start, steps, {i: outputs[rid] for i, rid in enumerate(ids)}


def bench_embedded(prompts, max_tokens, repeats: int) -> dict:
    from scheduler_svc.config import EngineConfig
    from scheduler_svc.engine import LLMEngine

    engine = LLMEngine(EngineConfig(num_gpu_blocks=NUM_DEVICE_BLOCKS, num_cpu_blocks=NUM_HOST_BLOCKS, device="cpu"))
    model_time = [0.0]
    step = engine.model.step

    def timed(inp):
        t = time.perf_counter()
        try:
            return step(inp)
        finally:
            model_time[0] += time.perf_counter() - t

    engine.model.step = timed
    run_engine(engine, prompts[:2], [4, 4])  # warm-up

    def once() -> dict:
        model_time[0] = 0.0
        seconds, steps, outputs = run_engine(engine, prompts, max_tokens)
        return dict(seconds=seconds, steps=steps, outputs=outputs, model_ms=1e3 * model_time[0] / steps)

    return median_run(once, repeats)


class Services:
    """kvcache + model (+ scheduler) processes on free loopback ports."""

    def __init__(self, redis_url: str | None, model_args: list[str] | None = None) -> None:
        self.addr = {k: f"127.0.0.1:{free_port()}" for k in ("scheduler", "kvcache", "model")}
        self.common = [f"--{k}-addr={v}" for k, v in self.addr.items()]
        self.token = secrets.token_urlsafe(32)  # the internal token, handed to the services by environment
        self.procs: list[subprocess.Popen] = []
        self.start("kvcache", *([f"--redis-url={redis_url}", f"--deployment=bench{free_port()}"] if redis_url else []))
        if model_args is None:
            model_args = [
                "--device=cpu",
                "--torch-threads=1",
                f"--num-gpu-blocks={NUM_DEVICE_BLOCKS}",
                f"--num-cpu-blocks={NUM_HOST_BLOCKS}",
            ]
        self.start("model", *model_args)

    def start(self, kind: str, *args: str) -> None:
        from contracts.health import check_health

        cmd = [sys.executable, "-m", "scheduler_svc.cli", "serve", kind, *self.common, *args]
        self.procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "PICOVLLM_INTERNAL_TOKEN": self.token},
            )
        )
        deadline = time.monotonic() + 120
        while not check_health(self.addr[kind], timeout=0.5):
            if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                raise RuntimeError(f"{kind} service did not start")
            time.sleep(0.1)

    def config(self, **scheduler):
        from contracts.service_config import load_config

        overrides = {k: {"address": v} for k, v in self.addr.items()}
        overrides["scheduler"].update(scheduler)
        return load_config(env={}, overrides=overrides)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def bench_service_engine(services: Services, prompts, max_tokens, repeats: int, pipelined: bool = False) -> dict:
    from contracts.step import StepInput
    from scheduler_svc.remote_engine import build_service_engine

    engine = build_service_engine(services.config(async_scheduling=pipelined), token=services.token)
    run_engine(engine, prompts[:2], [4, 4])  # warm-up
    kv, model = engine.kv, engine.model

    def once() -> dict:
        kv.num_commits, kv.commit_seconds, model.num_steps, model.step_seconds = 0, 0.0, 0, 0.0
        seconds, steps, outputs = run_engine(engine, prompts, max_tokens)
        return dict(
            seconds=seconds,
            steps=steps,
            outputs=outputs,
            apply_ms=1e3 * kv.commit_seconds / max(kv.num_commits, 1),
            step_ms=1e3 * model.step_seconds / max(model.num_steps, 1),
        )

    result = median_run(once, repeats)
    # The floor of one Step call: an empty step (no sequences) does no model work.
    t = time.perf_counter()
    for _ in range(200):
        model.step(StepInput())
    result["empty_step_ms"] = 1e3 * (time.perf_counter() - t) / 200
    engine.kv.transport.close()
    model.close()
    return result


def bench_generate(services: Services, prompts, max_tokens, repeats: int) -> dict:
    from scheduler_svc.client import Client

    services.start("scheduler", "--metrics-port=0")

    def one(i: int) -> list[int]:
        with Client(services.addr["scheduler"], timeout=600) as c:
            return c.complete(prompts[i], temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True)[1]

    one(0)  # warm-up

    def once() -> dict:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = dict(enumerate(pool.map(one, range(len(prompts)))))
        return dict(seconds=time.perf_counter() - start, outputs=outputs)

    return median_run(once, repeats)


def start_redis() -> tuple[subprocess.Popen | None, str | None]:
    if shutil.which("redis-server") is None:
        return None, None
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def versions() -> dict[str, str]:
    import google.protobuf
    import grpc
    import torch

    from bench.common import environment

    env = environment()
    env.pop("triton", None)
    env["device"] = f"CPU only: {os.cpu_count()} cores ({platform.machine()}); every process on the CPU"
    env.update(grpcio=grpc.__version__, protobuf=google.protobuf.__version__, torch_threads="1 (every process)")
    try:
        import redis

        env["redis-py"] = redis.__version__
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, timeout=10).stdout.split()
        env["redis-server"] = next((w.split("=")[1] for w in out if w.startswith("v=")), "-")
    except (ImportError, OSError):
        env["redis-py"] = "-"
    del torch
    return env


def row(name: str, r: dict, tokens: int, base: dict) -> str:
    tok_s = tokens / r["seconds"]
    ms = f"{1e3 * r['seconds'] / r['steps']:.2f}" if "steps" in r else "-"
    share = tok_s / (tokens / base["seconds"])
    return f"| {name} | {r['seconds']:.2f} | {tok_s:,.0f} | {share:.0%} | {r.get('steps', '-')} | {ms} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--redis", action="store_true", help="also run the KV-cache service on a throwaway redis-server")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode; the median is reported")
    p.add_argument("--out", default=None, help="write a markdown result here")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    prompts, max_tokens = make_workload(args.num_seqs)
    tokens = sum(max_tokens)
    base = bench_embedded(prompts, max_tokens, args.repeats)
    results = {"embedded": base}
    variants = [("memory", None)]
    redis_proc = None
    if args.redis:
        redis_proc, url = start_redis()
        if url:
            variants.append(("redis", url))
    try:
        for store, url in variants:
            services = Services(url)
            try:
                results[f"service ({store} store), engine here"] = bench_service_engine(
                    services, prompts, max_tokens, args.repeats
                )
                results[f"service ({store} store), engine here, pipelined"] = bench_service_engine(
                    services, prompts, max_tokens, args.repeats, pipelined=True
                )
                if store == "memory":
                    results[f"service ({store} store), Generate"] = bench_generate(
                        services, prompts, max_tokens, args.repeats
                    )
            finally:
                services.close()
    finally:
        if redis_proc is not None:
            redis_proc.kill()
    for name, r in results.items():
        assert r["outputs"] == base["outputs"], f"{name}: outputs differ from embedded mode"

    lines = [
        f"Workload: {args.num_seqs} requests, prompts of 16-200 random token ids, 64-256 output tokens each "
        f"({tokens} in all), greedy, ignore_eos; bundled stories260k, fp32; device pool {NUM_DEVICE_BLOCKS} blocks, "
        f"host pool {NUM_HOST_BLOCKS}. Every mode produced the same tokens.",
        "",
        "| mode | seconds | tok/s | vs embedded | steps | ms/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [row(name, r, tokens, base) for name, r in results.items()]
    lines += [
        "",
        "Per-step cost of the internal calls (engine here; means over the median run):",
        "",
        "| store | ApplyStep ms | model Step ms (remote) | model ms (embedded, local) | empty Step ms (RPC floor) | "
        "RPC overhead ms/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        if "apply_ms" in r:
            pipelined = name.endswith("pipelined")
            if pipelined:  # steps go over the step stream, overlapped: no per-call time to compare
                step, overhead = "- (streamed)", "-"
            else:
                step, overhead = f"{r['step_ms']:.3f}", f"{r['apply_ms'] + r['step_ms'] - base['model_ms']:.3f}"
            lines.append(
                f"| {name.split('(')[1].split()[0]}{', pipelined' if pipelined else ''} | {r['apply_ms']:.3f} | "
                f"{step} | {base['model_ms']:.3f} "
                f"| {r['empty_step_ms']:.3f} | {overhead} |"
            )
    lines += [
        "",
        "RPC overhead = ApplyStep + remote Step - local model time (the KV ops on the scheduler's local copy "
        "cost the same in both modes). ApplyStep overlaps the model call: its column is the engine's time spent on it "
        "outside that call. Each figure is from the median of the runs; the services share the machine's "
        "cores with the benchmark, so compare figures as ratios within one run.",
    ]
    body = "\n".join(lines)
    print(body)
    if args.out:
        from bench.common import write_result

        write_result(args.out, "Service mode vs embedded on the CPU", versions(), body)


if __name__ == "__main__":
    main()
