"""The tensor-core loop of paged decode attention and the combine of split partials: the
device functions that the decode kernel (pico_kernels.triton_decode) and both cascade kernels
(pico_kernels.triton_cascade_kernels) share.

The loop is an online softmax over a block table's tokens, a tile at a time (attend_pages).
combine_group merges the normalised partials of a KV head's splits by their log-sum-exps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pico_kernels.triton_common import (
    load_rows,
    mma,
    mma_pv,
    page_slots,
    query_operand,
    round_to,
    softmax_step,
    tile_ptrs,
)


@triton.jit
def attend_pages(
    q, table, k_head, v_head, start, end,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr,
):  # fmt: skip
    """Online softmax of the query rows `q` (ROWS, BLOCK_D) over the tokens [start, end) of one
    KV head, read through a block table (`table`: the row of page ids; `k_head`/`v_head`: the
    caches offset to the head), a tile of BLOCK_N at a time. Returns the unnormalised (acc,
    running max, sum), log2 scale. The loop of the decode kernel and of both cascade kernels."""
    q = query_operand(q, k_head.dtype.element_ty)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        t_mask = tok < end
        page, slot = page_slots(table, tok, t_mask, PAGE)
        k = load_rows(tile_ptrs(k_head, page, slot, stride_kb, stride_ks, offs_d), t_mask, d_mask, True, D_MASK)
        k = k.to(q.dtype)  # (BLOCK_N, BLOCK_D)
        v = load_rows(tile_ptrs(v_head, page, slot, stride_vb, stride_vs, offs_d), t_mask, d_mask, True, D_MASK)
        v = v.to(q.dtype)
        qk = mma(q, tl.trans(k), PRECISION, UPCAST)  # (ROWS, BLOCK_N)
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, scale_log2)
        acc = acc * alpha[:, None] + mma_pv(p, v, PRECISION, UPCAST, SPLIT_P)
    return acc, m_i, l_i


@triton.jit
def combine_group(
    part_out_ptr, part_lse_ptr, row0, num_splits, num_used, out_ptr, stride_oh,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr, FIX_BF16: tl.constexpr,
):  # fmt: skip
    """Combine the partials of the first num_used splits of GROUP query heads (scratch rows
    row0 + g * num_splits + s) into their outputs (out_ptr: the group's first head): weights
    exp2(lse - max lse), in one pass over chunks of BLOCK_S splits, the running max rescaling
    the sums as in the online softmax. With no split used (seq_len 0) the output is zeros.
    The partials are other programs' stores: loaded through L2 (.cg), never from a possibly
    stale L1 line."""
    offs_g = tl.arange(0, GROUP_P2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    rows_g = row0 + offs_g * num_splits  # (GROUP_P2,)
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    weight_sum = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
    for s0 in range(0, num_used, BLOCK_S):
        s = s0 + offs_s
        mask = g_mask[:, None] & (s < num_used)[None, :]  # (GROUP_P2, BLOCK_S)
        rows = rows_g[:, None] + s[None, :]
        lse = tl.load(part_lse_ptr + rows, mask=mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_out_ptr + rows[:, :, None] * BLOCK_D + offs_d[None, None, :], mask=mask[:, :, None],
                    other=0.0, cache_modifier=".cg")  # (GROUP_P2, BLOCK_S, BLOCK_D)  # fmt: skip
        m_new = tl.maximum(m, tl.max(lse, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows (g >= GROUP)
        alpha = tl.exp2(m - shift)
        w = tl.exp2(lse - shift[:, None])
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        weight_sum = weight_sum * alpha + tl.sum(w, 1)
        m = m_new
    out = acc / tl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
    tl.store(out_ptr + offs_g[:, None] * stride_oh + offs_d[None, :], round_to(out, out_ptr.dtype.element_ty, FIX_BF16),
             mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :])  # fmt: skip
