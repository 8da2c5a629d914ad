"""cascade_decode_attention_store (pico_kernels.triton_cascade): the prefix launch that also norms and
rotates q and writes the step's K/V must give, to the bit, what qk_norm_rope_store followed by
cascade attention gives: the same output and the same caches.

On a GPU the per-head sum of squares of the norm reduces in another order in the fused
program's tile than in qk_norm_rope_store's (different shapes), so a few values may lie one
ulp apart there; the interpreter reduces alike and must match bit for bit.

Inputs as in test_cascade.py (shuffled physical blocks, NaN wherever nothing may be read), with
q, k, v views into one projection and positions / slots slices of one packed tensor, as the
runner passes them. Row tiles of the interpreter's 16 rows make a group of 3 query heads
straddle tiles, so a sequence's K/V is written by two programs.
"""

from __future__ import annotations

import pytest
import torch

from model_svc.layers import RotaryEmbedding
from pico_kernels.triton_cascade import (
    CascadeConfig,
    StepKV,
    cascade_decode_attention_store,
    cascade_with_config,
    fuses_store,
)
from pico_kernels.triton_decode import DecodeConfig
from pico_kernels.triton_fused import qk_norm_rope_store
from pico_kernels.triton_prefill import PrefillConfig
from tests.kernels.test_cascade import make_shared_prefix_kv
from tests.kernels.test_fused import _qkv_views, _randn


def assert_same(got: torch.Tensor, want: torch.Tensor, cache: bool) -> None:
    """Bit for bit (NaN where NaN) under the interpreter. On a GPU: a cache within one ulp and
    all but a few of its elements bit for bit; an attention output (which such a K value
    moves a little) within a few ulps."""
    if got.device.type == "cpu":
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        return
    ulp = torch.finfo(got.dtype).eps
    tol = ulp if cache else 8 * ulp
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)
    if cache:
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.float().mean() > 0.97, f"{(~same).sum()} of {same.numel()} elements differ"


SMALL = CascadeConfig(
    PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, split_p=True),
    DecodeConfig(block_n=16, num_warps=4, num_stages=1),
)


def _step(lens, prefix_blocks, hq, hkv, head_dim, dtype, device, qk_norm, skip_seq=None):
    """Caches holding everything but each sequence's last token, that token's q/k/v, and its
    slot (-1 for skip_seq, whose last token is then already in the cache)."""
    gen = torch.Generator().manual_seed(hq * 100 + head_dim + prefix_blocks)
    page = 4
    k_cache, v_cache, tables, seq_lens = make_shared_prefix_kv(
        lens, prefix_blocks, hkv, head_dim, page, dtype, device, gen
    )
    batch = len(lens)
    last = seq_lens.long() - 1
    slots = tables[torch.arange(batch, device=device), last // page].long() * page + last % page
    for b in range(batch):  # the step writes these; NaN until then
        if b != skip_seq:
            k_cache.view(-1, hkv, head_dim)[slots[b]] = float("nan")
            v_cache.view(-1, hkv, head_dim)[slots[b]] = float("nan")
    if skip_seq is not None:
        slots[skip_seq] = -1
    q, k, v = _qkv_views(batch, hq, hkv, head_dim, dtype, device, with_v=True)
    packed = torch.cat([torch.tensor([3], device=device), last, torch.tensor([9], device=device), slots])
    positions, slot_mapping = packed[1 : batch + 1], packed[batch + 2 :]
    weights = (None, None)
    if qk_norm:
        weights = tuple(_randn(head_dim, dtype=dtype, device=device, scale=0.3) + 1.0 for _ in range(2))
    rope = RotaryEmbedding(head_dim, 256, 10000.0).cos_sin_cache.to(device, dtype)
    step = StepKV(k, v, positions, rope, weights[0], weights[1], 1e-6, slot_mapping)
    return q, step, k_cache, v_cache, tables, seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (2, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize(
    "prefix_blocks,num_chunks,qk_norm", [(3, 2, True), (3, 1, False), (0, None, True), (2, 3, True)]
)
def test_fused_store_matches_separate_launches(device, dtype, heads, prefix_blocks, num_chunks, qk_norm):
    hq, hkv = heads
    head_dim = 16
    lens = [prefix_blocks * 4 + n for n in (1, 6, 9, 3, 13, 2)]
    q, step, k_cache, v_cache, tables, seq_lens = _step(
        lens, prefix_blocks, hq, hkv, head_dim, dtype, device, qk_norm, skip_seq=None if qk_norm else 3
    )
    prefix = torch.tensor([prefix_blocks], dtype=torch.int32, device=device)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    scale = head_dim**-0.5

    (k1, v1), (k2, v2) = caches
    q_normed = qk_norm_rope_store(
        q,
        step.k,
        step.v,
        step.positions,
        step.cos_sin_cache,
        step.q_norm_weight,
        step.k_norm_weight,
        step.eps,
        k1,
        v1,
        step.slot_mapping,
    )
    want = cascade_with_config(
        q_normed, k1, v1, tables, seq_lens, scale, prefix, tables.shape[1], config=SMALL, num_chunks=num_chunks
    )
    got = cascade_with_config(
        q, k2, v2, tables, seq_lens, scale, prefix, tables.shape[1], config=SMALL, num_chunks=num_chunks, store=step
    )
    assert not got.isnan().any()
    assert_same(got, want, cache=False)
    assert_same(k2, k1, cache=True)
    assert_same(v2, v1, cache=True)


def test_public_entry_point_and_head_dims(device):
    assert fuses_store(128) and fuses_store(16) and not fuses_store(8) and not fuses_store(96)
    lens = [9, 10, 12]
    q, step, k_cache, v_cache, tables, seq_lens = _step(lens, 2, 4, 2, 32, torch.float32, device, True)
    prefix = torch.tensor([2], dtype=torch.int32, device=device)
    k1, v1 = k_cache.clone(), v_cache.clone()
    q_normed = qk_norm_rope_store(
        q,
        step.k,
        step.v,
        step.positions,
        step.cos_sin_cache,
        step.q_norm_weight,
        step.k_norm_weight,
        step.eps,
        k1,
        v1,
        step.slot_mapping,
    )
    want = cascade_with_config(q_normed, k1, v1, tables, seq_lens, 0.2, prefix, 2)
    got = cascade_decode_attention_store(q, step, k_cache, v_cache, tables, seq_lens, 0.2, prefix, 2)
    assert_same(got, want, cache=False)
    assert_same(k_cache, k1, cache=True)
    assert_same(v_cache, v1, cache=True)
