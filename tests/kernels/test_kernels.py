"""Every Triton kernel against its torch reference (pico_kernels.reference).

Inputs are random (never zeros). Anything a kernel must not read holds NaN: slots past a
sequence's end, blocks no sequence owns, and block-table entries past a sequence's last block
(they point at a NaN block). Outputs and caches are poisoned with NaN before a kernel runs, so
an element it fails to write, or one it writes but should not, shows. Physical blocks are
shuffled, block tables are column slices of wider tensors, and q/key/value are strided views
of a fused projection, as they are in the model.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (see conftest.py);
tests marked gpu need CUDA and skip without it.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from pico_kernels import select_ops, triton_decode
from pico_kernels.ops import REFERENCE_OPS
from pico_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, store_kvcache_ref
from pico_kernels.triton_ops import (
    TRITON_OPS,
    DecodeConfig,
    PrefillConfig,
    decode_with_config,
    pick_num_splits,
    prefill_with_config,
    store_kvcache,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (block_size, head_dim, (num_q_heads, num_kv_heads)): block sizes 8/16/32, head dims 8/64,
# GQA ratios 1, 2 and 8.
SHAPES = [
    (16, 8, (4, 4)),
    (32, 64, (4, 2)),
    (16, 64, (8, 1)),
    (32, 8, (16, 2)),
    (8, 64, (8, 4)),
]
SHAPE_IDS = [f"bs{bs}-d{d}-hq{hq}-hkv{hkv}" for bs, d, (hq, hkv) in SHAPES]
DTYPES = [torch.float32, torch.bfloat16]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype, device, gen, spare_blocks=3):
    """K/V caches holding sequences of the given lengths in shuffled physical blocks, and
    their (non-contiguous) block table. Everything outside the sequences is NaN; table entries
    past a sequence's last block point at a NaN block."""
    blocks_per_seq = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    # Block 0 is never a sequence's: masked-off loads fall back to it, so a kernel that lets
    # such a load reach its result picks up NaN.
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(device)
    nan_block = int(perm[-1])
    width = max(blocks_per_seq) + 2
    wide = torch.full((len(lens), width + 5), nan_block, dtype=torch.int32, device=device)
    block_tables = wide[:, :width]
    first = 0
    for b, (seq_len, num) in enumerate(zip(lens, blocks_per_seq)):
        ids = perm[first : first + num]
        first += num
        block_tables[b, :num] = ids.to(torch.int32)
        pos = torch.arange(seq_len, device=device)
        blocks, slots = ids[pos // block_size], pos % block_size
        kv_shape = (seq_len, num_kv_heads, head_dim)
        k_cache[blocks, slots] = torch.randn(kv_shape, generator=gen).to(device, dtype)
        v_cache[blocks, slots] = torch.randn(kv_shape, generator=gen).to(device, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, seq_lens


def make_query(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, gen):
    """q as the model produces it: a strided view into a fused (q, k, v) projection."""
    qkv = torch.randn((num_tokens, num_q_heads + 2 * num_kv_heads, head_dim), generator=gen).to(device, dtype)
    return qkv[:, :num_q_heads]


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)


# ---------------------------------------------------------------------------------------------
# contract


def test_signatures_match_references():
    for name in ("store_kvcache", "paged_decode_attention", "paged_prefill_attention"):
        ours = inspect.signature(getattr(TRITON_OPS, name)).parameters
        ref = inspect.signature(getattr(REFERENCE_OPS, name)).parameters
        assert list(ours) == list(ref), name


def test_select_ops_by_name():
    assert select_ops("cpu", "triton") is TRITON_OPS
    assert select_ops("cpu") is REFERENCE_OPS


@pytest.mark.parametrize(
    "batch,kv_heads,max_len,expected",
    [
        (1, 8, 32768, 33),
        (1, 8, 1024, 16),
        (8, 8, 32768, 4),
        (16, 8, 8192, 2),
        (32, 8, 8192, 1),
        (256, 8, 32768, 1),
        (1, 1, 32768, 256),
        (3, 2, 100, 2),
    ],
)
def test_pick_num_splits_fills_the_gpu(batch, kv_heads, max_len, expected):
    """About two programs per SM of an H200, never a split shorter than one 64-token tile."""
    num_splits = pick_num_splits(batch, kv_heads, max_len, num_sms=132, block_n=64)
    assert num_splits == expected
    assert num_splits <= cdiv(max_len, 64)
    programs = batch * kv_heads * num_splits
    assert programs >= min(132, batch * kv_heads * cdiv(max_len, 64)) and (num_splits == 1 or programs <= 3 * 132)


def test_batch_one_decode_takes_small_programs(monkeypatch):
    """On a GPU one sequence under PDL gets 16-token tiles on 2 warps and ~6 programs an SM
    (99 splits of a 32k bound on 132 SMs); larger batches, and batch 1 launched without PDL,
    keep 64-token tiles and ~2 an SM."""
    from pico_kernels import triton_decode

    monkeypatch.setattr(triton_decode, "interpreting", lambda: False)
    one = triton_decode.default_decode_config(torch.bfloat16, 128, batch=1, pdl=True)
    assert (one.block_n, one.num_warps, one.num_stages, one.programs_per_sm) == (16, 2, 5, 6)
    assert pick_num_splits(1, 8, 32768, 132, one.block_n, one.programs_per_sm) == 99
    many = triton_decode.default_decode_config(torch.bfloat16, 128, batch=2, pdl=True)
    assert (many.block_n, many.programs_per_sm) == (64, 2)
    assert triton_decode.default_decode_config(torch.bfloat16, 128, batch=1) == many
    assert triton_decode.default_decode_config(torch.bfloat16, 256, batch=1, pdl=True).block_n == 32


# ---------------------------------------------------------------------------------------------
# store_kvcache


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size,head_dim,heads", SHAPES[:4], ids=SHAPE_IDS[:4])
def test_store_kvcache_matches_reference(device, dtype, block_size, head_dim, heads):
    gen = torch.Generator().manual_seed(1)
    _, num_kv_heads = heads
    num_blocks, num_tokens = 7, 29
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:5]] = -1  # skipped tokens (padding)
    slot_mapping = slots.to(device=device, dtype=torch.int64)
    kv = torch.randn((num_tokens, 2 * num_kv_heads + 3, head_dim), generator=gen).to(device, dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]  # strided views

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    TRITON_OPS.store_kvcache(key, value, k_cache, v_cache, slot_mapping)

    written = slot_mapping[slot_mapping >= 0]
    blocks, offsets = written // block_size, written % block_size
    assert not k_cache[blocks, offsets].isnan().any() and not v_cache[blocks, offsets].isnan().any()
    # Exact: a store is a copy; every other slot must still hold its NaN.
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def test_store_kvcache_casts_to_cache_dtype(device):
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.full((4, 16, 2, 64), float("nan"), dtype=torch.bfloat16, device=device)
    v_cache = k_cache.clone()
    key = torch.randn((9, 2, 64), generator=gen).to(device)
    value = torch.randn((9, 2, 64), generator=gen).to(device)
    slot_mapping = torch.tensor([63, 0, 17, -1, 5, 40, 33, 2, 48], dtype=torch.int64, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# paged_decode_attention

DECODE_BATCHES = {"b1": [77], "ragged": [1, 16, 33, 100, 64, 5]}


def run_decode_case(device, dtype, lens, block_size, head_dim, heads, seed=3, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype, device, gen
    )
    q = make_query(len(lens), num_q_heads, num_kv_heads, head_dim, dtype, device, gen)
    scale = 1.0 / math.sqrt(head_dim)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
    out = nan_like(q.contiguous())
    got = decode_with_config(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out, **kwargs)
    assert got is out
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", list(DECODE_BATCHES))
@pytest.mark.parametrize("block_size,head_dim,heads", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_reference(device, dtype, batch, block_size, head_dim, heads):
    run_decode_case(device, dtype, DECODE_BATCHES[batch], block_size, head_dim, heads)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 64])
def test_decode_any_split_count(device, num_splits):
    """One split (direct write), a few, and more splits than tiles (empty splits)."""
    run_decode_case(device, torch.float32, DECODE_BATCHES["ragged"], 16, 64, (8, 2), num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_rows_without_context_give_zeros(device, num_splits):
    """Padded rows of a CUDA-graph batch may carry seq_len 0: zeros, not NaN, and the other
    rows are unaffected. (The reference needs seq_len >= 1, so it sees only the real rows.)"""
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv([50, 1, 20], 2, 64, 16, torch.float32, device, gen)
    seq_lens[1] = 0
    q = make_query(3, 4, 2, 64, torch.float32, device, gen)
    out = decode_with_config(q, k_cache, v_cache, block_tables, seq_lens, 0.125, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    real = torch.tensor([0, 2], device=device)
    ref = paged_decode_attention_ref(q[real], k_cache, v_cache, block_tables[real], seq_lens[real], 0.125)
    assert_matches(out[real], ref)


def test_decode_gpu_tile_config(device):
    """The GPU's 64-token tiles spanning several 16-slot pages, under whichever backend runs."""
    config = DecodeConfig(block_n=64, num_warps=4, num_stages=5)
    run_decode_case(device, torch.bfloat16, [200, 3, 130], 16, 64, (8, 2), config=config)


def test_decode_public_entry_point(device):
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv([40, 9], 2, 64, 16, torch.float32, device, gen)
    q = make_query(2, 4, 2, 64, torch.float32, device, gen)
    out = TRITON_OPS.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert_matches(out, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.125))


@pytest.mark.parametrize("num_splits,heads", [(3, (8, 2)), (7, (4, 4)), (19, (16, 2))])
def test_decode_last_split_combines_and_resets_its_counter(device, num_splits, heads):
    """With several splits, the last program of each (sequence, KV head) to arrive combines the
    partials in the same launch: shorter sequences leave their last splits empty, and a padding
    row (seq_len 0) has only empty splits. With 19 splits and 8 query heads per KV head the
    combine takes two chunks of splits (16 + 3), both holding keys of the longest sequence.
    Every arrival counter is back at zero afterwards, so a second launch on the same counters
    (and a NaN-poisoned output) gives the same result."""
    gen = torch.Generator().manual_seed(12)
    num_q_heads, num_kv_heads = heads
    lens = [300, 40, 1, 9, 100]
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(lens, num_kv_heads, 64, 16, torch.float32, device, gen)
    seq_lens[2] = 0
    q = make_query(5, num_q_heads, num_kv_heads, 64, torch.float32, device, gen)
    out = decode_with_config(
        q, k_cache, v_cache, block_tables, seq_lens, 0.125, num_splits=num_splits, out=nan_like(q.contiguous())
    )
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    real = torch.tensor([0, 1, 3, 4], device=device)
    ref = paged_decode_attention_ref(q[real], k_cache, v_cache, block_tables[real], seq_lens[real], 0.125)
    assert_matches(out[real], ref)

    counters = triton_decode._ARRIVAL_COUNTERS[q.device]
    assert counters.dtype == torch.int32 and counters.numel() >= triton_decode.MIN_ARRIVAL_COUNTERS
    assert not counters.any()
    again = decode_with_config(
        q, k_cache, v_cache, block_tables, seq_lens, 0.125, num_splits=num_splits, out=nan_like(q.contiguous())
    )
    assert torch.equal(again, out)
    assert not counters.any()


def test_decode_arrival_counters_persist_and_grow(device):
    """One zeroed buffer per device, reused by every launch that fits; a launch needing more
    replaces it with a larger one and keeps the old one alive (a captured graph may use it)."""
    device = torch.empty(0, device=device).device  # with its index, as the kernels see it
    first = triton_decode.arrival_counters(device, 1)
    assert first.dtype == torch.int32 and first.numel() >= triton_decode.MIN_ARRIVAL_COUNTERS and not first.any()
    assert triton_decode.arrival_counters(device, first.numel()) is first
    grown = triton_decode.arrival_counters(device, first.numel() + 1)
    assert grown.numel() == first.numel() + 1 and not grown.any()
    assert triton_decode.arrival_counters(device, 1) is grown
    assert any(old is first for old in triton_decode._RETIRED_COUNTERS)


# ---------------------------------------------------------------------------------------------
# paged_prefill_attention

# (new tokens per sequence, tokens already cached per sequence)
PREFILL_BATCHES = {
    "b1-no-cache": ([45], [0]),
    "b1-cached-prefix": ([37], [50]),
    # no cache, block-aligned prefix, a decode-like single token, a sequence with no new tokens,
    # and a chunk in the middle of a long prompt (unaligned prefix)
    "ragged": ([20, 33, 1, 0, 17], [0, 16, 40, 9, 70]),
}


def run_prefill_case(device, dtype, batch, block_size, head_dim, heads, seed=5, **kwargs):
    """batch: a key of PREFILL_BATCHES, or (q_lens, cached) directly."""
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    q_lens, cached = PREFILL_BATCHES[batch] if isinstance(batch, str) else batch
    lens = [c + n for c, n in zip(cached, q_lens)]
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(
        lens, num_kv_heads, head_dim, block_size, dtype, device, gen
    )
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(device, torch.int32)
    q = make_query(sum(q_lens), num_q_heads, num_kv_heads, head_dim, dtype, device, gen)
    scale = 1.0 / math.sqrt(head_dim)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    out = nan_like(q.contiguous())
    got = prefill_with_config(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=out, **kwargs)
    assert got is out
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", list(PREFILL_BATCHES))
@pytest.mark.parametrize("block_size,head_dim,heads", SHAPES[:4], ids=SHAPE_IDS[:4])
def test_prefill_matches_reference(device, dtype, batch, block_size, head_dim, heads):
    run_prefill_case(device, dtype, batch, block_size, head_dim, heads)


@pytest.mark.parametrize(
    "config",
    [
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(64, 64, 4, 3),
        PrefillConfig(32, 16, 4, 2),
        PrefillConfig(16, 32, 4, 2),
        PrefillConfig(16, 16, 4, 1, pack_gqa=True),
        PrefillConfig(32, 16, 4, 2, pack_gqa=True),
    ],
    ids=["128x64", "64x64", "32x16", "16x32", "16x16-packed", "32x16-packed"],
)
def test_prefill_other_tile_configs(device, config):
    run_prefill_case(device, torch.bfloat16, "ragged", 8, 64, (8, 2), config=config)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", list(PREFILL_BATCHES))
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (2, 2), (6, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_prefill_packed_gqa_heads(device, dtype, batch, heads):
    """The G query heads of a KV head as rows of one tile (G tokens fewer per tile); with G = 3
    not dividing the 16 rows the kernel keeps one head a tile."""
    run_prefill_case(device, dtype, batch, 4, 16, heads, config=PrefillConfig(16, 16, 4, 1, pack_gqa=True))


def test_prefill_tiles_follow_the_longest_new_token_run(monkeypatch):
    """On a GPU, 16-bit: 64-row tiles when no sequence brings more than 64 new tokens, the
    128 x 128 tiles otherwise or when the longest run is unknown (0); fp32 and the interpreter
    keep their own tiles."""
    import pico_kernels.triton_prefill as tp

    monkeypatch.setattr(tp, "interpreting", lambda: False)
    bf16 = torch.bfloat16
    assert (
        tp.default_prefill_config(bf16, 128, 32)
        == tp.default_prefill_config(bf16, 128, 64)
        == PrefillConfig(64, 64, 4, 3, pack_gqa=True)
    )
    assert (
        tp.default_prefill_config(bf16, 128, 65)
        == tp.default_prefill_config(bf16, 128, 0)
        == PrefillConfig(128, 128, 8, 3)
    )
    assert tp.default_prefill_config(torch.float32, 128, 32).block_m == 32
    monkeypatch.setattr(tp, "interpreting", lambda: True)
    assert tp.default_prefill_config(bf16, 128, 32).block_m == 16


def test_prefill_public_entry_point(device):
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv([30, 12], 2, 8, 16, torch.float32, device, gen)
    cu_seqlens_q = torch.tensor([0, 20, 32], dtype=torch.int32, device=device)
    q = make_query(32, 4, 2, 8, torch.float32, device, gen)
    out = TRITON_OPS.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.3)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.3)
    assert_matches(out, ref)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_bf16_attention_rounds_like_the_fp32_reference(device, kernel):
    """bf16 P @ V with P as two bf16 terms (decode's default, prefill's option) equals the
    reference (fp32 softmax, rounded once) but for rare one-ulp ties; with P as one bf16 term
    about half of the outputs differ. The greedy-parity check of a bf16 model depends on it."""
    gen = torch.Generator().manual_seed(11)
    lens, heads, head_dim = [200, 150], (4, 2), 64
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv(lens, heads[1], head_dim, 16, torch.bfloat16, device, gen)
    scale = 1.0 / math.sqrt(head_dim)
    if kernel == "decode":
        q = make_query(len(lens), *heads, head_dim, torch.bfloat16, device, gen)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)
        run = lambda split: decode_with_config(  # noqa: E731
            q, k_cache, v_cache, block_tables, seq_lens, scale, DecodeConfig(16, 4, 3, split_p=split), num_splits=3
        )
    else:
        cu = torch.tensor([0, 20, 40], dtype=torch.int32, device=device)
        q = make_query(40, *heads, head_dim, torch.bfloat16, device, gen)
        ref = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu, seq_lens, scale)
        run = lambda split: prefill_with_config(  # noqa: E731
            q, k_cache, v_cache, block_tables, cu, seq_lens, scale, PrefillConfig(16, 16, 4, 1, split_p=split)
        )
    split, single = run(True), run(False)
    # one ulp of the larger of the two, or 2^-16 absolute where the average cancels to ~0
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(ref.float().abs(), split.float().abs()).clamp(min=2**-9)
    assert ((split.float() - ref.float()).abs() <= ulp).all()
    assert (split != ref).float().mean() < 0.03
    assert (single != ref).float().mean() > 0.2  # what the split buys
