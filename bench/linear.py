"""The Triton small-batch projection (pico_kernels.triton_linear.gemv) vs cuBLAS (F.linear) on
Qwen3-0.6B's projections at decode batch sizes: time per call inside a CUDA graph (as the
decode step runs them), weight bytes over time, and that as a fraction of the copy bandwidth
measured in the same run.

Weights come from HBM, as in the model (28 layers of them do not fit in L2): each call of a
graph reads another copy of the weight, with copies enough to span 256 MB.

    python bench/linear.py [--out bench/results/linear_h200.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, environment, ulps, write_result  # noqa: E402

# name: (N, K) of Qwen3-0.6B (hidden 1024, 16 q heads and 8 kv heads of 128, intermediate 3072)
SHAPES = {
    "q|k|v": (4096, 1024),
    "o": (1024, 2048),
    "gate|up": (6144, 1024),
    "down": (1024, 3072),
    "lm_head": (151936, 1024),
}


def graph_us(fn, copies: int = 1, calls: int = 40, reps: int = 10) -> float:
    """Device time per call of fn(i), with `calls` calls (i = call % copies) in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * reps)


def main() -> None:
    from pico_kernels.triton_linear import GEMV_MAX_ROWS, gemv

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    lines = [
        "| projection | N x K | rows | cuBLAS us | gemv us | gemv TB/s | gemv % of copy | cuBLAS / gemv | max ulp "
        "diff (gemv) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    total = {}
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn((n, k), device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5 for _ in range(copies)]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x, ws[0])
            cublas = graph_us(lambda i, x=x, ws=ws: F.linear(x, ws[i]), copies)
            if m <= GEMV_MAX_ROWS:
                g_ulps = ulps(gemv(x, ws[0]), ref)
                g = graph_us(lambda i, x=x, ws=ws: gemv(x, ws[i]), copies)
            else:
                g_ulps, g = float("nan"), float("nan")
            tbs = n * k * 2 / g / 1e6
            lines.append(
                f"| {name} | {n} x {k} | {m} | {cublas:.1f} | {g:.1f} | {tbs:.2f} | {tbs * 1e12 / bw:.0%} | "
                f"{cublas / g:.2f}x | {g_ulps:.1f} |"
            )
            t = total.setdefault(m, [0.0, 0.0])
            per_step = 1 if name == "lm_head" else 28  # layers of Qwen3-0.6B
            t[0] += cublas * per_step
            t[1] += g * per_step
        del ws
    lines += [
        "",
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read + written)",
        "",
        "Per decode step (28 layers + lm_head), projections only:",
    ]
    lines += [f"- {m} rows: cuBLAS {c / 1e3:.3f} ms, gemv {g / 1e3:.3f} ms" for m, (c, g) in total.items()]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Small-batch projections: gemv vs cuBLAS (weights from HBM)", env, "\n".join(lines))


if __name__ == "__main__":
    main()
