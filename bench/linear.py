"""Skinny linear (kernels.triton_linear) vs cuBLAS (F.linear) on Qwen3-0.6B's projections at
decode batch sizes: time per call inside a CUDA graph (as the decode step runs them), weight
bytes over time, and that as a fraction of the copy bandwidth measured in the same run.

    python bench/linear.py [--out bench/results/linear_h200.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, environment, write_result  # noqa: E402

# name: (N, K) of Qwen3-0.6B (hidden 1024, 16 q heads and 8 kv heads of 128, intermediate 3072)
SHAPES = {"q|k|v": (4096, 1024), "o": (1024, 2048), "gate|up": (6144, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)}


def graph_us(fn, calls: int = 20, reps: int = 20) -> float:
    """Device time per call of fn, with `calls` calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
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
    from kernels.triton_linear import skinny_linear

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    lines = [
        "| projection | N x K | rows | cuBLAS us | skinny us | speed-up | skinny TB/s | % of copy | max ulp diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    total = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn((n, k), device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn((m, k), device=dev, dtype=torch.bfloat16, generator=gen)
            ref, out = F.linear(x, w), skinny_linear(x, w)
            ulps = ((out.float() - ref.float()).abs() / (torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=2**-6))).max().item()
            cublas, skinny = graph_us(lambda: F.linear(x, w)), graph_us(lambda: skinny_linear(x, w))
            tbs = n * k * 2 / skinny / 1e6
            lines.append(f"| {name} | {n} x {k} | {m} | {cublas:.1f} | {skinny:.1f} | {cublas / skinny:.2f}x | {tbs:.2f} | {tbs * 1e12 / bw:.0%} | {ulps:.1f} |")
            t = total.setdefault(m, [0.0, 0.0])
            per_step = 1 if name == "lm_head" else 28  # layers of Qwen3-0.6B
            t[0] += cublas * per_step
            t[1] += skinny * per_step
        del w
    lines += ["", f"copy bandwidth {bw / 1e12:.2f} TB/s (read + written)", "",
              "Per decode step (28 layers + lm_head), projections only:"]
    lines += [f"- {m} rows: cuBLAS {c / 1e3:.3f} ms, skinny {s / 1e3:.3f} ms" for m, (c, s) in total.items()]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Skinny linear vs cuBLAS (decode-sized batches)", env, "\n".join(lines))


if __name__ == "__main__":
    main()
