"""Paged prefill attention in Triton: causal flash attention over a cached prefix.

The new tokens of B sequences are flattened (cu_seqlens_q); the new tokens of sequence b sit at
context positions seq_lens[b] - q_len_b .. seq_lens[b] - 1, and all K/V (cached prefix and the
new tokens' own) are read from the paged cache through the block table.

Grid: (query heads / H, query tiles). A tile holds T = BLOCK_M / H query tokens of H query heads
(H = 1, or with PrefillConfig.pack_gqa the G heads of one KV head, so that short queries over
long contexts fill the rows and read each K/V tile once for the group). The tiles of all
sequences are numbered without a device sync the way varlen flash attention does it: sequence
b owns tile ids [cu_q[b] // T + b, cu_q[b + 1] // T + b + 1), at least ceil(q_len_b / T) of
them, so Nq // T + B programs always cover the batch (the few spare ones return at once).
A program finds its sequence by binary search over cu_seqlens_q. Tile ids are taken in reverse
and the heads vary fastest in the launch order, so the longest-context tiles of every head start
first (longest work first across the whole grid, and the heads that share a KV head read its
tiles at about the same time).

Each program walks the key tiles in two phases: tiles every query row of the tile may see in
full (no mask), then the tiles across the diagonal (causal mask). Tiles past the diagonal are
never read. With a sliding window a first phase comes before them: the tiles across the
window's lower edge (masked); keys before the first row's window are never read.

Contract: `paged_prefill_attention` has the signature and semantics of
`pico_kernels.reference.paged_prefill_attention_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pico_kernels.prefill_tiles import find_seq, row_tiles
from pico_kernels.triton_common import (
    LOG2E,
    dot_precision,
    fix_bf16_rounding,
    interpreting,
    load_rows,
    mma,
    mma_pv,
    next_pow2,
    page_slots,
    query_operand,
    round_to,
    softmax_step,
    softmax_step_safe,
    split_p,
    tile_ptrs,
    upcast_dot,
)


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    block_m: int  # query rows per program
    block_n: int  # key tokens per loop step
    num_warps: int
    num_stages: int
    # bf16: P @ V with P as two bf16 terms (pico_kernels.triton_common.mma_pv). Off by default here:
    # prefill is tensor-core bound and the second product costs a third of its speed
    # (bench/results/kernels_h200.md).
    split_p: bool = False
    # GQA heads packed into the rows: a tile holds block_m // G tokens x the G query heads of
    # one KV head, so each K/V tile feeds all of them (taken when G divides block_m).
    pack_gqa: bool = False


SHORT_QUERIES = 64  # new tokens per sequence up to which the prefill kernel takes 64-row tiles


def default_prefill_config(dtype: torch.dtype, head_dim: int, max_query_len: int = 0) -> PrefillConfig:
    """16-bit, head_dim <= 128: 128 x 128 tiles, 8 warps (two Hopper warpgroups), 3 stages
    (the fastest of five configs measured, bench/results/kernels_h200.md). When no sequence
    brings more than 64 new tokens (0 < max_query_len <= 64: prompts served mostly from the
    prefix cache, short chunks), 128-row tiles would be mostly empty: 64 x 64 tiles at 4 warps,
    about twice as fast there (bench/NOTES.md, "Figures behind the code's choices"), the GQA heads packed into the rows.
    Larger heads and fp32 (whose exact products run on FMA units and need many registers)
    use smaller tiles, chosen so that the compiled kernels do not spill. The interpreter uses
    16 x 16 tiles so that small test shapes still span several tiles."""
    if interpreting():
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    block_d = max(16, next_pow2(head_dim))
    if dtype == torch.float32:
        return PrefillConfig(block_m=32, block_n=16, num_warps=4 if block_d <= 64 else 8, num_stages=2)
    if block_d > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if 0 < max_query_len <= SHORT_QUERIES:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, pack_gqa=True)
    return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit
def _masked_tiles(
    q, q_pos, table, k_head, v_head, kv_start, kv_end, window, acc, m_i, l_i,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, d_mask,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    """The key tiles [kv_start, kv_end) under the causal mask (and the window's, WINDOWED),
    folded into the online softmax (acc, m_i, l_i) of the rows at positions q_pos."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM
    for n0 in range(kv_start, kv_end, BLOCK_N):
        tok = n0 + offs_n
        t_mask = tok < kv_end
        page, slot = page_slots(table, tok, t_mask, PAGE)
        k = load_rows(tile_ptrs(k_head, page, slot, stride_kb, stride_ks, offs_d), t_mask, d_mask, True, D_MASK)
        k = k.to(q.dtype)
        qk = mma(q, tl.trans(k), PRECISION, UPCAST)
        visible = (tok[None, :] <= q_pos[:, None]) & t_mask[None, :]
        if WINDOWED:  # a row may have no visible key in a tile, nor yet any: the safe step
            visible = visible & (tok[None, :] > q_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            p, alpha, m_i, l_i = softmax_step_safe(qk, m_i, l_i, scale_log2)
        else:
            qk = tl.where(visible, qk, float("-inf"))
            p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, scale_log2)
        v = load_rows(tile_ptrs(v_head, page, slot, stride_vb, stride_vs, offs_d), t_mask, d_mask, True, D_MASK)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + mma_pv(p, v, PRECISION, UPCAST, SPLIT_P)
    return acc, m_i, l_i


@triton.jit
def _window_edge_tiles(
    q, q_pos, table, k_head, v_head, first_pos, kv_end, window, acc, m_i, l_i,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, d_mask,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr,
):  # fmt: skip
    """Sliding window, phase 0: the key tiles from the first row's window start (first_pos -
    window + 1) up past the last row's (kv_end - window), masked. Returns the softmax state
    and [full_start, full_end): the tiles after them that every row sees in full."""
    kv_start = tl.maximum(first_pos - window + 1, 0)
    edge = tl.maximum(kv_end - window - kv_start, 0)
    full_start = tl.minimum(kv_start + tl.cdiv(edge, BLOCK_N) * BLOCK_N, kv_end)
    acc, m_i, l_i = _masked_tiles(
        q, q_pos, table, k_head, v_head, kv_start, full_start, window, acc, m_i, l_i,
        stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, d_mask,
        BLOCK_N, HEAD_DIM, BLOCK_D, PAGE, PRECISION, UPCAST, SPLIT_P, True,
    )  # fmt: skip
    full_end = full_start + tl.maximum(first_pos + 1 - full_start, 0) // BLOCK_N * BLOCK_N
    return acc, m_i, l_i, full_start, full_end


# One compiled kernel for every batch: the batch size and the block-table width (the longest
# sequence's block count) change from step to step, and Triton would otherwise compile a new
# specialization whenever one of them is 1 or a multiple of 16 (a stall of a second or two).
@triton.jit(do_not_specialize=["num_seqs", "window", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    scale_log2, num_seqs, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SPLIT_P: tl.constexpr, FIX_BF16: tl.constexpr, HEADS: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    # HEADS query heads share each row tile (1, or all GROUP of a KV head): row r holds token
    # r // HEADS of the tile, query head program_id(0) * HEADS + r % HEADS.
    TOKENS: tl.constexpr = BLOCK_M // HEADS  # query tokens per tile
    tile_id = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(0) * HEADS // GROUP

    seq = find_seq(cu_seqlens_q_ptr, num_seqs, tile_id, TOKENS)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m_start = (tile_id - (q_start // TOKENS + seq)) * TOKENS
    if m_start < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len + m_start  # context position of the tile's first query token
        kv_end = tl.minimum(first_pos + TOKENS, seq_len)  # one past the last key any row sees
        full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # keys below it are seen by every row

        offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
        D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM
        d_mask = offs_d < HEAD_DIM
        rows = m_start + offs_m // HEADS  # the rows' tokens within the sequence's new ones
        heads = tl.program_id(0) * HEADS + offs_m % HEADS
        row_mask = rows < q_len
        q_pos = first_pos + offs_m // HEADS
        q_offs = (q_start + rows).to(tl.int64)
        q = load_rows(q_ptr + q_offs[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                      row_mask, d_mask, True, D_MASK)  # (BLOCK_M, BLOCK_D)  # fmt: skip
        q = query_operand(q, k_cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
        v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

        full_start = 0  # keys from here to full_end are seen by every row
        if WINDOWED:  # phase 0: the tiles across the windows' lower edge
            acc, m_i, l_i, full_start, full_end = _window_edge_tiles(
                q, q_pos, table, k_head, v_head, first_pos, kv_end, window, acc, m_i, l_i,
                stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, d_mask,
                BLOCK_N, HEAD_DIM, BLOCK_D, PAGE, PRECISION, UPCAST, SPLIT_P,
            )  # fmt: skip

        # Phase 1: key tiles below the diagonal, no mask.
        for n0 in range(full_start, full_end, BLOCK_N):
            tok = n0 + offs_n
            page, slot = page_slots(table, tok, None, PAGE)
            k = load_rows(tile_ptrs(k_head, page, slot, stride_kb, stride_ks, offs_d), offs_n, d_mask, False, D_MASK)
            k = k.to(q.dtype)  # (BLOCK_N, BLOCK_D)
            qk = mma(q, tl.trans(k), PRECISION, UPCAST)  # (BLOCK_M, BLOCK_N)
            p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, scale_log2)
            v = load_rows(tile_ptrs(v_head, page, slot, stride_vb, stride_vs, offs_d), offs_n, d_mask, False, D_MASK)
            v = v.to(q.dtype)
            acc = acc * alpha[:, None] + mma_pv(p, v, PRECISION, UPCAST, SPLIT_P)

        # Phase 2: key tiles across the diagonal, causal mask. Without a window no row's max
        # stays -inf: it is finite after phase 1, or phase 2 starts at key 0, which all rows see.
        acc, m_i, l_i = _masked_tiles(
            q, q_pos, table, k_head, v_head, full_end, kv_end, window, acc, m_i, l_i,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, d_mask,
            BLOCK_N, HEAD_DIM, BLOCK_D, PAGE, PRECISION, UPCAST, SPLIT_P, WINDOWED,
        )  # fmt: skip

        l_i = tl.where(l_i > 0.0, l_i, 1.0) if WINDOWED else l_i  # rows past q_len may have no key
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_offs[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 round_to(out, out_ptr.dtype.element_ty, FIX_BF16),
                 mask=row_mask[:, None] & d_mask[None, :])  # fmt: skip


def prefill_with_config(
    q: torch.Tensor,  # (Nq, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: torch.Tensor,  # (B + 1,) int32
    seq_lens: torch.Tensor,  # (B,) int32
    scale: float,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,  # (Nq, Hq, D), contiguous; allocated when None
    max_query_len: int = 0,  # the most new tokens of one sequence, if known: picks the default tiles
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # (Nq, Hq, D), dtype of q
    """paged_prefill_attention with an explicit tile config and output buffer (for tests,
    benchmarks and the piecewise prefill graphs). None picks the default launch: on Hopper,
    where pico_kernels.gluon_prefill applies and the queries are not short (SHORT_QUERIES),
    its warp-specialised kernel; else this kernel with `default_prefill_config`."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    if config is None and q.is_cuda and not interpreting() and not 0 < max_query_len <= SHORT_QUERIES:
        from pico_kernels import gluon_prefill  # Gluon's Hopper modules: imported only on a GPU

        if gluon_prefill.applies(q, k_cache, v_cache, window):
            return gluon_prefill.paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out)
    if config is None:
        config = default_prefill_config(q.dtype, head_dim, max_query_len)
    group = num_q_heads // num_kv_heads
    heads = group if config.pack_gqa and config.block_m % group == 0 else 1
    num_tiles = row_tiles(num_tokens, num_seqs, config.block_m // heads)
    _prefill_kernel[(num_q_heads // heads, num_tiles)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale * LOG2E, num_seqs, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)), PAGE=page,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        PRECISION=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype),
        SPLIT_P=config.split_p and split_p(q.dtype, k_cache.dtype),
        FIX_BF16=fix_bf16_rounding(q.dtype), HEADS=heads, WINDOWED=window > 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # (Nq, Hq, D): new tokens of all sequences, flattened in batch order
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: torch.Tensor,  # (B + 1,) int32, prefix sums of the new-token counts
    seq_lens: torch.Tensor,  # (B,) int32, context length incl. the new tokens
    scale: float,
    max_query_len: int = 0,  # the most new tokens of one sequence if known (0: not): picks the tiles
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # (Nq, Hq, D), dtype of q
    """Triton version of pico_kernels.reference.paged_prefill_attention_ref."""
    return prefill_with_config(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, max_query_len=max_query_len, window=window
    )
