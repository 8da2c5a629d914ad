"""The FP8 KV cache (kv_cache_dtype="fp8": float8_e4m3fn, scale 1): every kernel that writes the
cache rounds as the reference does (pico_kernels.reference.to_cache: clamped, nearest even), bit
for bit, and every kernel that reads it matches the reference on the same FP8 cache."""

from __future__ import annotations

import math

import pytest
import torch

from model_svc.layers import RotaryEmbedding
from pico_kernels.reference import (
    cascade_decode_attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    qk_norm_rope_store_ref,
    store_kvcache_ref,
    to_cache,
)
from pico_kernels.triton_fused import qk_norm_rope_store
from pico_kernels.triton_ops import TRITON_OPS, decode_with_config, prefill_with_config, store_kvcache
from tests.kernels.test_cascade import make_shared_prefix_kv
from tests.kernels.test_kernels import assert_matches, make_paged_kv, make_query, nan_like

FP8 = torch.float8_e4m3fn


def every_bf16_value() -> torch.Tensor:
    """Every finite bfloat16, as 510 rows of 128 (the patterns past the finite ones padded with 0)."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = values[values.isfinite()]
    padded = torch.zeros(510 * 128, dtype=torch.bfloat16)
    padded[: values.numel()] = values
    return padded.view(510, 1, 128)


def test_reference_clamps_and_rounds_to_nearest_even():
    x = torch.tensor([1000.0, -1000.0, 448.0, 460.0, 1.0625, 1.1875, 0.003, -0.0029, 0.0], dtype=torch.float32)
    got = to_cache(x, FP8).float()
    # 1.0625 lies halfway between 1.0 and 1.125: to the even mantissa; 1.1875 likewise to 1.25.
    # Subnormals step by 2**-9 (0.00195): 0.003 -> 0.0039.
    want = torch.tensor([448.0, -448.0, 448.0, 448.0, 1.0, 1.25, 2**-8, -(2**-9), 0.0])
    assert torch.equal(got, want)
    assert to_cache(x, torch.bfloat16).dtype == torch.bfloat16  # other caches: a plain cast


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_store_rounds_every_value_as_the_reference(device, src_dtype):
    """Every finite bf16 value (and, in fp32, the same values nudged off the grid) stored by
    the Triton kernel equals the reference's FP8 bits, saturation and subnormals included."""
    values = every_bf16_value().to(device)
    key = values.to(src_dtype)
    if src_dtype == torch.float32:  # off the bf16 grid: exercises rounding of long mantissas
        key = key * (1 + 2**-12)
    value = -key
    num_tokens = key.shape[0]
    block_size = 16
    num_blocks = num_tokens // block_size + 1
    slots = torch.arange(num_tokens, dtype=torch.int64, device=device)
    caches = {name: [torch.zeros((num_blocks, block_size, 1, 128), dtype=FP8, device=device) for _ in range(2)]
              for name in ("got", "want")}  # fmt: skip
    store_kvcache(key, value, *caches["got"], slots)
    store_kvcache_ref(key, value, *caches["want"], slots)
    for src, got, want in zip((key, value), caches["got"], caches["want"]):
        got, want = got.view(torch.uint8).reshape(-1)[: src.numel()], want.view(torch.uint8).reshape(-1)[: src.numel()]
        bad = got != want
        assert not bad.any(), (src.reshape(-1)[bad][:8].tolist(), got[bad][:8].tolist(), want[bad][:8].tolist())


def test_fused_store_rounds_as_the_unfused_path(device):
    """q/k norm + rotary + store into FP8 caches: K and V bit for bit as the reference's store of
    the same rotated values; q as with a 16-bit cache."""
    torch.manual_seed(3)
    n, hq, hkv, d = 6, 4, 2, 64
    qkv = (torch.randn(n, hq + 2 * hkv, d) * 4).to(device, torch.bfloat16)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    rope_cache = RotaryEmbedding(d, 64, 10000.0).cos_sin_cache.to(device, torch.bfloat16)
    positions = torch.tensor([3, 0, 63, 9, 17, 5], dtype=torch.int64, device=device)
    slots = torch.tensor([5, 2, -1, 7, 0, 11], dtype=torch.int64, device=device)
    weights = tuple((torch.randn(d) * 0.3 + 1.0).to(device, torch.bfloat16) for _ in range(2))
    caches = {name: [torch.zeros(3, 4, hkv, d, dtype=FP8, device=device) for _ in range(2)] for name in ("got", "want")}
    bf16_caches = [torch.zeros(3, 4, hkv, d, dtype=torch.bfloat16, device=device) for _ in range(2)]
    got = qk_norm_rope_store(q, k, v, positions, rope_cache, *weights, 1e-6, *caches["got"], slots)
    want = qk_norm_rope_store(q, k, v, positions, rope_cache, *weights, 1e-6, *bf16_caches, slots)
    assert torch.equal(got, want)
    for got_cache, bf16_cache in zip(caches["got"], bf16_caches):  # the 16-bit store, then rounded
        assert torch.equal(got_cache.view(torch.uint8), to_cache(bf16_cache, FP8).view(torch.uint8))
    qk_norm_rope_store_ref(q, k, v, positions, rope_cache, *weights, 1e-6, *caches["want"], slots)
    assert torch.equal(caches["got"][1].view(torch.uint8), caches["want"][1].view(torch.uint8))  # V: a copy
    close = (caches["got"][0].float() - caches["want"][0].float()).abs() <= 0.125 * caches["want"][0].float().abs()
    assert close.all()  # K: the torch path's bf16 rotary may land a bf16 ulp away, then one FP8 step


def fp8_paged_kv(lens, heads, head_dim, block_size, device, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(
        lens, heads[1], head_dim, block_size, torch.bfloat16, device, gen
    )
    q = make_query(len(lens), heads[0], heads[1], head_dim, torch.bfloat16, device, gen)
    return q, to_cache(k_cache, FP8), to_cache(v_cache, FP8), block_tables, seq_lens


@pytest.mark.parametrize("lens", [[77], [1, 16, 33, 100, 5]], ids=["b1", "ragged"])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)], ids=["gqa2", "gqa8"])
def test_decode_reads_fp8(device, lens, heads):
    q, k_cache, v_cache, block_tables, seq_lens = fp8_paged_kv(lens, heads, 64, 16, device, seed=4)
    scale = 1.0 / math.sqrt(64)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = decode_with_config(q, k_cache, v_cache, block_tables, seq_lens, scale, out=nan_like(q.contiguous()))
    assert_matches(out, ref)


def test_prefill_reads_fp8(device):
    gen = torch.Generator().manual_seed(6)
    q_lens, cached = [19, 1, 40], [0, 30, 17]
    lens = [c + n for c, n in zip(cached, q_lens)]
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(lens, 2, 64, 16, torch.bfloat16, device, gen)
    k_cache, v_cache = to_cache(k_cache, FP8), to_cache(v_cache, FP8)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(device, torch.int32)
    q = make_query(sum(q_lens), 4, 2, 64, torch.bfloat16, device, gen)
    scale = 1.0 / math.sqrt(64)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    out = prefill_with_config(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=nan_like(q.contiguous())
    )
    assert_matches(out, ref)


def test_cascade_reads_fp8(device):
    gen = torch.Generator().manual_seed(7)
    lens, prefix_blocks, page = [64, 70, 100], 2, 16
    k_cache, v_cache, block_tables, seq_lens = make_shared_prefix_kv(
        lens, prefix_blocks, 2, 64, page, torch.bfloat16, device, gen
    )
    k_cache, v_cache = to_cache(k_cache, FP8), to_cache(v_cache, FP8)
    q = make_query(len(lens), 4, 2, 64, torch.bfloat16, device, gen).contiguous()
    scale = 1.0 / math.sqrt(64)
    prefix = torch.tensor([prefix_blocks], dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale, prefix, block_tables.shape[1])
    assert_matches(TRITON_OPS.cascade_decode_attention(*args), cascade_decode_attention_ref(*args))
