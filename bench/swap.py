"""Preemption under memory pressure (BENCHMARKS.md section 4): a device pool that holds a
quarter of the workload's peak KV; preemption by swapping to the host pool vs by recompute.
Reports throughput, preemptions and the bytes moved between the pools.

    python bench/swap.py [--model qwen3-0.6b] [--out bench/results/swap_h200.md]
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


def run(args, mode: str) -> dict:
    from model_svc.kv_cache import KVCachePools
    from scheduler_svc import SamplingParams

    rng = random.Random(0)
    prompts = [
        [rng.randrange(10000) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(args.num_requests)
    ]
    outputs = [rng.randint(args.min_len, args.max_len) for _ in prompts]
    peak_blocks = sum(-(-(len(p) + o) // 16) for p, o in zip(prompts, outputs))
    device_blocks = peak_blocks // 4
    llm, runner = make_llm(
        args.model,
        args.device,
        num_gpu_blocks=device_blocks,
        num_cpu_blocks=peak_blocks,
        preemption_mode=mode,
        enable_prefix_caching=False,
    )
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for o in outputs]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    sync = device_sync(args.device)
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - t
    stats = llm.engine.scheduler.stats
    block_bytes = KVCachePools.bytes_per_block(runner.config, 16, runner.kv_dtype)
    moved = (stats.num_swapped_out_blocks + stats.num_swapped_in_blocks) * block_bytes
    return {
        "mode": mode,
        "seconds": seconds,
        "tok_s": sum(len(o.token_ids) for o in outs) / seconds,
        "preemptions": stats.num_preemptions,
        "moved_gb": moved / 1e9,
        "device_blocks": device_blocks,
        "peak_blocks": peak_blocks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment()
    results = [run(args, "swap"), run(args, "recompute")]
    r0 = results[0]
    lines = [
        f"device pool {r0['device_blocks']} blocks = a quarter of the peak need ({r0['peak_blocks']} blocks of 16 "
        "tokens)",
        "",
        "| preemption | seconds | output tok/s | preemptions | bytes moved between pools |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['mode']} | {r['seconds']:.2f} | {r['tok_s']:,.0f} | {r['preemptions']} | {r['moved_gb']:.2f} GB |"
            for r in results
        ),
    ]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Swap vs recompute under memory pressure", env, "\n".join(lines))


if __name__ == "__main__":
    main()
