"""The decode kernel's first tile before its PDL wait (DecodeConfig.early, built for the batch-1
config under PDL): the same bits as the same config without it, wherever the step's own key falls
(first in a tile, inside one, in a later tile of the split, the only key), with empty splits,
one split, a sliding window, rows without context and every cache dtype. On a GPU, the case
it exists for: the step's K/V written by the store kernel launched just ahead under PDL."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pico_kernels.reference import paged_decode_attention_ref, to_cache
from pico_kernels.triton_decode import DecodeConfig, decode_with_config
from tests.kernels.test_kernels import assert_matches, make_paged_kv, make_query, nan_like, needs_cuda

EARLY = DecodeConfig(block_n=16, num_warps=2, num_stages=5, programs_per_sm=6, early=True)
LATE = dataclasses.replace(EARLY, early=False)
# 1: the only key; 16/17: the step's key last in a tile / first of the next; 33, 100, 64: inside
LENS = [1, 16, 17, 33, 100, 64]


def both(device, dtype, lens, num_splits, window=0, cache_dtype=None, zero_row=None, seed=41):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, seq_lens = make_paged_kv(lens, 2, 64, 8, dtype, device, gen)
    if cache_dtype is not None:
        k_cache, v_cache = to_cache(k_cache, cache_dtype), to_cache(v_cache, cache_dtype)
    if zero_row is not None:
        seq_lens[zero_row] = 0
    q = make_query(len(lens), 4, 2, 64, dtype, device, gen)
    outs = [
        decode_with_config(q, k_cache, v_cache, tables, seq_lens, 0.125, c, num_splits, nan_like(q), window)
        for c in (EARLY, LATE)
    ]
    return (*outs, (q, k_cache, v_cache, tables, seq_lens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3, 40])  # direct; several tiles a split; empty splits
def test_early_tile_gives_the_same_bits(device, dtype, num_splits):
    early, late, (q, k_cache, v_cache, tables, seq_lens) = both(device, dtype, LENS, num_splits)
    assert torch.equal(early, late)
    assert_matches(early, paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.125))


@pytest.mark.parametrize("window,num_splits", [(5, 2), (20, 1), (40, 4)])
def test_early_tile_under_a_sliding_window(device, window, num_splits):
    early, late, (q, k_cache, v_cache, tables, seq_lens) = both(device, torch.float32, LENS, num_splits, window)
    assert torch.equal(early, late)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, 0.125, window=window)
    assert_matches(early, ref)


def test_early_tile_over_an_fp8_cache(device):
    early, late, _ = both(device, torch.bfloat16, LENS, 5, cache_dtype=torch.float8_e4m3fn)
    assert torch.equal(early, late)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_early_tile_rows_without_context_give_zeros(device, num_splits):
    early, late, _ = both(device, torch.float32, [50, 1, 20], num_splits, zero_row=1)
    assert torch.equal(early[1], torch.zeros_like(early[1]))
    assert torch.equal(early, late)


def test_early_tile_is_the_tensor_core_loops_only(device):
    gen = torch.Generator().manual_seed(42)
    k_cache, v_cache, tables, seq_lens = make_paged_kv([20], 1, 64, 16, torch.float32, device, gen)
    q = make_query(1, 2, 1, 64, torch.float32, device, gen)
    config = dataclasses.replace(EARLY, lanes=True, num_warps=1)
    with pytest.raises(AssertionError, match="tensor-core loop only"):
        decode_with_config(q, k_cache, v_cache, tables, seq_lens, 0.125, config)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seq_len", [1, 16, 17, 512, 4097])
def test_gpu_step_key_stored_just_ahead_under_pdl(seq_len):
    """The model's order at batch 1: qk_norm_rope_store writes the step's key (position
    seq_len - 1, NaN before) and the decode kernel, launched right behind it under PDL, reads
    it after its wait and the older keys before. Repeated so that a read of the step's row
    before the store lands would show."""
    from pico_kernels.triton_common import pdl_scope
    from pico_kernels.triton_fused import qk_norm_rope_store

    cuda, dtype, heads, head_dim, page = torch.device("cuda"), torch.bfloat16, (16, 8), 128, 16
    gen = torch.Generator().manual_seed(seq_len)
    k_cache, v_cache, tables, seq_lens = make_paged_kv([seq_len], heads[1], head_dim, page, dtype, cuda, gen)
    pos = seq_len - 1
    slot = torch.tensor([int(tables[0, pos // page]) * page + pos % page], dtype=torch.int64, device=cuda)
    positions = torch.tensor([pos], dtype=torch.int64, device=cuda)
    rope = torch.randn((seq_len, head_dim), generator=gen).to(cuda, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    with pdl_scope(True):
        for _ in range(20):
            qkv = torch.randn((1, heads[0] + 2 * heads[1], head_dim), generator=gen).to(cuda, dtype)
            q, k, v = qkv[:, : heads[0]], qkv[:, heads[0] : heads[0] + heads[1]], qkv[:, heads[0] + heads[1] :]
            k_cache.view(-1, heads[1], head_dim)[slot] = float("nan")
            v_cache.view(-1, heads[1], head_dim)[slot] = float("nan")
            q_rot = qk_norm_rope_store(q, k, v, positions, rope, None, None, 0.0, k_cache, v_cache, slot)
            out = decode_with_config(q_rot, k_cache, v_cache, tables, seq_lens, scale, EARLY)
            torch.cuda.synchronize()
            assert_matches(out, paged_decode_attention_ref(q_rot, k_cache, v_cache, tables, seq_lens, scale))
