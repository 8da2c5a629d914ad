"""The step's q/k norm + rotary + K/V store (pico_kernels.triton_fused.qk_norm_rope_store's work)
as the cascade's prefix kernel does it (pico_kernels.triton_cascade.cascade_decode_attention_store):
its inputs (StepKV), the head sizes it takes (fuses_store), and the jit helpers that work on
the prefix kernel's rows, (sequence, query head) pairs of one KV head, with
pico_kernels.triton_fused's per-head norm, rotary and row copies, to the same bits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pico_kernels.triton_common import round_to
from pico_kernels.triton_fused import copy_rows, norm_rope_halves, norm_rope_rows


@dataclass(frozen=True, slots=True)
class StepKV:
    """What pico_kernels.triton_fused.qk_norm_rope_store takes besides q and the caches: this step's
    k and v (views into the qkv projection's output), the rotary positions and cache, the
    per-head norm weights (None without) and the slots. Given to cascade_with_config, the
    prefix kernel's launch also does that kernel's work (cascade_decode_attention_store)."""

    k: torch.Tensor  # (B, Hkv, D), unit stride along D
    v: torch.Tensor  # (B, Hkv, D), likewise
    positions: torch.Tensor  # (B,) int
    cos_sin_cache: torch.Tensor  # (P, D)
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float
    slot_mapping: torch.Tensor  # (B,) int64; -1 = skip


def fuses_store(head_dim: int) -> bool:
    """Whether cascade_decode_attention_store takes this head size: the prefix kernel rebuilds
    q from its two rotary halves, which needs head_dim a power of two (>= 16, a tile's)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


@triton.jit
def load_cos_sin_rows(cos_sin_ptr, pos_ptr, seq, row_mask, mask, stride_cs, offs_h, HALF: tl.constexpr):
    """fp32 cos, sin (rows, HALF) at the positions of the rows' sequences (mask: row_mask
    broadcast to (rows, HALF))."""
    pos = tl.load(pos_ptr + seq, mask=row_mask, other=0).to(tl.int64)[:, None]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_h, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_h, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def normed_query_rows(
    q_ptr, q_out_ptr, q_w_ptr, cos_sin_ptr, pos_ptr, seq, q_head, row_mask, write, eps,
    stride_qb, stride_qh, stride_cs, num_q_heads,
    BLOCK_M: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, FIX_BF16: tl.constexpr,
):  # fmt: skip
    """The (BLOCK_M, 2 * HALF) query rows (sequence seq, head q_head) from the projection's
    output: the per-head norm and rotary of qk_norm_rope_store, to the same bits; with
    `write`, also stored to q_out (contiguous (B, Hq, D)). For the cascade's prefix kernel,
    which needs the rows whole in registers."""
    offs_h = tl.arange(0, HALF)[None, :]
    mask = row_mask[:, None] & (offs_h < HALF)
    cos, sin = load_cos_sin_rows(cos_sin_ptr, pos_ptr, seq, row_mask, mask, stride_cs, offs_h, HALF)
    src = q_ptr + (seq * stride_qb + q_head * stride_qh)[:, None]
    dt = q_ptr.dtype.element_ty
    x1 = tl.load(src + offs_h, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs_h, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = norm_rope_halves(x1, x2, q_w_ptr, cos, sin, offs_h, eps, dt, HALF, HAS_NORM, FIX_BF16)
    o1, o2 = round_to(o1, dt, FIX_BF16), round_to(o2, dt, FIX_BF16)  # as qk_norm_rope_store stores them
    if write:
        dst = q_out_ptr + ((seq * num_q_heads + q_head) * (2 * HALF))[:, None]
        tl.store(dst + offs_h, o1, mask=mask)
        tl.store(dst + HALF + offs_h, o2, mask=mask)
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_M, 2 * HALF))  # [o1 | o2] along the head dim


@triton.jit
def store_kv_rows(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, slot_ptr,
    row_tile, kv_head, num_seqs, eps,
    stride_kn, stride_kh_in, stride_vn, stride_vh_in, stride_cs,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, HAS_NORM: tl.constexpr,
    FIX_BF16: tl.constexpr, FIX_K_CACHE: tl.constexpr, FIX_V_CACHE: tl.constexpr,
):  # fmt: skip
    """This step's K (normed, rotated) and V (a copy) of KV head kv_head into the caches, for
    the sequences with a row in this row tile (a sequence whose rows straddle two tiles is
    written by both, the same bits); a slot < 0 writes nothing. As qk_norm_rope_store does for
    these heads. For the cascade's prefix kernel, whose rows are (sequence, query head) pairs
    of one KV head (GROUP query heads a sequence), BLOCK_M a tile."""
    seqs = (row_tile * BLOCK_M) // GROUP + tl.arange(0, BLOCK_M)
    in_tile = (seqs < num_seqs) & (seqs * GROUP < (row_tile + 1) * BLOCK_M)
    slot = tl.load(slot_ptr + seqs, mask=in_tile, other=-1).to(tl.int64)
    offs_h = tl.arange(0, HALF)[None, :]
    writes = in_tile & (slot >= 0)
    mask = writes[:, None] & (offs_h < HALF)
    seqs = seqs.to(tl.int64)
    head = kv_head.to(tl.int64)
    cos, sin = load_cos_sin_rows(cos_sin_ptr, pos_ptr, seqs, writes, mask, stride_cs, offs_h, HALF)
    src = k_ptr + (seqs * stride_kn + head * stride_kh_in)[:, None]
    block, offset = slot // PAGE, slot % PAGE
    dst = k_cache_ptr + (block * stride_kb + offset * stride_ks + head * stride_kh)[:, None]
    norm_rope_rows(src, dst, k_w_ptr, cos, sin, offs_h, mask, eps, HALF, HAS_NORM, FIX_BF16, FIX_K_CACHE)
    src = v_ptr + (seqs * stride_vn + head * stride_vh_in)[:, None]
    dst = v_cache_ptr + (block * stride_vb + offset * stride_vs + head * stride_vh)[:, None]
    copy_rows(src, dst, offs_h, mask, HALF, FIX_V_CACHE)
