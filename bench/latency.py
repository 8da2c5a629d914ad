"""Batch-1 latency: time per output token for one request with a 512-token prompt
(issue 26's target: <= 0.50 ms per token for Qwen3-0.6B on the H200).

    python bench/latency.py [--out bench/results/latency_h200.md]

Rows: first the path users take (`LLM(model=dir)` with every default and the real Qwen2
tokenizer, in a fresh process, timed through the public `generate`), then the engine over an
in-memory model without a tokenizer: the synchronous step, and overlapped scheduling (the next
step is scheduled while this one runs; the default on CUDA).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_sync, environment, make_llm, write_result  # noqa: E402
from contracts.engine_fields import KV_CACHE_DTYPES  # noqa: E402


def measure(args, overlap: bool) -> tuple[float, float]:
    from scheduler_svc import SamplingParams

    llm, _ = make_llm(
        args.model,
        args.device,
        num_gpu_blocks=4096,
        max_num_seqs=8,
        async_scheduling=overlap,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    prompt = [random.Random(0).randrange(10000) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([prompt], params)  # warm-up
    engine = llm.engine
    sync = device_sync(args.device)
    sync()
    start = time.perf_counter()
    engine.add_request(prompt, params)
    first = None
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None:
                first = time.perf_counter()
            n = len(out.token_ids)
    sync()
    end = time.perf_counter()
    return (first - start) * 1e3, (end - first) / max(1, n - 1) * 1e3


def _user_path_main(model_dir: str, prompt_len: int, output_len: int, kv_cache_dtype: str, conn) -> None:
    """The child process of user_path_latency."""
    from scheduler_svc import SamplingParams
    from scheduler_svc.llm import LLM

    llm = LLM(model=model_dir, kv_cache_dtype=kv_cache_dtype)
    prompt = [random.Random(0).randrange(10000) for _ in range(prompt_len)]
    sync = device_sync(llm.engine.model.device)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up

    def best_of_three(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
        times = []
        for _ in range(3):
            llm.engine.reset_prefix_cache()  # every run prefills the whole prompt
            sync()
            t = time.perf_counter()
            llm.generate(prompt, params)
            sync()
            times.append(time.perf_counter() - t)
        return min(times)

    first = best_of_three(1)
    tpot = (best_of_three(output_len + 1) - first) / output_len
    conn.send((first * 1e3, tpot * 1e3, llm.engine.async_scheduling))
    conn.close()


def user_path_latency(args) -> tuple[float, float, bool]:
    """TTFT and time per output token in ms through the public API: `LLM(model=dir)` with
    every default over a directory of random weights and the real Qwen2 tokenizer
    (bench/serve.py's prepare_model), in a fresh process. TTFT is a one-token `generate`, the
    time per output token the difference to a (1 + output_len)-token one over output_len (best
    of three each, every run from a cold prefix cache), and whether the engine overlapped its
    steps (its default: on CUDA)."""
    import shutil

    from bench.common import in_fresh_process
    from bench.serve import prepare_model

    model_dir, tmp = prepare_model(args.model)
    try:
        return in_fresh_process(
            "user-path latency run", _user_path_main, model_dir, args.prompt_len, args.output_len, args.kv_cache_dtype
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def profile_decode(args, steps: int = 64) -> None:
    """Where a batch-1 decode step's time goes: the device time of each kernel per step (CUDA
    graph nodes included), and the share of wall time the device was busy. A busy share well
    under 100 % means the host (or a sync) is the limit, not the kernels."""
    from scheduler_svc import SamplingParams

    llm, runner = make_llm(args.model, args.device, num_gpu_blocks=4096, max_num_seqs=8, async_scheduling=True)
    vocab = min(10000, runner.model.config.vocab_size)
    prompt = [random.Random(0).randrange(vocab) for _ in range(args.prompt_len)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    llm.generate([prompt], params)  # warm-up
    engine = llm.engine
    engine.add_request(prompt, params)
    for _ in range(8):  # past the prefill
        engine.step()
    sync = device_sync(args.device)
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in events)
    print(
        f"{steps} overlapped decode steps at batch 1: {wall / steps * 1e3:.3f} ms/step wall (profiler on), "
        f"device busy {busy_us / steps / 1e3:.3f} ms/step ({busy_us / 1e6 / wall:.0%} of wall)"
    )
    rows = sorted(events, key=lambda e: -e.self_device_time_total)[:30]
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for e in rows:
        print(f"{e.self_device_time_total / steps:9.1f} {e.count / steps:10.1f}  {e.key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="every row's KV cache")
    ap.add_argument(
        "--user-path",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first time the public API: LLM(model=dir) with defaults and the real tokenizer, in a fresh process",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="instead of the table: device kernels and idle time of overlapped batch-1 decode steps",
    )
    args = ap.parse_args()
    if args.profile:
        profile_decode(args)
        return
    env = environment()
    lines = [
        "| path | overlapped scheduling | TTFT ms | time per output token ms |",
        "| --- | --- | ---: | ---: |",
    ]
    if args.user_path:
        ttft, tpot, overlap = user_path_latency(args)
        lines.append(
            f"| user path: LLM(model=dir), defaults, Qwen2 tokenizer, fresh process | {'yes' if overlap else 'no'} "
            f"| {ttft:.2f} | {tpot:.3f} |"
        )
    for overlap in (False, True):
        ttft, tpot = measure(args, overlap)
        lines.append(
            f"| in-memory model, token ids, no tokenizer | {'yes' if overlap else 'no'} | {ttft:.2f} | {tpot:.3f} |"
        )
    lines += ["", f"KV cache: {args.kv_cache_dtype}; target: <= 0.50 ms per output token"]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, f"Batch-1 latency ({args.prompt_len}-token prompt)", env, "\n".join(lines))


if __name__ == "__main__":
    main()
