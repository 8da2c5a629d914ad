"""Batch-1 latency: time per output token for one request with a 512-token prompt
(BENCHMARKS.md section 3 target: <= 1.0 ms per token for Qwen3-0.6B on the H200).

    python bench/latency.py [--out bench/results/latency_h200.md]

Rows: the synchronous step, and overlapped scheduling (the next step is scheduled while this
one runs; the default on CUDA).
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


def measure(args, overlap: bool) -> tuple[float, float]:
    from scheduler_svc import SamplingParams

    llm, _ = make_llm(
        args.model,
        args.device,
        num_gpu_blocks=4096,
        max_num_seqs=8,
        async_scheduling=overlap,
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
        "| overlapped scheduling | TTFT ms | time per output token ms |",
        "| --- | ---: | ---: |",
    ]
    for overlap in (False, True):
        ttft, tpot = measure(args, overlap)
        lines.append(f"| {'yes' if overlap else 'no'} | {ttft:.2f} | {tpot:.3f} |")
    lines += ["", "target: <= 1.0 ms per output token"]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Batch-1 latency (512-token prompt)", env, "\n".join(lines))


if __name__ == "__main__":
    main()
