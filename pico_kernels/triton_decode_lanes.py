"""The decode loop on the CUDA cores, for one or two query rows over an FP8 cache.

`attend_pages_lanes` has the contract of `pico_kernels.triton_decode_tiles.attend_pages` (the
unnormalised accumulator, running max and sum of the query rows over [start, end) of one KV
head, log2 units); `triton_decode.default_decode_config` says when the decode kernel takes it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pico_kernels.triton_common import page_slots


@triton.jit
def lanes_row(q_row, k, v, t_mask, m_i, l_i, acc, LANES_R: tl.constexpr):
    """One query row's online-softmax step over a (BLOCK_N, BLOCK_D) fp32 tile pair, log2 units."""
    BLOCK_N: tl.constexpr = k.shape[0]
    s = tl.where(t_mask, tl.sum(k * q_row[None, :], 1), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    p = tl.exp2(s - m_new)
    alpha = tl.exp2(m_i - m_new)
    pv = tl.reshape(p[:, None] * v, [BLOCK_N // LANES_R, LANES_R, k.shape[1]])  # token n = c * LANES_R + r
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(pv, 0)


@triton.jit
def attend_pages_lanes(
    q, table, k_head, v_head, start, end,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
    BLOCK_N: tl.constexpr, LANES_R: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """attend_pages on the CUDA cores, for one or two query rows (GQA groups of 1 or 2) over an
    FP8 cache, whose tiles reach the tensor cores' operands a few bytes a load (bench/NOTES.md,
    "An FP8 KV cache"). One warp: each lane keeps the 16-byte runs of the token rows it loaded,
    the scores are fp32 FMAs summed over the head dim across lanes, and P @ V is summed within
    each lane into a (LANES_R, BLOCK_D) accumulator a row (LANES_R: the lanes that split a
    tile's tokens), reduced across them once, after the loop. No tile changes layout, so nothing
    goes through shared memory. Same returns as attend_pages."""
    TWO: tl.constexpr = q.shape[0] == 2
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = (offs_d < HEAD_DIM)[None, :]
    rows = tl.arange(0, q.shape[0])[:, None]
    q = q.to(tl.float32) * scale_log2  # log2 units
    q0 = tl.sum(tl.where(rows == 0, q, 0.0), 0)
    q1 = tl.sum(tl.where(rows == 1, q, 0.0), 0)
    m0 = tl.full([], float("-inf"), tl.float32)
    m1 = m0
    l0 = tl.zeros([], tl.float32)
    l1 = l0
    acc0 = tl.zeros([LANES_R, BLOCK_D], tl.float32)
    acc1 = acc0
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        t_mask = tok < end
        page, slot = page_slots(table, tok, t_mask, PAGE)
        mask = t_mask[:, None] & d_mask
        k_rows = (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
        v_rows = (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
        k = tl.load(k_head + k_rows, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_D)
        v = tl.load(v_head + v_rows, mask=mask, other=0.0).to(tl.float32)
        m0, l0, acc0 = lanes_row(q0, k, v, t_mask, m0, l0, acc0, LANES_R)
        if TWO:
            m1, l1, acc1 = lanes_row(q1, k, v, t_mask, m1, l1, acc1, LANES_R)
    acc = tl.where(rows == 0, tl.sum(acc0, 0)[None, :], tl.sum(acc1, 0)[None, :])
    first = tl.arange(0, q.shape[0]) == 0
    return acc, tl.where(first, m0, m1), tl.where(first, l0, l1)
