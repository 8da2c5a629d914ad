"""Where one engine step's time goes: cProfile over a reduced headline workload.

    python bench/profile_step.py --num-seqs 128 --max-len 512 [--overlap]

Time spent inside torch calls that copy to or from the GPU is where the host waits for it.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_overlap_flag  # noqa: E402
from bench.throughput import make_workload, run_embedded  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--enforce-eager", action="store_true")
    add_overlap_flag(ap)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    prompts, params = make_workload(args.num_seqs, args.max_len, args.max_len)
    llm, _ = run_embedded(args)
    llm.generate(prompts[:4], params[:4])
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params)
    prof.disable()
    seconds = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    steps = llm.engine.scheduler.stats.num_steps
    print(
        f"{n} tokens in {seconds:.2f} s under cProfile: {n / seconds:,.0f} tok/s, {steps} steps, "
        f"{seconds / steps * 1e3:.2f} ms/step"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
