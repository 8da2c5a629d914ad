"""Fused Triton kernels for the elementwise work around the projections of a decoder layer.

    rms_norm            (residual add +) RMSNorm of a row          ref: pico_kernels.reference.rms_norm_ref
    qk_norm_rope        per-head q/k RMSNorm (Qwen3) + neox rotary ref: pico_kernels.reference.qk_norm_rope_ref
    qk_norm_rope_store  qk_norm_rope, k and v into the paged cache ref: pico_kernels.reference.qk_norm_rope_store_ref
    silu_and_mul        silu(gate) * up of a [gate | up] row       ref: pico_kernels.reference.silu_and_mul_ref

In torch each of these is a chain of 5-15 tiny kernels (casts, pow, mean, rsqrt, mul, cat, ...);
here each is one launch. With a cache a decoder layer runs qk_norm_rope_store, which also does
the work of pico_kernels.triton_store (otherwise a launch of its own for a few hundred bytes at
decode); qk_norm_rope serves the forward without a cache (profiling).

Math is fp32, and every place where the torch path rounds to the activation dtype (a bf16 op's
result) is rounded here too, so bf16 outputs match the torch path up to the order of the fp32
sum of squares.

No host syncs and no data-dependent allocation: all of them are CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pico_kernels.triton_common import (
    cdiv,
    fix_bf16_rounding,
    next_pow2,
    pdl_launch,
    pdl_prologue,
    round_to,
    to_cache,
)

# ---- rms_norm ----


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_res, stride_out, stride_new_res,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, FIX_BF16: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), dt, FIX_BF16)  # x + residual, rounded
        tl.store(new_res_ptr + row * stride_new_res + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = round_to(xf * rstd, dt, FIX_BF16).to(tl.float32)  # torch: xf.to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = round_to(w * normed, out_ptr.dtype.element_ty, FIX_BF16)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor,  # (N, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # (N, hidden), dtype of x
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual), each (N, hidden)
    """With residual: new residual = x + residual, normed = RMSNorm(new residual). Without:
    the new residual is x itself (as in layers.RMSNorm)."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"rms_norm wants (N, hidden) rows with unit stride, got {x.stride()}"
    n, hidden = x.shape
    out = torch.empty((n, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        residual = new_residual = x  # unused by the kernel
    if n == 0:
        return out, new_residual
    block = next_pow2(hidden)
    _rms_norm_kernel[(n,)](
        x, residual, weight, out, new_residual,
        x.stride(0), residual.stride(0), out.stride(0), new_residual.stride(0),
        hidden, eps,
        HAS_RESIDUAL=new_residual is not x, BLOCK=block, FIX_BF16=fix_bf16_rounding(x.dtype),
        **pdl_launch(x.device),
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out, new_residual


# ---- qk_norm_rope ----


@triton.jit
def _rounded(x, dt: tl.constexpr, FIX_BF16: tl.constexpr):
    """fp32 x rounded to dt and widened back: the result of one torch op in dt."""
    return round_to(x, dt, FIX_BF16).to(tl.float32)


@triton.jit
def store_as(ptr, x, dt: tl.constexpr, mask, FIX_BF16: tl.constexpr, FIX_DST: tl.constexpr):
    """Store fp32 x as the result of a torch op in dt, converted to ptr's dtype (torch's .to()).
    FIX_DST: ptr is bf16, dt is not, and the conversion must round by hand (interpreter)."""
    out = round_to(x, dt, FIX_BF16)
    if FIX_DST:
        out = round_to(out.to(tl.float32), ptr.dtype.element_ty, True)
    tl.store(ptr, to_cache(out, ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_rope_halves(
    x1, x2, w_ptr, cos, sin, offs, eps, dt: tl.constexpr,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, FIX_BF16: tl.constexpr,
):  # fmt: skip
    """fp32 halves x1, x2 (rows, BLOCK_HALF) of heads, a row each -> the halves after the
    optional RMSNorm over each whole head and the rotary, every op rounded to dt as torch's
    ops in dt round (the values are dt's, held in fp32). offs (1, BLOCK_HALF); cos and sin are
    fp32 and broadcast against the rows (one position for all, or one a row)."""
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        w_mask = offs < HALF
        w1 = tl.load(w_ptr + offs, mask=w_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=w_mask, other=0.0).to(tl.float32)
        # torch: weight * xf.to(x.dtype), each product rounded to the activation dtype
        x1 = _rounded(w1 * _rounded(x1 * rstd, dt, FIX_BF16), dt, FIX_BF16)
        x2 = _rounded(w2 * _rounded(x2 * rstd, dt, FIX_BF16), dt, FIX_BF16)
    # torch: cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin), every op rounded
    o1 = _rounded(x1 * cos, dt, FIX_BF16) - _rounded(x2 * sin, dt, FIX_BF16)
    o2 = _rounded(x2 * cos, dt, FIX_BF16) + _rounded(x1 * sin, dt, FIX_BF16)
    return o1, o2


@triton.jit
def norm_rope_rows(
    src, dst, w_ptr, cos, sin, offs, mask, eps,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, FIX_BF16: tl.constexpr, FIX_DST: tl.constexpr,
):  # fmt: skip
    """Heads, a row each: src and dst are (rows, 1) pointers to each head's first element (unit
    stride along D), offs (1, BLOCK_HALF), mask (rows, BLOCK_HALF). Load each head's two halves,
    norm_rope_halves them, and store. cos/sin are fp32, (1, BLOCK_HALF) for heads of one token
    or (rows, BLOCK_HALF). The math rounds in src's dtype; dst may be of another dtype (a
    cache's)."""
    dt = src.dtype.element_ty
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = norm_rope_halves(x1, x2, w_ptr, cos, sin, offs, eps, dt, HALF, HAS_NORM, FIX_BF16)
    store_as(dst + offs, o1, dt, mask, FIX_BF16, FIX_DST)
    store_as(dst + HALF + offs, o2, dt, mask, FIX_BF16, FIX_DST)


@triton.jit
def copy_rows(src, dst, offs, mask, HALF: tl.constexpr, FIX_DST: tl.constexpr):
    """Heads copied as they are (V into a cache), a row each, pointers and masks as in
    norm_rope_rows; FIX_DST: the cache is bf16 and src is not, rounded by hand (interpreter)."""
    for i in tl.static_range(2):  # offs spans half a head
        x = tl.load(src + i * HALF + offs, mask=mask, other=0.0)
        if FIX_DST:
            x = round_to(x.to(tl.float32), dst.dtype.element_ty, True)
        tl.store(dst + i * HALF + offs, to_cache(x, dst.dtype.element_ty), mask=mask)


@triton.jit
def _load_cos_sin(cos_sin_ptr, pos_ptr, tok, stride_cs, offs, mask, HALF: tl.constexpr):
    """fp32 cos, sin (BLOCK_HALF,) of token tok's position. The cache is in the model dtype, as
    the torch path multiplies with it."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])  # positions may be a slice at any offset
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_cs,
    num_q_heads, num_kv_heads, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS: tl.constexpr, HAS_NORM: tl.constexpr, FIX_BF16: tl.constexpr,
):  # fmt: skip
    """Programs (token, group of HEADS heads) over the Hq + Hkv heads, laid out as
    _qk_norm_rope_store_kernel's, so that the two round alike to the bit."""
    tok = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * HEADS
    rows = tl.arange(0, HEADS)[:, None]  # (HEADS, 1): a head each
    offs = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    mask = (offs < HALF) & (rows >= 0)
    cos, sin = _load_cos_sin(cos_sin_ptr, pos_ptr, tok, stride_cs, offs, offs < HALF, HALF)
    if first < num_q_heads:
        head = first + rows
        src = q_ptr + tok * stride_qn + head * stride_qh
        dst = q_out_ptr + (tok * num_q_heads + head) * (2 * HALF)
        norm_rope_rows(src, dst, q_w_ptr, cos, sin, offs, mask, eps, HALF, HAS_NORM, FIX_BF16, False)
    else:
        kv_head = first - num_q_heads + rows
        src = k_ptr + tok * stride_kn + kv_head * stride_kh
        dst = k_out_ptr + (tok * num_kv_heads + kv_head) * (2 * HALF)
        norm_rope_rows(src, dst, k_w_ptr, cos, sin, offs, mask, eps, HALF, HAS_NORM, FIX_BF16, False)


def _check_qk(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, q_norm_weight, k_norm_weight) -> bool:
    """Shape checks shared by both entry points; returns whether the heads are normed."""
    n, _, head_dim = q.shape
    assert k.shape == (n, k.shape[1], head_dim) and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q and k need unit stride along head_dim"
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None), "give both q and k norm weights or neither"
    return has_norm


def qk_norm_rope(
    q: torch.Tensor,  # (N, Hq, D), any strides with unit stride along D
    k: torch.Tensor,  # (N, Hkv, D), likewise
    positions: torch.Tensor,  # (N,) int
    cos_sin_cache: torch.Tensor,  # (P, D): [cos | sin] per position, as layers.RotaryEmbedding
    q_norm_weight: torch.Tensor | None = None,  # (D,): per-head RMSNorm before rope (Qwen3)
    k_norm_weight: torch.Tensor | None = None,  # (D,)
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # new contiguous q (N, Hq, D) and k (N, Hkv, D)
    """Neox-style rotary of q and k (after RMSNorm of each head when norm weights are given),
    both in one launch: one program per (token, head)."""
    has_norm = _check_qk(q, k, cos_sin_cache, q_norm_weight, k_norm_weight)
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((n, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((n, num_kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if n == 0:
        return q_out, k_out
    half = head_dim // 2
    heads = heads_per_program(num_q_heads, num_kv_heads)
    _qk_norm_rope_kernel[(n, (num_q_heads + num_kv_heads) // heads)](
        q, k, q_out, k_out,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        cos_sin_cache, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, eps,
        HALF=half, BLOCK_HALF=next_pow2(half), HEADS=heads, HAS_NORM=has_norm, FIX_BF16=fix_bf16_rounding(q.dtype),
        num_warps=max(1, heads // 2),
    )  # fmt: skip
    return q_out, k_out


# ---- qk_norm_rope_store ----


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # slices of a packed tensor
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, slot_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    num_q_heads, num_kv_heads, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HEADS: tl.constexpr, PAGE: tl.constexpr, HAS_NORM: tl.constexpr,
    FIX_BF16: tl.constexpr, FIX_K_CACHE: tl.constexpr, FIX_V_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Programs (token, group of HEADS heads) over the Hq + 2 Hkv heads (HEADS divides Hq and
    Hkv, so a group is all q, all k or all v heads): q heads -> q_out, k heads -> k_cache, v
    heads -> v_cache (a copy); the k and v heads of a token with slot < 0 write nothing."""
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * HEADS
    rows = tl.arange(0, HEADS)[:, None]  # (HEADS, 1): a head each
    offs = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    mask = (offs < HALF) & (rows >= 0)  # (HEADS, BLOCK_HALF)
    if first < num_q_heads:
        cos, sin = _load_cos_sin(cos_sin_ptr, pos_ptr, tok, stride_cs, offs, offs < HALF, HALF)
        head = first + rows
        src = q_ptr + tok * stride_qn + head * stride_qh
        dst = q_out_ptr + (tok * num_q_heads + head) * (2 * HALF)
        norm_rope_rows(src, dst, q_w_ptr, cos, sin, offs, mask, eps, HALF, HAS_NORM, FIX_BF16, False)
    else:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            block = slot // PAGE
            offset = slot % PAGE
            kv_head = first - num_q_heads + rows
            if first < num_q_heads + num_kv_heads:
                cos, sin = _load_cos_sin(cos_sin_ptr, pos_ptr, tok, stride_cs, offs, offs < HALF, HALF)
                src = k_ptr + tok * stride_kn + kv_head * stride_kh
                dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + kv_head * stride_kch
                norm_rope_rows(src, dst, k_w_ptr, cos, sin, offs, mask, eps, HALF, HAS_NORM, FIX_BF16, FIX_K_CACHE)
            else:
                kv_head -= num_kv_heads
                src = v_ptr + tok * stride_vn + kv_head * stride_vh
                dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + kv_head * stride_vch
                copy_rows(src, dst, offs, mask, HALF, FIX_V_CACHE)


def heads_per_program(num_q_heads: int, num_kv_heads: int) -> int:
    """Heads a qk_norm_rope_store program takes: the largest power of two up to 8 dividing
    both head counts. One program per (token, head) made 65,536 one-warp programs for a
    2,048-token prefill of Qwen3-0.6B, which was slow (bench/NOTES.md, "Figures behind the code's choices")."""
    heads = 8
    while num_q_heads % heads or num_kv_heads % heads:
        heads //= 2
    return heads


def cast_needs_fix(src: torch.dtype, dst: torch.dtype) -> bool:
    """A conversion src -> dst that the interpreter would truncate (see fix_bf16_rounding)."""
    return src != dst and fix_bf16_rounding(dst)


def qk_norm_rope_store(
    q: torch.Tensor,  # (N, Hq, D), any strides with unit stride along D
    k: torch.Tensor,  # (N, Hkv, D), likewise
    v: torch.Tensor,  # (N, Hkv, D), likewise
    positions: torch.Tensor,  # (N,) int
    cos_sin_cache: torch.Tensor,  # (P, D): [cos | sin] per position, as layers.RotaryEmbedding
    q_norm_weight: torch.Tensor | None,  # (D,): per-head RMSNorm before rope (Qwen3), or None
    k_norm_weight: torch.Tensor | None,  # (D,), or None
    eps: float,
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), unit stride along D
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), likewise
    slot_mapping: torch.Tensor,  # (N,) int64; slot = block_id * block_size + offset; -1 = skip
    out: torch.Tensor | None = None,  # (N, Hq, D) contiguous, q's dtype: where q goes (allocated when None)
) -> torch.Tensor:  # new contiguous q (N, Hq, D)
    """qk_norm_rope, with the rotated k and a copy of v written into the caches at the slots (in
    place; as store_kvcache) instead of returned: one launch, one program per token and group
    of heads (heads_per_program) over the Hq + 2 Hkv heads."""
    has_norm = _check_qk(q, k, cos_sin_cache, q_norm_weight, k_norm_weight)
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert v.shape == k.shape and v.stride(-1) == 1, "v needs k's shape and unit stride along head_dim"
    cache_shape = (k_cache.shape[0], k_cache.shape[1], num_kv_heads, head_dim)
    assert k_cache.shape == cache_shape and v_cache.shape == cache_shape, f"caches must be {cache_shape}"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    assert slot_mapping.shape == (n,)
    if out is None:
        q_out = torch.empty((n, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == (n, num_q_heads, head_dim) and out.dtype == q.dtype and out.is_contiguous(), (
            "out: contiguous (N, Hq, D) of q's dtype"
        )
        q_out = out
    if n == 0:
        return q_out
    half = head_dim // 2
    heads = heads_per_program(num_q_heads, num_kv_heads)
    _qk_norm_rope_store_kernel[(n, (num_q_heads + 2 * num_kv_heads) // heads)](
        q, k, v, q_out, k_cache, v_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        cos_sin_cache, positions, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_q_heads, num_kv_heads, eps,
        HALF=half, BLOCK_HALF=next_pow2(half), HEADS=heads, PAGE=k_cache.shape[1], HAS_NORM=has_norm,
        FIX_BF16=fix_bf16_rounding(q.dtype),
        FIX_K_CACHE=cast_needs_fix(k.dtype, k_cache.dtype), FIX_V_CACHE=cast_needs_fix(v.dtype, v_cache.dtype),
        **pdl_launch(q.device),
        num_warps=max(1, heads // 2),
    )  # fmt: skip
    return q_out


# ---- silu_and_mul ----


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
    FIX_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dt, FIX_BF16).to(tl.float32)  # F.silu rounds to x's dtype
    tl.store(out_ptr + row * stride_out + cols, round_to(silu * up, dt, FIX_BF16), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # (N, 2I) [gate | up] -> (N, I)
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = min(1024, next_pow2(inter))
    _silu_and_mul_kernel[(n, cdiv(inter, block))](  # fmt: skip
        x,
        out,
        x.stride(0),
        out.stride(0),
        inter,
        BLOCK=block,
        FIX_BF16=fix_bf16_rounding(x.dtype),
        **pdl_launch(x.device),
        num_warps=min(4, max(1, block // 256)),
    )
    return out
