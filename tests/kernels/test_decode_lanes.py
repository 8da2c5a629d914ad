"""The decode kernel's CUDA-core loop (pico_kernels.triton_decode_lanes, DecodeConfig.lanes):
the reference's output over the same cache, whatever the cache's dtype, the GQA group (1 or 2),
the head dim, the pages, the split count and the window; and when the default config takes it."""

from __future__ import annotations

import math

import pytest
import torch

from pico_kernels import triton_decode
from pico_kernels.reference import paged_decode_attention_ref, to_cache
from pico_kernels.triton_decode import LANES, decode_with_config
from tests.kernels.test_kernels import assert_matches, make_paged_kv, make_query, nan_like
from tests.kernels.test_sliding_window import release_out_of_window

FP8 = torch.float8_e4m3fn


def lanes_case(device, cache_dtype, lens, heads, head_dim, page, num_splits=None, window=0, seed=31):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.bfloat16 if cache_dtype == FP8 else cache_dtype
    k_cache, v_cache, tables, seq_lens = make_paged_kv(lens, heads[1], head_dim, page, wide, device, gen)
    if window:
        release_out_of_window(tables, k_cache, [n - 1 for n in lens], window, page)
    k_cache, v_cache = to_cache(k_cache, cache_dtype), to_cache(v_cache, cache_dtype)
    q = make_query(len(lens), *heads, head_dim, wide, device, gen)
    scale = 1.0 / math.sqrt(head_dim)
    out = decode_with_config(
        q, k_cache, v_cache, tables, seq_lens, scale, LANES, num_splits, nan_like(q.contiguous()), window
    )
    return out, paged_decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale, window=window)


@pytest.mark.parametrize(
    "cache_dtype,heads,head_dim,page,num_splits",
    [
        (FP8, (4, 2), 64, 16, 1),  # one split: the output written directly
        (FP8, (4, 2), 128, 8, 3),  # a 16-token tile over two pages; 4 lanes a token row
        (FP8, (3, 3), 48, 16, 5),  # no GQA; a head dim short of its power of two (masked lanes)
        (FP8, (4, 2), 64, 32, 16),  # more splits than the short sequences' tiles: empty splits
        (torch.bfloat16, (4, 2), 64, 16, 3),  # 2 lanes a token row
        (torch.float32, (2, 1), 32, 16, 2),
    ],
    ids=["fp8-direct", "fp8-pages8-d128", "fp8-mha-d48", "fp8-empty-splits", "bf16", "fp32"],
)
def test_lanes_loop_matches_reference(device, cache_dtype, heads, head_dim, page, num_splits):
    out, ref = lanes_case(device, cache_dtype, [1, 16, 33, 100, 5], heads, head_dim, page, num_splits)
    assert_matches(out, ref)


@pytest.mark.parametrize("window,num_splits", [(5, 3), (37, 1)])
def test_lanes_loop_under_a_sliding_window(device, window, num_splits):
    out, ref = lanes_case(device, FP8, [1, 9, 33, 70], (4, 2), 64, 8, num_splits, window=window)
    assert_matches(out, ref)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_lanes_rows_without_context_give_zeros_and_counters_reset(device, num_splits):
    gen = torch.Generator().manual_seed(32)
    k_cache, v_cache, tables, seq_lens = make_paged_kv([50, 1, 20], 2, 64, 16, torch.bfloat16, device, gen)
    k_cache, v_cache = to_cache(k_cache, FP8), to_cache(v_cache, FP8)
    seq_lens[1] = 0
    q = make_query(3, 4, 2, 64, torch.bfloat16, device, gen)
    out = decode_with_config(q, k_cache, v_cache, tables, seq_lens, 0.125, LANES, num_splits, nan_like(q.contiguous()))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    real = torch.tensor([0, 2], device=device)
    assert_matches(
        out[real], paged_decode_attention_ref(q[real], k_cache, v_cache, tables[real], seq_lens[real], 0.125)
    )
    if num_splits > 1:
        assert not triton_decode._ARRIVAL_COUNTERS[q.device].any()


def test_default_config_takes_the_lanes_loop_for_fp8_small_groups_and_full_waves():
    def pick(batch, cache_dtype=FP8, group=2, num_kv_heads=8, sms=132):
        return triton_decode.default_decode_config(
            torch.bfloat16, 128, batch, False, cache_dtype, group, num_kv_heads, sms
        )

    assert pick(256) == LANES
    assert pick(256, group=1).lanes
    assert pick(198).lanes  # 1584 pairs: 3/4 of a wave of 16 programs on each of 132 SMs
    assert not pick(197).lanes
    assert pick(64, sms=32).lanes  # the wave is the device's
    assert not pick(256, group=4).lanes  # tensor cores
    assert not pick(256, cache_dtype=torch.bfloat16).lanes
    assert not pick(1).lanes


def test_lanes_loop_refuses_groups_it_does_not_handle(device):
    gen = torch.Generator().manual_seed(33)
    k_cache, v_cache, tables, seq_lens = make_paged_kv([20], 1, 64, 16, torch.float32, device, gen)
    q = make_query(1, 4, 1, 64, torch.float32, device, gen)
    with pytest.raises(AssertionError, match="lanes loop"):
        decode_with_config(q, k_cache, v_cache, tables, seq_lens, 0.125, LANES)
