"""Cascade (shared-prefix) paged decode attention in Triton: two launches.

For decode batches whose block tables all start with the same `prefix_blocks` physical blocks
(a prefix-cache hit on a common system prompt). Plain paged decode reads the shared prefix's
K/V once per sequence; here it is read once per step for the whole batch.

1. Prefix kernel, grid (row tiles, prefix chunks, KV heads). For one KV head, the queries of
   every sequence for that head's query heads are the rows of one matrix (row r: sequence
   r // G, query head kv_head * G + r % G; G = Hq / Hkv), cut into BLOCK_M-row tiles, so each
   prefix K/V tile feeds a real matrix product instead of G rows. The prefix tokens
   [0, prefix_blocks * page), read through row 0 of the block table, are cut into chunks
   (no mask between queries and keys: every sequence sees the whole prefix). Each program
   writes its rows' normalised partial output and log-sum-exp (fp32) to scratch.
2. Suffix kernel, grid (splits, KV heads, sequences): the split-KV decode of
   kernels.triton_decode over each sequence's own tokens [prefix_blocks * page, seq_len), GQA
   heads packed per KV head, partials written beside the prefix ones. The program of a
   (sequence, KV head) that finishes last (an arrival counter, as in triton_decode; with one
   split there is only that program) combines the group's prefix and suffix partials by
   log-sum-exp and writes the output. The prefix partials are complete by then: the launches
   run in stream order.

Either side may be empty (prefix_blocks 0; seq_len == prefix_blocks * page): only partials
that hold keys are written and combined. Scratch rows of one (sequence, query head) are
numbered so that the used ones come first: prefix chunks 0 .. Cp - 1, then suffix splits
Cp .. Cp + Cs - 1, where both kernels derive Cp and Cs from the same device values.

CUDA graphs: grid sizes, scratch and the tile choice depend only on shapes and the host bound
`max_prefix_blocks`, never on the device value `prefix_blocks`, and nothing syncs with the
host. The kernels size the chunks at run time from `prefix_blocks` (the grid holds enough
chunk programs for the bound, and chunks have a minimum length, so a shorter prefix leaves
the last chunk programs empty: they return at once).

Contract: `cascade_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
prefix_blocks, max_prefix_blocks)` returns what `kernels.reference.paged_decode_attention_ref`
returns for the first six arguments, given that the first prefix_blocks entries of every row
of block_tables are equal and prefix_blocks * page <= min(seq_lens).

The model runner calls it for decode batches that share enough leading blocks
(model_svc.attention_metadata.shared_prefix_blocks), through
`cascade_decode_attention_store`: the same two launches, the prefix kernel's programs also
doing kernels.triton_fused.qk_norm_rope_store's work for the step (each norms and rotates
its own q rows from the projection's output; one program per row tile and KV head writes
those rows for the suffix kernel, another the new K and V), so a layer's decode attention
needs no launch of its own for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton_cascade_store import (
    StepKV,
    fuses_store,
    normed_query_rows,
    store_kv_rows,
)  # StepKV, fuses_store: this module's API too
from kernels.triton_common import (
    LOG2E,
    cdiv,
    dot_precision,
    fix_bf16_rounding,
    interpreting,
    load_rows,
    next_pow2,
    num_sms,
    pdl_launch,
    pdl_prologue,
    split_p,
    upcast_dot,
)
from kernels.triton_decode import (
    MAX_SPLITS,
    PROGRAMS_PER_SM,
    DecodeConfig,
    arrival_counters,
    attend_pages,
    combine_group,
    default_decode_config,
    pick_num_splits,
)
from kernels.triton_fused import cast_needs_fix
from kernels.triton_prefill import PrefillConfig


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    prefix: PrefillConfig  # block_m: (sequence, query head) rows per tile; block_n: prefix tokens per step
    suffix: DecodeConfig


def default_cascade_config(dtype: torch.dtype, head_dim: int) -> CascadeConfig:
    """The prefix kernel does little arithmetic (batch x G rows x prefix x head_dim per KV head) and
    exists to read the prefix once, so it takes P @ V in bf16 as two terms (split_p, as decode
    does). 16-bit tiles, head dims up to 128: 64 rows x 64 keys at 4 warps. Measured on the
    H200 at B = 64, G = 2 (128 rows), a 1,024-token prefix: 7.7-8.7 us per call against
    9.9-12.2 us for 128-row tiles at 8 warps (the first choice, from ptxas's stack use
    alone), 64-row tiles by 32 keys 7.8-9.9 us. Two pipeline stages, not three: the same
    bits, 0.6 us a layer less in a 28-layer graph (16.7 / 21.9 / 27.8 against 17.3 / 22.5 /
    28.5 us for both kernels at 32 / 96 / 160-token suffixes; with its usual chunk of 64
    tokens a program runs one tile). Head dims over 128: 32 x 32. fp32 uses the
    prefill kernel's fp32 tiles (exact products on FMA units); the interpreter 16 x 16 tiles,
    so that small test batches span several row tiles and chunks.

    The suffix kernel reads each sequence's own few tokens (the decode steps since the
    prompt): 16-bit, head dims up to 128, 32-token tiles and two stages. On the H200 (B = 64,
    G = 2, suffixes of 32 / 96 / 160 tokens) 7.3 / 11.8 / 18.8 us per call against 14.9 /
    19.6 / 27.0 with decode's 64-token tiles and five stages, whose pipeline prologue is made
    for long contexts; 16-token tiles or 2 warps were no better. Otherwise decode's tiles
    (kernels.triton_decode.default_decode_config)."""
    suffix = default_decode_config(dtype, head_dim)
    block_d = max(16, next_pow2(head_dim))
    if not interpreting() and dtype != torch.float32 and block_d <= 128:
        suffix = DecodeConfig(block_n=32, num_warps=4, num_stages=2)
    if interpreting():
        prefix = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, split_p=True)
    elif dtype == torch.float32:
        prefix = PrefillConfig(block_m=32, block_n=16, num_warps=4 if block_d <= 64 else 8, num_stages=2, split_p=True)
    elif block_d > 128:
        prefix = PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=3, split_p=True)
    else:
        prefix = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, split_p=True)
    return CascadeConfig(prefix, suffix)


def pick_num_chunks(
    num_row_tiles: int, num_kv_heads: int, max_prefix_len: int, min_chunk: int, num_sms: int = 132
) -> int:
    """Prefix chunks per (row tile, KV head): about PROGRAMS_PER_SM programs per SM, as
    triton_decode.pick_num_splits aims at, but no chunk shorter than min_chunk tokens (the
    wrapper passes the length whose K/V bytes equal the bytes of the fp32 partial the chunk
    writes, and that the suffix kernel reads back: shorter chunks would move more partials
    than keys) and at most MAX_SPLITS. max_prefix_len is the host-known bound."""
    chunks = int(PROGRAMS_PER_SM * num_sms / max(1, num_row_tiles * num_kv_heads) + 0.5)
    chunks = min(chunks, cdiv(max(1, max_prefix_len), min_chunk), MAX_SPLITS)
    return max(1, chunks)


@triton.jit
def _split_len(n, num_splits, ALIGN: tl.constexpr, MIN: tl.constexpr):
    """Tokens per piece when n tokens are cut into at most num_splits pieces: a multiple of
    ALIGN, at least MIN (a multiple of ALIGN, >= 1); the last pieces may be shorter or empty.
    Both kernels use it, so they agree on the pieces."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, num_splits), ALIGN) * ALIGN, MIN)


@triton.jit(
    do_not_specialize=["num_rows", "num_chunks", "num_parts", "num_seqs"],  # they change with the batch
    do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"],
)  # slices of packed tensors
def _prefix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    prefix_blocks_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    num_rows,
    num_chunks,
    num_parts,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    # FUSED only: this step's projections in (q_ptr is then the raw q), the norm + rotary inputs
    k_ptr,
    v_ptr,
    q_out_ptr,
    q_w_ptr,
    k_w_ptr,
    cos_sin_ptr,
    pos_ptr,
    slot_ptr,
    stride_kn,
    stride_kh_in,
    stride_vn,
    stride_vh_in,
    stride_cs,
    num_seqs,
    eps,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_P: tl.constexpr,
    FUSED: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FIX_BF16: tl.constexpr,
    FIX_K_CACHE: tl.constexpr,
    FIX_V_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    # Row tiles vary fastest: the programs reading the same chunk of K/V run side by side and
    # share it through L2.
    row_tile = tl.program_id(0)
    chunk_id = tl.program_id(1)
    kv_head = tl.program_id(2)
    num_q_heads = tl.num_programs(2) * GROUP

    prefix_len = tl.load(prefix_blocks_ptr) * PAGE
    chunk = _split_len(prefix_len, num_chunks, BLOCK_N, MIN_CHUNK)
    start = chunk_id * chunk
    end = tl.minimum(start + chunk, prefix_len)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = row_tile * BLOCK_M + offs_m
    row_mask = rows < num_rows
    seq = (rows // GROUP).to(tl.int64)
    q_head = kv_head * GROUP + rows % GROUP
    if FUSED:
        # This launch also does the q/k norm + rotary + K/V store of the step, spread over the
        # chunks: chunk 0 of a (row tile, KV head) writes its q rows for the suffix kernel,
        # chunk 1 (0 when there is one) its sequences' new K and V. Every chunk norms its own
        # q rows (a few us of work, no dependency on another program).
        q = normed_query_rows(
            q_ptr,
            q_out_ptr,
            q_w_ptr,
            cos_sin_ptr,
            pos_ptr,
            seq,
            q_head,
            row_mask,
            chunk_id == 0,
            eps,
            stride_qb,
            stride_qh,
            stride_cs,
            tl.num_programs(2) * GROUP,
            BLOCK_M,
            BLOCK_D // 2,
            HAS_NORM,
            FIX_BF16,
        )
        if chunk_id == tl.minimum(1, num_chunks - 1):
            store_kv_rows(
                k_ptr,
                v_ptr,
                k_cache_ptr,
                v_cache_ptr,
                k_w_ptr,
                cos_sin_ptr,
                pos_ptr,
                slot_ptr,
                row_tile,
                kv_head,
                num_seqs,
                eps,
                stride_kn,
                stride_kh_in,
                stride_vn,
                stride_vh_in,
                stride_cs,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                GROUP,
                BLOCK_M,
                BLOCK_D // 2,
                PAGE,
                HAS_NORM,
                FIX_BF16,
                FIX_K_CACHE,
                FIX_V_CACHE,
            )
    if start < end:  # chunks past a prefix shorter than the bound (or than the chunks' minimum) return
        D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM
        d_mask = offs_d < HEAD_DIM
        if not FUSED:
            # Padding rows load zeros: their scores stay finite and their stores are masked.
            q = load_rows(
                q_ptr + (seq * stride_qb + q_head * stride_qh)[:, None] + offs_d[None, :],
                row_mask,
                d_mask,
                True,
                D_MASK,
            )  # (BLOCK_M, BLOCK_D)

        # Every row of the block table starts with the prefix's blocks: row 0 stands for all.
        # Every tile holds at least one key (n0 < end), so no row's running max stays -inf.
        acc, m_i, l_i = attend_pages(
            q,
            block_tables_ptr,
            k_cache_ptr + kv_head.to(tl.int64) * stride_kh,
            v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
            start,
            end,
            stride_kb,
            stride_ks,
            stride_vb,
            stride_vs,
            scale_log2,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            PAGE,
            PRECISION,
            UPCAST,
            SPLIT_P,
        )

        part = (seq * num_q_heads + q_head) * num_parts + chunk_id  # (BLOCK_M,)
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None], mask=row_mask[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit(do_not_specialize=["num_chunks", "num_splits", "num_parts", "stride_bt"])
def _suffix_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    prefix_blocks_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    scale_log2,
    num_chunks,
    num_splits,
    num_parts,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    PREFIX_MIN_CHUNK: tl.constexpr,
    COUNTERS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_P: tl.constexpr,
    FIX_BF16: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = tl.load(prefix_blocks_ptr) * PAGE
    # The prefix chunks the prefix kernel filled (the same arithmetic as there).
    prefix_used = tl.cdiv(prefix_len, _split_len(prefix_len, num_chunks, PREFIX_BLOCK_N, PREFIX_MIN_CHUNK))
    suffix_len = tl.maximum(seq_len - prefix_len, 0)
    chunk = _split_len(suffix_len, num_splits, BLOCK_N, BLOCK_N)
    suffix_used = tl.cdiv(suffix_len, chunk)
    start = prefix_len + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    q_heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    if split < suffix_used:
        q = tl.load(
            q_ptr + seq.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # (GROUP_PAD, BLOCK_D)
        acc, m_i, l_i = attend_pages(
            q,
            block_tables_ptr + seq.to(tl.int64) * stride_bt,
            k_cache_ptr + kv_head.to(tl.int64) * stride_kh,
            v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
            start,
            end,
            stride_kb,
            stride_ks,
            stride_vb,
            stride_vs,
            scale_log2,
            GROUP_PAD,
            BLOCK_N,
            BLOCK_D,
            HEAD_DIM,
            PAGE,
            PRECISION,
            UPCAST,
            SPLIT_P,
        )
        # A used split holds at least one key: l_i > 0. Suffix partials follow the prefix ones.
        row = (seq.to(tl.int64) * num_q_heads + q_heads) * num_parts + prefix_used + split  # (GROUP_PAD,)
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None], mask=g_mask[:, None])
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g_mask)

    # The program that arrives last combines. Split 0 arrives even with an empty suffix (then
    # the output is the prefix's alone); the other empty splits just end.
    arrivals = tl.maximum(suffix_used, 1)
    if split < arrivals:
        # Every thread's partial stores complete before the barrier (this program's own
        # partial is read back by other threads in the combine).
        tl.debug_barrier()
        last = True
        if COUNTERS:
            # As in triton_decode: a gpu-scope acq_rel ticket releases this program's partials
            # to the last arrival and, in that one, acquires everyone else's.
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            last = ticket == arrivals - 1
        if last:
            combine_group(
                part_out_ptr,
                part_lse_ptr,
                (seq.to(tl.int64) * num_q_heads + kv_head * GROUP) * num_parts,
                num_parts,
                prefix_used + suffix_used,
                out_ptr + seq.to(tl.int64) * stride_ob + (kv_head * GROUP).to(tl.int64) * stride_oh,
                stride_oh,
                GROUP,
                GROUP_P2,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_S,
                FIX_BF16,
            )
            if COUNTERS:
                tl.store(counter, 0)  # every ticket is taken: ready for the next launch


def cascade_with_config(
    q: torch.Tensor,  # (B, Hq, D); with `store`, the raw q (before norm and rotary), any strides, unit along D
    k_cache: torch.Tensor,  # (num_blocks, page, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, W) int32
    seq_lens: torch.Tensor,  # (B,) int32
    scale: float,
    prefix_blocks: torch.Tensor,  # (1,) int32, on q's device
    max_prefix_blocks: int,
    config: CascadeConfig | None = None,
    num_chunks: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # (B, Hq, D), contiguous; allocated when None
    store: StepKV | None = None,  # the step's norm + rotary + K/V store, done by the prefix launch
) -> torch.Tensor:  # (B, Hq, D), dtype of q
    """cascade_decode_attention with an explicit tile config, prefix chunk count, suffix split
    count and output buffer (for tests and benchmarks); None picks the defaults. With `store`,
    cascade_decode_attention_store."""
    batch, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    width = block_tables.shape[1]
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert prefix_blocks.shape == (1,) and prefix_blocks.dtype == torch.int32 and prefix_blocks.device == q.device, (
        "prefix_blocks: (1,) int32 on q's device"
    )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    if store is None:
        q = q if q.stride(-1) == 1 else q.contiguous()
        raw_q = q
    else:
        assert fuses_store(head_dim), f"the fused store needs a power-of-two head_dim >= 16, got {head_dim}"
        assert q.stride(-1) == 1 and store.k.stride(-1) == 1 and store.v.stride(-1) == 1, (
            "q, k, v need unit stride along D"
        )
        assert store.k.shape == store.v.shape == (batch, num_kv_heads, head_dim) and store.slot_mapping.shape == (
            batch,
        )
        assert (store.q_norm_weight is None) == (store.k_norm_weight is None), "give both norm weights or neither"
        raw_q, q = q, torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q: the normed, rotated q

    group = num_q_heads // num_kv_heads
    num_rows = batch * group
    block_d = max(16, next_pow2(head_dim))
    if config is None:
        config = default_cascade_config(q.dtype, head_dim)
    block_m = config.prefix.block_m
    num_row_tiles = cdiv(num_rows, block_m)
    sms = num_sms(q.device)
    max_prefix_len = min(max(0, max_prefix_blocks), width) * page  # host-known: sizes the grid
    # The shortest prefix chunk worth a program (see pick_num_chunks), whole tiles. The kernels
    # enforce it on the device too, so a loose bound only adds programs that return at once.
    prefix_n = config.prefix.block_n
    min_chunk = cdiv(max(prefix_n, 2 * block_m // q.element_size()), prefix_n) * prefix_n
    if num_chunks is None:
        num_chunks = pick_num_chunks(num_row_tiles, num_kv_heads, max_prefix_len, min_chunk, sms)
    if num_splits is None:
        # The suffix may be the whole context (prefix_blocks 0): the table's width bounds it.
        num_splits = pick_num_splits(batch, num_kv_heads, width * page, sms, config.suffix.block_n)

    num_parts = num_chunks + num_splits
    part_out = torch.empty((batch, num_q_heads, num_parts, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_q_heads, num_parts), dtype=torch.float32, device=q.device)
    precision, upcast = dot_precision(q.dtype), upcast_dot(q.dtype)
    scale_log2 = scale * LOG2E

    # Without a store and a prefix bound of 0, prefix_blocks is 0 and every prefix program
    # would return at once: no launch.
    if max_prefix_len > 0 or store is not None:
        fused: tuple[Any, ...]  # the store's operands (placeholders without one)
        if store is None:
            fused = (q, q, q, q, q, q, seq_lens, seq_lens, 0, 0, 0, 0, 0, batch, 0.0)
            flags = dict(FUSED=False, HAS_NORM=False, FIX_BF16=False, FIX_K_CACHE=False, FIX_V_CACHE=False)
        else:
            has_norm = store.q_norm_weight is not None
            fused = (
                store.k,
                store.v,
                q,
                store.q_norm_weight if has_norm else q,
                store.k_norm_weight if has_norm else q,
                store.cos_sin_cache,
                store.positions,
                store.slot_mapping,
                store.k.stride(0),
                store.k.stride(1),
                store.v.stride(0),
                store.v.stride(1),
                store.cos_sin_cache.stride(0),
                batch,
                store.eps,
            )
            flags = dict(
                FUSED=True,
                HAS_NORM=has_norm,
                FIX_BF16=fix_bf16_rounding(q.dtype),
                FIX_K_CACHE=cast_needs_fix(store.k.dtype, k_cache.dtype),
                FIX_V_CACHE=cast_needs_fix(store.v.dtype, v_cache.dtype),
            )
        _prefix_kernel[(num_row_tiles, num_chunks, num_kv_heads)](
            raw_q,
            k_cache,
            v_cache,
            block_tables,
            prefix_blocks,
            part_out,
            part_lse,
            scale_log2,
            num_rows,
            num_chunks,
            num_parts,
            raw_q.stride(0),
            raw_q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            *fused,
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PAGE=page,
            BLOCK_M=block_m,
            BLOCK_N=prefix_n,
            MIN_CHUNK=min_chunk,
            PRECISION=precision,
            UPCAST=upcast,
            SPLIT_P=config.prefix.split_p and split_p(q.dtype),
            **flags,
            **pdl_launch(q.device),
            num_warps=config.prefix.num_warps,
            num_stages=config.prefix.num_stages,
        )

    # The decode kernel's arrival counters: every launch of either kernel leaves them at zero,
    # so the two share one buffer (their launches are stream-ordered). Unused with one split.
    counters = arrival_counters(q.device, batch * num_kv_heads) if num_splits > 1 else seq_lens
    group_p2 = next_pow2(group)
    block_s = max(1, min(32, 8192 // (block_d * group_p2)))  # as in triton_decode.decode_with_config
    _suffix_kernel[(num_splits, num_kv_heads, batch)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        prefix_blocks,
        out,
        part_out,
        part_lse,
        counters,
        scale_log2,
        num_chunks,
        num_splits,
        num_parts,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE=page,
        BLOCK_N=config.suffix.block_n,
        PREFIX_BLOCK_N=prefix_n,
        PREFIX_MIN_CHUNK=min_chunk,
        COUNTERS=num_splits > 1,
        PRECISION=precision,
        UPCAST=upcast,
        SPLIT_P=config.suffix.split_p and split_p(q.dtype),
        FIX_BF16=fix_bf16_rounding(q.dtype),
        GROUP_P2=group_p2,
        BLOCK_S=block_s,
        **pdl_launch(q.device),
        num_warps=config.suffix.num_warps,
        num_stages=config.suffix.num_stages,
    )
    return out


def cascade_decode_attention(
    q: torch.Tensor,  # (B, Hq, D): one query token per sequence
    k_cache: torch.Tensor,  # (num_blocks, page, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, W) int32
    seq_lens: torch.Tensor,  # (B,) int32, >= 1
    scale: float,
    prefix_blocks: torch.Tensor,  # (1,) int32 on q's device: blocks shared by every row, * page <= min(seq_lens)
    max_prefix_blocks: int,  # host-known upper bound of prefix_blocks (sizes the grid; e.g. W)
    out: torch.Tensor | None = None,  # (B, Hq, D), contiguous; allocated when None
) -> torch.Tensor:  # (B, Hq, D), dtype of q
    """kernels.reference.paged_decode_attention_ref, reading the shared prefix once."""
    return cascade_with_config(
        q, k_cache, v_cache, block_tables, seq_lens, scale, prefix_blocks, max_prefix_blocks, out=out
    )


def cascade_decode_attention_store(
    q: torch.Tensor,  # (B, Hq, D): this step's q from the projection (before norm and rotary), unit stride along D
    step: StepKV,  # its k and v, positions, rotary cache, norm weights, slots
    k_cache: torch.Tensor,  # (num_blocks, page, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, W) int32
    seq_lens: torch.Tensor,  # (B,) int32, >= 1
    scale: float,
    prefix_blocks: torch.Tensor,  # (1,) int32 on q's device
    max_prefix_blocks: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # (B, Hq, D), dtype of q
    """kernels.triton_fused.qk_norm_rope_store, then cascade_decode_attention, in the two
    launches of the latter: the prefix kernel's programs also norm and rotate q (each its own
    rows; one per row tile writes them for the suffix kernel) and write the step's K and V, so
    a layer's decode attention takes one launch fewer. The new tokens' slots lie outside the
    shared prefix (a block being written is never shared). fuses_store(head_dim) must hold."""
    return cascade_with_config(
        q, k_cache, v_cache, block_tables, seq_lens, scale, prefix_blocks, max_prefix_blocks, out=out, store=step
    )
