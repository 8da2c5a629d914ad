"""The shapes, inputs, ceilings and timing of bench/attention.py's tables."""

from __future__ import annotations

import math
import time
import traceback
from functools import partial

import torch
from triton.testing import do_bench

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(D)
KV_LIMIT_BYTES = 40e9
DEVICE = "cuda"


def bench_ms(fn, rep: int) -> float:
    return do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median")


def device_num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------ ceilings


def measure_ceilings(rep: int) -> dict:
    nbytes = 2 << 30
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(partial(dst.copy_, src), rep)
    read_ms = bench_ms(partial(src.sum, dtype=torch.float32), rep)  # read-only, for context
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    mm_ms = bench_ms(partial(torch.matmul, a, b), rep)
    del a, b
    torch.cuda.empty_cache()
    return {
        "copy_tbs": 2 * nbytes / copy_ms / 1e9,
        "read_tbs": nbytes / read_ms / 1e9,
        "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
    }


# ------------------------------------------------------------------------------ inputs


def paged_cache(batch: int, seq_len: int, gen: torch.Generator):
    """A shuffled pool holding batch sequences of seq_len tokens (random bf16 K/V)."""
    blocks_per_seq = -(-seq_len // PAGE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn((num_blocks, PAGE, HKV, D), dtype=DTYPE, device=DEVICE, generator=gen)
    v_cache = torch.randn((num_blocks, PAGE, HKV, D), dtype=DTYPE, device=DEVICE, generator=gen)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=gen)
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, block_tables, seq_lens


def run_section(name: str, fn, *args, default=None):
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception:
        traceback.print_exc()
        result = default
    print(f"== {name}: {time.perf_counter() - start:.1f} s", flush=True)
    return result
