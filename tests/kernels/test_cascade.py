"""Cascade (shared-prefix) decode attention (pico_kernels.triton_cascade) against the plain decode
reference, pico_kernels.reference.paged_decode_attention_ref.

Inputs as in test_kernels.py: random K/V in shuffled physical blocks, NaN everywhere a kernel
must not read (slots past a sequence's end, blocks no sequence owns, block-table entries past
a sequence's last block), block tables that are column slices of a wider tensor, q a strided
view of a fused projection, and a NaN-poisoned output. Here every row of the block table
starts with the same `prefix_blocks` physical blocks, as after a prefix-cache hit.

Without CUDA the kernels run on CPU tensors under the Triton interpreter (see conftest.py), so
shapes are small; tests marked gpu need CUDA and skip without it.
"""

from __future__ import annotations

import math

import pytest
import torch

from pico_kernels import triton_decode
from pico_kernels.reference import paged_decode_attention_ref
from pico_kernels.triton_cascade import (
    CascadeConfig,
    cascade_decode_attention,
    cascade_with_config,
    pick_num_chunks,
)
from pico_kernels.triton_decode import DecodeConfig
from pico_kernels.triton_prefill import PrefillConfig
from tests.kernels.test_kernels import cdiv, make_query, nan_like

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_shared_prefix_kv(lens, prefix_blocks, num_kv_heads, head_dim, page, dtype, device, gen, spare_blocks=3):
    """Like test_kernels.make_paged_kv, but the first prefix_blocks logical blocks of every
    sequence are the same physical blocks (holding the same tokens)."""
    assert prefix_blocks * page <= min(lens)
    own = [cdiv(n, page) - prefix_blocks for n in lens]
    num_blocks = prefix_blocks + sum(own) + spare_blocks
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    # Block 0 is nobody's (masked-off loads fall back to it); physical ids are shuffled.
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(device)
    nan_block = int(perm[-1])
    width = max(lens) // page + 3
    wide = torch.full((len(lens), width + 5), nan_block, dtype=torch.int32, device=device)
    block_tables = wide[:, :width]
    shared = perm[:prefix_blocks]
    first = prefix_blocks
    prefix_len = prefix_blocks * page
    for b, seq_len in enumerate(lens):
        ids = torch.cat([shared, perm[first : first + own[b]]])
        first += own[b]
        block_tables[b, : len(ids)] = ids.to(torch.int32)
        # Each sequence writes its own tokens; the first writes the shared prefix too.
        pos = torch.arange(0 if b == 0 else prefix_len, seq_len, device=device)
        blocks, slots = ids[pos // page], pos % page
        kv_shape = (len(pos), num_kv_heads, head_dim)
        k_cache[blocks, slots] = torch.randn(kv_shape, generator=gen).to(device, dtype)
        v_cache[blocks, slots] = torch.randn(kv_shape, generator=gen).to(device, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, seq_lens


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """The decode reference on fp32 copies of the inputs: an fp32 result, never rounded to q's
    dtype, to compare 16-bit outputs against."""
    return paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, scale)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def run_case(device, dtype, lens, prefix_blocks, page, head_dim, heads, max_prefix_blocks=None, seed=3, **kwargs):
    """prefix_blocks: a count, or "max" (every block that all sequences hold in full).
    max_prefix_blocks defaults to the block table's width. Returns (out, reference)."""
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    if prefix_blocks == "max":
        prefix_blocks = min(lens) // page
    k_cache, v_cache, block_tables, seq_lens = make_shared_prefix_kv(
        lens, prefix_blocks, num_kv_heads, head_dim, page, dtype, device, gen
    )
    q = make_query(len(lens), num_q_heads, num_kv_heads, head_dim, dtype, device, gen)
    scale = 1.0 / math.sqrt(head_dim)
    ref = reference(q, k_cache, v_cache, block_tables, seq_lens, scale)
    if max_prefix_blocks is None:
        max_prefix_blocks = block_tables.shape[1]
    out = nan_like(q.contiguous())
    got = cascade_with_config(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        torch.tensor([prefix_blocks], dtype=torch.int32, device=device),
        max_prefix_blocks,
        out=out,
        **kwargs,
    )
    assert got is out
    assert_matches(out, ref, dtype)
    return out, ref


# (page, head_dim, (num_q_heads, num_kv_heads)): GQA ratios 1, 2 and 4, pages 16 and 32.
SHAPES = [(16, 8, (4, 4)), (16, 64, (4, 2)), (32, 16, (8, 2))]
SHAPE_IDS = [f"page{p}-d{d}-hq{hq}-hkv{hkv}" for p, d, (hq, hkv) in SHAPES]
# Partial last blocks throughout. The shortest sequence is 64 tokens (a whole number of pages
# of 16 and of 32), so with the "max" prefix its suffix is empty while the others' are not.
BATCHES = {"b1": [77], "b3": [64, 70, 100], "b7": [97, 64, 65, 80, 64, 113, 71]}
# (batch, prefix_blocks): every prefix on the batch of 3; B=7 (the interpreter's slowest) with
# a prefix only, B=1 without one and with the largest.
CASES = [("b1", 0), ("b1", "max"), ("b3", 0), ("b3", 1), ("b3", "max"), ("b7", 1), ("b7", "max")]
CASE_IDS = [f"{batch}-prefix{prefix}" for batch, prefix in CASES]


@pytest.mark.parametrize("batch,prefix_blocks", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("page,head_dim,heads", SHAPES, ids=SHAPE_IDS)
def test_cascade_matches_reference_fp32(device, page, head_dim, heads, batch, prefix_blocks):
    run_case(device, torch.float32, BATCHES[batch], prefix_blocks, page, head_dim, heads)


@pytest.mark.parametrize(
    "dtype,prefix_blocks",
    [(torch.bfloat16, 1), (torch.bfloat16, "max"), (torch.float16, "max")],
    ids=["bf16-prefix1", "bf16-prefixmax", "fp16-prefixmax"],
)
@pytest.mark.parametrize("page,head_dim,heads", SHAPES, ids=SHAPE_IDS)
def test_cascade_matches_reference_16bit(device, page, head_dim, heads, dtype, prefix_blocks):
    run_case(device, dtype, BATCHES["b3"], prefix_blocks, page, head_dim, heads)


@pytest.mark.parametrize("max_prefix_blocks", [4, 5, 9, 40], ids=["exact", "bound+1", "width", "beyond-width"])
def test_cascade_bound_only_sizes_the_grid(device, max_prefix_blocks):
    """A looser bound on prefix_blocks gives more (partly empty) chunk programs, not another
    result: every bound matches the reference, and the results agree with each other."""
    out, _ = run_case(device, torch.float32, [70, 64, 100], 4, 16, 64, (4, 2), max_prefix_blocks=max_prefix_blocks)
    exact, _ = run_case(device, torch.float32, [70, 64, 100], 4, 16, 64, (4, 2), max_prefix_blocks=4)
    torch.testing.assert_close(out, exact, rtol=1e-6, atol=1e-6)


def test_cascade_without_prefix_launch(device):
    """max_prefix_blocks 0: no prefix kernel, the suffix kernel alone is plain decode."""
    run_case(device, torch.float32, [77, 5, 33], 0, 16, 64, (4, 2), max_prefix_blocks=0)


@pytest.mark.parametrize("num_chunks,num_splits", [(1, 1), (3, 1), (1, 4), (7, 3), (64, 16)])
def test_cascade_any_chunk_and_split_count(device, num_chunks, num_splits):
    """One prefix chunk or several (more than tiles: empty ones), one suffix split (no
    counters) or several (the last arrival combines; empty splits, and a sequence with an
    empty suffix whose split 0 combines the prefix alone). The arrival counters are back at
    zero afterwards, and a second launch gives the same result."""
    kwargs = dict(num_chunks=num_chunks, num_splits=num_splits)
    out, _ = run_case(device, torch.float32, [64, 130, 71], "max", 16, 64, (8, 2), **kwargs)
    if num_splits > 1:
        assert not triton_decode._ARRIVAL_COUNTERS[out.device].any()
    again, _ = run_case(device, torch.float32, [64, 130, 71], "max", 16, 64, (8, 2), **kwargs)
    assert torch.equal(again, out)


def test_cascade_gpu_tile_config(device):
    """GPU-sized tiles under whichever backend runs: 64 prefix rows, token tiles spanning
    several 16-slot pages, the last prefix tile partly past the prefix (7 pages in 32-token
    tiles), a chunk minimum (64 tokens for 64 bf16 rows) above the host's split (32), and
    prefix and suffix tiles of different lengths: the suffix kernel must find the prefix
    kernel's chunks."""
    config = CascadeConfig(PrefillConfig(64, 32, 4, 3, split_p=True), DecodeConfig(64, 4, 5))
    run_case(device, torch.bfloat16, [200, 130, 257], 7, 16, 64, (8, 2), config=config)


def test_cascade_public_entry_point(device):
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, block_tables, seq_lens = make_shared_prefix_kv([40, 33], 2, 2, 64, 16, torch.float32, device, gen)
    q = make_query(2, 4, 2, 64, torch.float32, device, gen)
    prefix_blocks = torch.tensor([2], dtype=torch.int32, device=device)
    out = cascade_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.125, prefix_blocks, 3)
    assert out.shape == q.shape and out.is_contiguous()
    assert_matches(out, reference(q, k_cache, v_cache, block_tables, seq_lens, 0.125), torch.float32)


@pytest.mark.parametrize(
    "row_tiles,kv_heads,max_prefix_len,min_chunk,expected",
    [(1, 8, 1136, 128, 9), (1, 8, 32768, 128, 33), (4, 8, 4096, 128, 8), (1, 1, 65536, 64, 256), (2, 2, 0, 16, 1)],
)
def test_pick_num_chunks(row_tiles, kv_heads, max_prefix_len, min_chunk, expected):
    """About two programs per SM of an H200, never a chunk shorter than min_chunk tokens, at
    most 256 chunks, at least one."""
    assert pick_num_chunks(row_tiles, kv_heads, max_prefix_len, min_chunk, num_sms=132) == expected


# ---------------------------------------------------------------------------------------------
# GPU only: production shapes, CUDA graphs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("batch,heads", [(64, (16, 8)), (5, (32, 8)), (200, (8, 8))])
def test_gpu_cascade_production_shapes(dtype, batch, heads):
    """A 1,024-token shared prompt and short, ragged suffixes (one empty)."""
    gen = torch.Generator().manual_seed(13)
    lens = (1024 + torch.randint(0, 200, (batch,), generator=gen)).tolist()
    lens[0] = 1024
    run_case(torch.device("cuda"), dtype, lens, 64, 16, 128, heads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pdl", ["0", "1"], ids=["plain-launch", "programmatic-launch"])
def test_gpu_cascade_captures_in_cuda_graph(monkeypatch, pdl):
    """No host sync inside: captured once, replayed with another prefix length (a device
    value) and other queries; with programmatic dependent launch too (the suffix kernel reads
    the prefix kernel's partials only after its prologue waits for it)."""
    monkeypatch.setenv("PICOVLLM_PDL", pdl)
    gen = torch.Generator().manual_seed(14)
    cuda = torch.device("cuda")
    lens = [1100, 1024, 1300]
    k_cache, v_cache, block_tables, seq_lens = make_shared_prefix_kv(lens, 64, 8, 128, 16, torch.bfloat16, cuda, gen)
    q = make_query(3, 16, 8, 128, torch.bfloat16, cuda, gen)
    prefix_blocks = torch.tensor([64], dtype=torch.int32, device=cuda)
    width = block_tables.shape[1]
    cascade_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.1, prefix_blocks, width)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cascade_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.1, prefix_blocks, width)
    for blocks in (64, 0, 17):
        prefix_blocks.fill_(blocks)
        q.copy_(torch.randn(q.shape, generator=gen).to(cuda, q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(q, k_cache, v_cache, block_tables, seq_lens, 0.1), torch.bfloat16)
