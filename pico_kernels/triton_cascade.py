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
   pico_kernels.triton_decode over each sequence's own tokens [prefix_blocks * page, seq_len), GQA
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
prefix_blocks, max_prefix_blocks)` returns what `pico_kernels.reference.paged_decode_attention_ref`
returns for the first six arguments, given that the first prefix_blocks entries of every row
of block_tables are equal and prefix_blocks * page <= min(seq_lens).

The model runner calls it for decode batches that share enough leading blocks
(model_svc.attention_metadata.shared_prefix_blocks), through
`cascade_decode_attention_store`: the same two launches, the prefix kernel's programs also
doing pico_kernels.triton_fused.qk_norm_rope_store's work for the step (each norms and rotates
its own q rows from the projection's output; one program per row tile and KV head writes
those rows for the suffix kernel, another the new K and V), so a layer's decode attention
needs no launch of its own for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pico_kernels.triton_cascade_kernels import prefix_kernel, suffix_kernel
from pico_kernels.triton_cascade_store import StepKV, fuses_store  # this module's API too
from pico_kernels.triton_common import (
    LOG2E,
    cdiv,
    dot_precision,
    fix_bf16_rounding,
    interpreting,
    next_pow2,
    num_sms,
    pdl_launch,
    split_p,
    upcast_dot,
)
from pico_kernels.triton_decode import (
    MAX_SPLITS,
    PROGRAMS_PER_SM,
    DecodeConfig,
    arrival_counters,
    default_decode_config,
    pick_num_splits,
)
from pico_kernels.triton_fused import cast_needs_fix
from pico_kernels.triton_prefill import PrefillConfig


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    prefix: PrefillConfig  # block_m: (sequence, query head) rows per tile; block_n: prefix tokens per step
    suffix: DecodeConfig


def default_cascade_config(dtype: torch.dtype, head_dim: int) -> CascadeConfig:
    """The prefix kernel does little arithmetic (batch x G rows x prefix x head_dim per KV head) and
    exists to read the prefix once, so it takes P @ V in bf16 as two terms (split_p, as decode
    does). 16-bit tiles, head dims up to 128: 64 rows x 64 keys at 4 warps and two pipeline
    stages, the fastest tiling measured (with its usual chunk of 64 tokens a program runs one
    tile). Head dims over 128: 32 x 32. fp32 uses the prefill kernel's fp32 tiles (exact
    products on FMA units); the interpreter 16 x 16 tiles, so that small test batches span
    several row tiles and chunks.

    The suffix kernel reads each sequence's own few tokens (the decode steps since the
    prompt): 16-bit, head dims up to 128, 32-token tiles and two stages, faster there than
    decode's 64-token tiles and five stages, whose pipeline prologue is made for long
    contexts. Otherwise decode's tiles (pico_kernels.triton_decode.default_decode_config). The
    measurements: bench/NOTES.md, "Figures behind the code's choices"."""
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


@dataclass(frozen=True, slots=True)
class _Grid:
    """One call's sizes, shared by its two launches."""

    group: int  # query heads per KV head
    num_rows: int  # batch x group: the prefix kernel's rows per KV head
    block_d: int
    page: int
    num_chunks: int  # prefix chunks
    num_splits: int  # suffix splits
    min_chunk: int  # the shortest prefix chunk, in tokens (see pick_num_chunks)
    max_prefix_len: int  # host-known bound of the prefix, in tokens: sizes the grid

    @property
    def num_parts(self) -> int:
        return self.num_chunks + self.num_splits


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_blocks: torch.Tensor) -> None:
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert prefix_blocks.shape == (1,) and prefix_blocks.dtype == torch.int32 and prefix_blocks.device == q.device, (
        "prefix_blocks: (1,) int32 on q's device"
    )
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"


def _check_store(q: torch.Tensor, num_kv_heads: int, store: StepKV) -> None:
    batch, _, head_dim = q.shape
    assert fuses_store(head_dim), f"the fused store needs a power-of-two head_dim >= 16, got {head_dim}"
    assert q.stride(-1) == 1 and store.k.stride(-1) == 1 and store.v.stride(-1) == 1, "q, k, v: unit stride along D"
    assert store.k.shape == store.v.shape == (batch, num_kv_heads, head_dim), "k and v: (B, Hkv, D)"
    assert store.slot_mapping.shape == (batch,), "one slot a sequence"
    assert (store.q_norm_weight is None) == (store.k_norm_weight is None), "give both norm weights or neither"


def _grid(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    width: int,
    config: CascadeConfig,
    max_prefix_blocks: int,
    num_chunks: int | None,
    num_splits: int | None,
) -> _Grid:
    batch, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_m, prefix_n = config.prefix.block_m, config.prefix.block_n
    num_row_tiles = cdiv(batch * group, block_m)
    sms = num_sms(q.device)
    max_prefix_len = min(max(0, max_prefix_blocks), width) * page
    # The shortest prefix chunk worth a program (see pick_num_chunks), whole tiles. The kernels
    # enforce it on the device too, so a loose bound only adds programs that return at once.
    min_chunk = cdiv(max(prefix_n, 2 * block_m // q.element_size()), prefix_n) * prefix_n
    if num_chunks is None:
        num_chunks = pick_num_chunks(num_row_tiles, num_kv_heads, max_prefix_len, min_chunk, sms)
    if num_splits is None:
        # The suffix may be the whole context (prefix_blocks 0): the table's width bounds it.
        num_splits = pick_num_splits(batch, num_kv_heads, width * page, sms, config.suffix.block_n)
    return _Grid(
        group, batch * group, max(16, next_pow2(head_dim)), page, num_chunks, num_splits, min_chunk, max_prefix_len
    )


def _store_operands(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor, store: StepKV | None
) -> tuple[tuple[Any, ...], dict[str, bool]]:
    """The prefix kernel's FUSED arguments and flags: the store's operands, or placeholders."""
    batch = q.shape[0]
    if store is None:
        return (q, q, q, q, q, q, seq_lens, seq_lens, 0, 0, 0, 0, 0, batch, 0.0), dict(
            FUSED=False, HAS_NORM=False, FIX_BF16=False, FIX_K_CACHE=False, FIX_V_CACHE=False
        )
    has_norm = store.q_norm_weight is not None
    operands = (
        store.k, store.v, q, store.q_norm_weight if has_norm else q, store.k_norm_weight if has_norm else q,
        store.cos_sin_cache, store.positions, store.slot_mapping,
        store.k.stride(0), store.k.stride(1), store.v.stride(0), store.v.stride(1), store.cos_sin_cache.stride(0),
        batch, store.eps,
    )  # fmt: skip
    flags = dict(
        FUSED=True, HAS_NORM=has_norm, FIX_BF16=fix_bf16_rounding(q.dtype),
        FIX_K_CACHE=cast_needs_fix(store.k.dtype, k_cache.dtype),
        FIX_V_CACHE=cast_needs_fix(store.v.dtype, v_cache.dtype),
    )  # fmt: skip
    return operands, flags


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
    num_kv_heads = k_cache.shape[2]
    _check_inputs(q, k_cache, v_cache, prefix_blocks)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if store is None:
        q = raw_q = q if q.stride(-1) == 1 else q.contiguous()
    else:
        _check_store(q, num_kv_heads, store)
        raw_q, q = q, torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q: the normed, rotated q
    if config is None:
        config = default_cascade_config(q.dtype, head_dim)
    g = _grid(q, k_cache, block_tables.shape[1], config, max_prefix_blocks, num_chunks, num_splits)
    part_out = torch.empty((batch, num_q_heads, g.num_parts, g.block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_q_heads, g.num_parts), dtype=torch.float32, device=q.device)
    precision, upcast = dot_precision(q.dtype), upcast_dot(q.dtype)
    scale_log2 = scale * LOG2E

    # Without a store and a prefix bound of 0, prefix_blocks is 0 and every prefix program
    # would return at once: no launch.
    if g.max_prefix_len > 0 or store is not None:
        fused, flags = _store_operands(q, k_cache, v_cache, seq_lens, store)
        prefix_kernel[(cdiv(g.num_rows, config.prefix.block_m), g.num_chunks, num_kv_heads)](
            raw_q, k_cache, v_cache, block_tables, prefix_blocks,
            part_out, part_lse,
            scale_log2, g.num_rows, g.num_chunks, g.num_parts,
            raw_q.stride(0), raw_q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            *fused,
            GROUP=g.group, HEAD_DIM=head_dim, BLOCK_D=g.block_d, PAGE=g.page,
            BLOCK_M=config.prefix.block_m, BLOCK_N=config.prefix.block_n, MIN_CHUNK=g.min_chunk,
            PRECISION=precision, UPCAST=upcast, SPLIT_P=config.prefix.split_p and split_p(q.dtype, k_cache.dtype),
            **flags, **pdl_launch(q.device), num_warps=config.prefix.num_warps, num_stages=config.prefix.num_stages,
        )  # fmt: skip

    # The decode kernel's arrival counters: every launch of either kernel leaves them at zero,
    # so the two share one buffer (their launches are stream-ordered). Unused with one split.
    counters = arrival_counters(q.device, batch * num_kv_heads) if g.num_splits > 1 else seq_lens
    group_p2 = next_pow2(g.group)
    block_s = max(1, min(32, 8192 // (g.block_d * group_p2)))  # as in triton_decode.decode_with_config
    suffix_kernel[(g.num_splits, num_kv_heads, batch)](
        q, k_cache, v_cache, block_tables, seq_lens, prefix_blocks,
        out, part_out, part_lse, counters,
        scale_log2, g.num_chunks, g.num_splits, g.num_parts,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=g.group, GROUP_PAD=max(16, group_p2),
        HEAD_DIM=head_dim, BLOCK_D=g.block_d,
        PAGE=g.page, BLOCK_N=config.suffix.block_n, PREFIX_BLOCK_N=config.prefix.block_n, PREFIX_MIN_CHUNK=g.min_chunk,
        COUNTERS=g.num_splits > 1, PRECISION=precision, UPCAST=upcast,
        SPLIT_P=config.suffix.split_p and split_p(q.dtype, k_cache.dtype),
        FIX_BF16=fix_bf16_rounding(q.dtype), GROUP_P2=group_p2, BLOCK_S=block_s,
        **pdl_launch(q.device),
        num_warps=config.suffix.num_warps, num_stages=config.suffix.num_stages,
    )  # fmt: skip
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
    """pico_kernels.reference.paged_decode_attention_ref, reading the shared prefix once."""
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
    """pico_kernels.triton_fused.qk_norm_rope_store, then cascade_decode_attention, in the two
    launches of the latter: the prefix kernel's programs also norm and rotate q (each its own
    rows; one per row tile writes them for the suffix kernel) and write the step's K and V, so
    a layer's decode attention takes one launch fewer. The new tokens' slots lie outside the
    shared prefix (a block being written is never shared). fuses_store(head_dim) must hold."""
    return cascade_with_config(
        q, k_cache, v_cache, block_tables, seq_lens, scale, prefix_blocks, max_prefix_blocks, out=out, store=step
    )
