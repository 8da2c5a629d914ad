"""Sliding-window attention: the torch references against transformers' own mask, and the
Triton decode and prefill kernels against the references.

The reference must give what a dense attention under transformers'
`sliding_window_causal_mask_function` gives (a query at position p sees p - W < k <= p).
For the kernels, every block that lies wholly before every query's window is released: its
table entry points at a NaN block, as a released entry may hold anything, so a kernel that
reads one shows NaN. Inputs are random; shapes are small for the interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

from pico_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from pico_kernels.triton_ops import DecodeConfig, PrefillConfig, decode_with_config, prefill_with_config
from tests.kernels.test_kernels import assert_matches, make_paged_kv, make_query, nan_like

WINDOWS = [1, 5, 37, 500]  # one token, under a page, several pages, past every sequence


def release_out_of_window(block_tables, k_cache, first_query_pos: list[int], window: int, block_size: int) -> int:
    """Point each row's blocks that end before its first query's window at a NaN block (in
    place); returns how many entries were released."""
    nan_block = int(torch.isnan(k_cache.flatten(1)).all(1).nonzero()[0])
    released = 0
    for b, pos in enumerate(first_query_pos):
        num = max(0, pos - window + 1) // block_size  # blocks wholly before key pos - window + 1
        block_tables[b, :num] = nan_block
        released += num
    return released


def dense_hf_attention(q, k, v, scale, q_pos0: int, window: int):
    """One sequence, dense: transformers' sliding-window causal mask function decides which
    (query, key) pairs are visible. q (Lq, Hq, D), k/v (Lk, Hkv, D), keys from position 0."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    visible_fn = sliding_window_causal_mask_function(window)
    q_idx = torch.arange(q.shape[0])[:, None] + q_pos0
    kv_idx = torch.arange(k.shape[0])[None, :]
    zero = torch.zeros((), dtype=torch.long)
    mask = visible_fn(zero, zero, q_idx, kv_idx)  # (Lq, Lk) bool
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ vf).transpose(0, 1)


@pytest.mark.parametrize("window", [1, 3, 16, 40])
def test_reference_is_transformers_mask(window):
    """Prefill over a cached prefix and decode, per sequence, equal dense attention under
    transformers' mask; the reference never reads the released blocks."""
    gen = torch.Generator().manual_seed(21)
    q_lens, cached = [30, 1, 9], [0, 50, 23]
    lens = [c + n for c, n in zip(cached, q_lens)]
    k_cache, v_cache, tables, seq_lens = make_paged_kv(lens, 2, 8, 8, torch.float32, "cpu", gen)
    keys = [k_cache[tables[b, : -(-n // 8)].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)]
    values = [v_cache[tables[b, : -(-n // 8)].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)]
    release_out_of_window(tables, k_cache, cached, window, 8)
    q = make_query(sum(q_lens), 4, 2, 8, torch.float32, "cpu", gen)
    cu = torch.tensor([0, 30, 31, 40], dtype=torch.int32)
    out = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, 0.3, window=window)
    for b in range(3):
        want = dense_hf_attention(q[cu[b] : cu[b + 1]], keys[b], values[b], 0.3, cached[b], window)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], want, rtol=1e-5, atol=1e-5)
    q1 = make_query(3, 4, 2, 8, torch.float32, "cpu", gen)
    dec = paged_decode_attention_ref(q1, k_cache, v_cache, tables, seq_lens, 0.3, window=window)
    for b in range(3):
        want = dense_hf_attention(q1[b : b + 1], keys[b], values[b], 0.3, lens[b] - 1, window)
        torch.testing.assert_close(dec[b : b + 1], want, rtol=1e-5, atol=1e-5)


def test_window_past_the_context_is_full_attention():
    gen = torch.Generator().manual_seed(22)
    k_cache, v_cache, tables, seq_lens = make_paged_kv([40, 7], 2, 8, 16, torch.float32, "cpu", gen)
    q = make_query(2, 4, 2, 8, torch.float32, "cpu", gen)
    full = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.3)
    assert torch.equal(paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.3, window=40), full)
    assert not torch.allclose(paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.3, window=39), full)


# ---------------------------------------------------------------------------------------------
# Triton against the references


def run_windowed_decode(device, dtype, lens, window, block_size=8, heads=(4, 2), head_dim=16, **kwargs):
    gen = torch.Generator().manual_seed(23)
    k_cache, v_cache, tables, seq_lens = make_paged_kv(lens, heads[1], head_dim, block_size, dtype, device, gen)
    released = release_out_of_window(tables, k_cache, [n - 1 for n in lens], window, block_size)
    q = make_query(len(lens), *heads, head_dim, dtype, device, gen)
    scale = 1.0 / math.sqrt(head_dim)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale, window=window)
    out = decode_with_config(
        q, k_cache, v_cache, tables, seq_lens, scale, out=nan_like(q.contiguous()), window=window, **kwargs
    )
    assert_matches(out, ref)
    return released


# (window, splits): 3 splits cut the window into 16-token chunks that cross its lower edge and
# page edges (37), leave splits unused (5) or cut the whole context (500)
@pytest.mark.parametrize("window, num_splits", [(1, 1), (5, 3), (37, 1), (37, 3), (500, 3)])
def test_decode_window_matches_reference(device, window, num_splits):
    released = run_windowed_decode(device, torch.float32, [1, 9, 33, 70, 16], window, num_splits=num_splits)
    assert (released > 0) == (window < 60)  # the short windows really release blocks


def test_decode_window_bf16_and_gpu_tiles(device):
    """A 64-token tile over a window under one tile; more splits than the window has chunks
    (the unused ones store nothing)."""
    config = DecodeConfig(block_n=64, num_warps=4, num_stages=5)
    run_windowed_decode(device, torch.bfloat16, [200, 3, 130], 37, block_size=16, config=config)
    run_windowed_decode(device, torch.bfloat16, [200, 3, 130], 37, block_size=16, num_splits=8)


def run_windowed_prefill(device, dtype, q_lens, cached, window, block_size=8, heads=(4, 2), head_dim=16, **kwargs):
    gen = torch.Generator().manual_seed(24)
    lens = [c + n for c, n in zip(cached, q_lens)]
    k_cache, v_cache, tables, seq_lens = make_paged_kv(lens, heads[1], head_dim, block_size, dtype, device, gen)
    released = release_out_of_window(tables, k_cache, cached, window, block_size)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(device, torch.int32)
    q = make_query(sum(q_lens), *heads, head_dim, dtype, device, gen)
    scale = 1.0 / math.sqrt(head_dim)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, scale, window=window)
    out = prefill_with_config(
        q, k_cache, v_cache, tables, cu, seq_lens, scale, out=nan_like(q.contiguous()), window=window, **kwargs
    )
    assert_matches(out, ref)
    return released


# no cache, a cached prefix, one token, no new tokens, a chunk in the middle of a long prompt
PREFILL_WINDOW_BATCH = ([40, 21, 1, 0, 17], [0, 30, 60, 9, 45])


@pytest.mark.parametrize("window", WINDOWS)
def test_prefill_window_matches_reference(device, window):
    released = run_windowed_prefill(device, torch.float32, *PREFILL_WINDOW_BATCH, window)
    assert (released > 0) == (window < 50)


@pytest.mark.parametrize(
    "config, window",
    [
        (PrefillConfig(32, 16, 4, 2), 3),  # more query rows than keys per tile: rows whose window starts later
        (PrefillConfig(32, 16, 4, 2), 20),
        (PrefillConfig(16, 32, 4, 2), 20),
        (PrefillConfig(16, 16, 4, 1, pack_gqa=True), 3),
        (PrefillConfig(64, 64, 4, 3, pack_gqa=True), 20),
    ],
    ids=["32x16-w3", "32x16-w20", "16x32-w20", "16x16-packed-w3", "64x64-packed-w20"],
)
def test_prefill_window_tile_configs(device, config, window):
    run_windowed_prefill(device, torch.bfloat16, *PREFILL_WINDOW_BATCH, window, config=config)
