"""Decode attention alone over bf16 and FP8 KV caches (pico_kernels.triton_decode): the
default config that the model takes for each cache against the tensor-core loop, on
Qwen3-0.6B's heads (16 query / 8 KV heads of 128) in 16-token pages of a shuffled pool.

Time per launch (median of triton.testing.do_bench, L2 flushed between launches), the K/V
bytes read over that time, and that as a fraction of the copy bandwidth measured in the same
run; the error is relative to pico_kernels.reference over the same cache.

    python bench/decode_cache.py [--out bench/results/decode_cache_h200.md]
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, environment, write_result  # noqa: E402
from bench.kernel_setup import bench_ms, rel_err  # noqa: E402

HQ, HKV, D, PAGE = 16, 8, 128, 16
SHAPES = (
    (512, 800),
    (256, 800),
    (192, 800),
    (128, 800),
    (256, 4000),
    (32, 4000),
    (8, 8000),
    (1, 16384),
)  # (sequences, tokens each)
CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def shuffled_cache(batch: int, seq_len: int, dtype: torch.dtype, gen: torch.Generator):
    blocks_per_seq = -(-seq_len // PAGE)
    num_blocks = batch * blocks_per_seq
    k_cache, v_cache = (
        torch.randn((num_blocks, PAGE, HKV, D), device="cuda", generator=gen).to(dtype) for _ in range(2)
    )
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, tables, seq_lens


def describe(config) -> str:
    loop = "lanes" if config.lanes else "tensor-core"
    return f"{loop} {config.block_n} / {config.num_warps} / {config.num_stages}"


def main() -> None:
    from pico_kernels.reference import paged_decode_attention_ref
    from pico_kernels.triton_common import num_sms, use_pdl
    from pico_kernels.triton_decode import decode_with_config, default_decode_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rep", type=int, default=200, help="do_bench's time budget a config, ms")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    pdl, sms = use_pdl(torch.device("cuda")), num_sms(torch.device("cuda"))
    scale = 1.0 / math.sqrt(D)
    lines = [
        "| sequences x tokens | cache | config (loop, block_n / warps / stages) | us | K/V TB/s | % of copy | "
        "rel. error |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for batch, seq_len in SHAPES:
        for name, dtype in CACHES.items():
            k_cache, v_cache, tables, seq_lens = shuffled_cache(batch, seq_len, dtype, gen)
            q = torch.randn((batch, HQ, D), device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty_like(q)
            ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale)
            shipped = default_decode_config(q.dtype, D, batch, pdl, dtype, HQ // HKV, HKV, sms)
            tensor_core = default_decode_config(q.dtype, D, batch, pdl, dtype)
            configs = {"default": shipped} | ({"tensor-core loop": tensor_core} if tensor_core != shipped else {})
            kv_bytes = 2 * batch * seq_len * HKV * D * k_cache.element_size()
            for label, config in configs.items():
                launch = partial(decode_with_config, q, k_cache, v_cache, tables, seq_lens, scale, config, out=out)
                err = rel_err(launch(), ref)
                us = bench_ms(launch, args.rep) * 1e3
                tbs = kv_bytes / us / 1e6
                lines.append(
                    f"| {batch} x {seq_len} | {name} | {label}: {describe(config)} | {us:.1f} | {tbs:.2f} | "
                    f"{tbs * 1e12 / bw:.0%} | {err:.1e} |"
                )
                print(lines[-1], flush=True)
    lines += ["", f"copy bandwidth {bw / 1e12:.2f} TB/s (read + written); programmatic dependent launch {pdl}"]
    print(lines[-1])
    if args.out:
        write_result(args.out, "Decode attention alone: bf16 and FP8 KV caches", env, "\n".join(lines))


if __name__ == "__main__":
    main()
