"""Projections of a few rows in Triton (decode at small batch): y = x @ W^T (+ bias), where
the whole cost is reading W once.

cuBLAS picks tile shapes made for large M; at one row, with the weights coming from HBM as
they do in the model, its kernels for Qwen3-0.6B's projections read them far below the copy
bandwidth (bench/results/linear_h200.md). `gemv` gives each program
a few output columns over the whole of K, issues all of the program's weight loads at once,
and multiplies on the CUDA cores: at one row the time is one round of memory latency plus the
bytes, and no program waits on another (no split K, no second kernel). Two variants fold the
elementwise kernel before a projection into it: SiLU-and-mul before down_proj, and the
decoder layer's residual add + RMSNorm before q|k|v and gate|up (`rms_norm_gemv`).

At tens of rows `silu_mul_linear` is the MLP's gate|up projection on tensor cores with
SiLU-and-mul in its epilogue (a launch saved), and pico_kernels.triton_splitk's `splitk_linear`
(re-exported here, the model's one entry point) takes o_proj and down_proj, whose narrow
outputs leave cuBLAS few tiles.

Contract: `gemv(x, weight, bias)` equals `torch.nn.functional.linear(x, weight, bias)` (fp32
accumulation, one rounding at the end) for one to GEMV_MAX_ROWS rows; the fused variants equal
pico_kernels.triton_fused's kernel followed by it. `silu_mul_linear(x, weight)` equals
pico_kernels.triton_fused.silu_and_mul(linear(x, weight)) the same way, for up to 64 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pico_kernels.triton_common import (
    cdiv,
    dot_precision,
    fix_bf16_rounding,
    interpreting,
    mask_and,
    mma,
    next_pow2,
    num_sms,
    pdl_launch,
    pdl_prologue,
    round_to,
    row_rstd,
    upcast_dot,
)
from pico_kernels.triton_splitk import SPLITK_ROWS, splitk_add_residual, splitk_linear, use_splitk_linear  # noqa: F401  (the module is the model's entry point)

GEMV_MAX_ROWS = 4
GEMV_ELEMS_PER_THREAD = 64  # weight elements each thread loads per step (32 registers of bf16 pairs)


@triton.jit
def _norm_input(x_row, res_row, mask, HAS_RESIDUAL: tl.constexpr, dt: tl.constexpr, FIX_BF16: tl.constexpr):
    """x (+ residual) of one row chunk, rounded to dt as the residual add rounds, in fp32."""
    h = tl.load(x_row, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        h = round_to(h.to(tl.float32) + tl.load(res_row, mask=mask, other=0.0).to(tl.float32), dt, FIX_BF16)
    return h.to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    res_ptr, nw_ptr, new_res_ptr, eps,
    M, N, stride_xm, stride_wn, stride_om, stride_rm, stride_nrm,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FIX_BF16: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program i: outputs [i * BLOCK_N, (i + 1) * BLOCK_N) of all rows, over the whole of K
    in steps of BLOCK_K (K is a compile-time constant; the loop is unrolled). At one row the
    launcher makes BLOCK_K cover all of K, so the program's weight loads are one tile, issued
    together: at batch 1 the time is the latency of one round of loads, not of several.

    The input row is x, or silu(gate) * up of x's halves (SILU_MUL), or RMSNorm(x + residual)
    (NORM; every program normalises the few rows itself, they sit in L2, and program 0 writes
    the new residual). Each is rounded where the separate kernels round. The first weight tile
    is requested before `pdl_prologue`: nothing writes weights, so under PDL they stream in
    while the kernel ahead (which wrote x) finishes."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, ROWS)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    dt = out_ptr.dtype.element_ty
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # (BLOCK_N, 1)
    # the first weight tile (at one row: all of it) is requested before anything else
    w_first = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_prologue(PDL)
    rstd = tl.zeros([ROWS], tl.float32)
    if NORM:  # first pass over the rows: their sums of squares
        for k0 in tl.static_range(0, K, BLOCK_K):
            k = k0 + offs_k
            for r in tl.static_range(ROWS):
                h = _norm_input(
                    x_ptr + r * stride_xm + k,
                    res_ptr + r * stride_rm + k,
                    mask_and(k < K, r < M),
                    HAS_RESIDUAL,
                    dt,
                    FIX_BF16,
                )
                rstd += tl.where(offs_m == r, tl.sum(h * h, axis=0), 0.0)
        rstd = tl.rsqrt(rstd / K + eps)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        if k0 == 0:
            w = w_first.to(tl.float32)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        for r in tl.static_range(ROWS):  # one row at a time: the weight tile is shared
            x_row = x_ptr + r * stride_xm + k
            xm = mask_and(k_mask, r < M)
            if SILU_MUL:  # x is [gate | up] (M, 2K): the input is silu(gate) * up, rounded as torch does
                gate = tl.load(x_row, mask=xm, other=0.0).to(tl.float32)
                up = tl.load(x_row + K, mask=xm, other=0.0).to(tl.float32)
                silu = round_to(gate / (1.0 + tl.exp(-gate)), dt, FIX_BF16).to(tl.float32)
                x = round_to(silu * up, dt, FIX_BF16).to(tl.float32)
            elif NORM:  # as pico_kernels.triton_fused.rms_norm: round(round(h * rstd) * weight)
                h = _norm_input(x_row, res_ptr + r * stride_rm + k, xm, HAS_RESIDUAL, dt, FIX_BF16)
                if HAS_RESIDUAL:
                    tl.store(new_res_ptr + r * stride_nrm + k, h.to(dt), mask=mask_and(xm, pid == 0))
                this_rstd = tl.sum(tl.where(offs_m == r, rstd, 0.0), axis=0)
                normed = round_to(h * this_rstd, dt, FIX_BF16).to(tl.float32)
                x = round_to(tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32) * normed, dt, FIX_BF16).to(
                    tl.float32
                )
            else:
                x = tl.load(x_row, mask=xm, other=0.0).to(tl.float32)  # (BLOCK_K,)
            part = tl.sum(w * x[None, :], axis=1)  # (BLOCK_N,)
            acc += tl.where(offs_m[:, None] == r, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        round_to(acc, dt, FIX_BF16),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def gemv_shape(n: int, k: int, sms: int) -> tuple[int, int]:
    """(output columns per program, warps): the largest power of two up to 16 columns that
    still gives every SM a program, 8 warps (Qwen3-0.6B on 132 SMs: q|k|v 16 -> 256 programs,
    gate|up 16 -> 384); into a narrower output (n < k: o_proj, down_proj) at most 2 columns
    and 4 warps (512 programs). The latter against 4 columns and 8 warps: 0.810 -> 0.797-0.801
    ms a token at batch 1 (bench/NOTES.md, "Batch-1 decode: the weights before the wait,
    small attention programs")."""
    block = 16
    while block > 1 and n // block < sms:
        block //= 2
    return (min(block, 2), 4) if n < k else (block, 8)


def gemv(
    x: torch.Tensor,  # (M, K), or (M, 2K) [gate | up] with silu_mul; M <= GEMV_MAX_ROWS
    weight: torch.Tensor,  # (N, K), unit stride along K
    bias: torch.Tensor | None = None,  # (N,)
    silu_mul: bool = False,  # the input is silu(gate) * up of x's two halves (the MLP's down_proj)
) -> torch.Tensor:  # (M, N), dtype of x
    """x @ W^T (+ bias) for one to four 16-bit rows; with silu_mul, SiluAndMul is applied to x
    on the fly (one launch instead of two)."""
    k = weight.shape[1]
    assert x.shape[1] == (2 * k if silu_mul else k), (x.shape, weight.shape, silu_mul)
    return _launch_gemv(x, weight, bias, silu_mul=silu_mul)


def rms_norm_gemv(
    x: torch.Tensor,  # (M, K), M <= GEMV_MAX_ROWS
    residual: torch.Tensor | None,  # (M, K), dtype of x
    norm_weight: torch.Tensor,  # (K,)
    eps: float,
    weight: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (M, N) output, (M, K) new residual
    """linear(RMSNorm(x + residual)) in one launch, with the new residual x + residual (x
    itself without a residual), as pico_kernels.triton_fused.rms_norm followed by gemv: the
    decoder layer's input and post-attention norms at decode batch sizes."""
    assert x.shape[1] == weight.shape[1] == norm_weight.shape[0] and x.stride(-1) == 1
    assert norm_weight.dtype == x.dtype, "the fused norm rounds its product to the activation dtype"
    new_residual = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = _launch_gemv(x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, new_residual=new_residual)
    return out, x if new_residual is None else new_residual


def _launch_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul: bool = False,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,  # a norm weight: NORM mode
    residual: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    assert m <= GEMV_MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.shape, x.stride(), weight.stride())
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    rows = next_pow2(m)
    # The interpreter runs programs one after another: few wide ones (the math is the same).
    block_n, warps = (32, 8) if interpreting() else gemv_shape(n, k, num_sms(x.device))
    # One step over the whole of K where it fits in GEMV_ELEMS_PER_THREAD (one row of
    # Qwen3-0.6B's projections: all of them), so that every weight load is issued at once.
    step = GEMV_ELEMS_PER_THREAD * 32 * warps // block_n
    block_k = max(16, min(next_pow2(k), 64 if interpreting() else step))
    has_residual = residual is not None
    residual = residual if residual is not None else x  # unused by the kernel then
    new_residual = new_residual if new_residual is not None else x
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        residual, norm_weight if norm_weight is not None else x, new_residual, eps,
        m, n, x.stride(0), weight.stride(0), out.stride(0), residual.stride(0), new_residual.stride(0),
        K=k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm_weight is not None, HAS_RESIDUAL=has_residual,
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, FIX_BF16=fix_bf16_rounding(x.dtype),
        **pdl_launch(x.device),
        num_warps=warps,
    )  # fmt: skip
    return out


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where gemv beats cuBLAS with weights from HBM (bench/results/linear_h200.md): every
    projection at one row, and the ones into a narrower output (o, down) up to GEMV_MAX_ROWS
    rows. cuBLAS keeps q|k|v and gate|up from two rows, outputs wider than
    32768 columns, fp32 (exact tests), prefill and larger batches."""
    m = x.shape[0] if x.dim() == 2 else 0
    n, k = weight.shape
    return (
        x.dim() == 2
        and (m == 1 or (m <= GEMV_MAX_ROWS and n < k))
        and n <= 32768
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


# ---------------------------------------------------------------------------------------------
# gate|up projection with SiLU-and-mul in its epilogue, for decode batches of tens of rows

SILU_MUL_LINEAR_ROWS = (33, 64)  # the row counts it takes (see use_silu_mul_linear)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_linear_kernel(
    x_ptr, w_ptr, out_ptr, sums_ptr, M, stride_xm, stride_wn, stride_om, num_sums, eps,
    INTER: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROW_SCALE: tl.constexpr, SUMS_PARTS: tl.constexpr,
    FIX_BF16: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program i: activation columns [i * BLOCK_N, (i + 1) * BLOCK_N) of every row, from the
    gate rows and the up rows of those columns (W is [gate | up], (2 INTER, K)): two tensor-core
    products over the same input tiles, then silu(gate) * up, each value rounded where the
    separate kernels round it (gate and up as the projection's output, the SiLU, the
    product). ROW_SCALE: the rows' RMSNorm factors scale both products first (the deferred
    norm, see pico_kernels.triton_splitk.splitk_linear)."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < INTER
    gate_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    if ROW_SCALE:  # loaded before the K loop, which hides the load
        rstd = row_rstd(sums_ptr, offs_m, m_mask, num_sums, K, eps, SUMS_PARTS)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # Whole tiles (Qwen3-0.6B: K 1,024, I 3,072) load without masks, which the pipeliner needs
    # to keep several weight tiles in flight.
    EVEN: tl.constexpr = (K % BLOCK_K == 0) and (INTER % BLOCK_N == 0)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
            gate = tl.load(gate_rows + k[:, None])
            up = tl.load(up_rows + k[:, None])
        else:
            k_mask = k < K
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            w_mask = k_mask[:, None] & n_mask[None, :]
            gate = tl.load(gate_rows + k[:, None], mask=w_mask, other=0.0)
            up = tl.load(up_rows + k[:, None], mask=w_mask, other=0.0)
        acc_gate = tl.dot(x, gate, acc_gate) if not UPCAST else acc_gate + mma(x, gate, PRECISION, UPCAST)
        acc_up = tl.dot(x, up, acc_up) if not UPCAST else acc_up + mma(x, up, PRECISION, UPCAST)
    if ROW_SCALE:
        acc_gate *= rstd[:, None]
        acc_up *= rstd[:, None]
    dt = out_ptr.dtype.element_ty
    gate = round_to(acc_gate, dt, FIX_BF16).to(tl.float32)
    up = round_to(acc_up, dt, FIX_BF16).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dt, FIX_BF16).to(tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
        round_to(silu * up, dt, FIX_BF16),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def silu_mul_linear(
    x: torch.Tensor,  # (M, K), M <= 64
    weight: torch.Tensor,  # (2I, K): the gate rows, then the up rows
    row_sums: torch.Tensor | None = None,  # (M, P) fp32: the deferred norm's sums (see splitk_linear)
    eps: float = 0.0,
) -> torch.Tensor:  # (M, I), dtype of x
    """SiluAndMul(x @ W^T) in one launch: the MLP's gate|up projection and its activation,
    without the (M, 2I) intermediate. Tiles: 64 rows, 32 activation columns (64 weight rows:
    96 programs for Qwen3-0.6B's 3,072), 128-deep steps, 5 stages: faster at 64 rows than
    cuBLAS and then the SiLU-and-mul kernel (bench/NOTES.md, "Figures behind the code's choices")."""
    two_i, k = weight.shape
    assert two_i % 2 == 0 and x.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.shape, weight.shape)
    m, inter = x.shape[0], two_i // 2
    assert m <= 64, m
    out = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if row_sums is not None:
        assert row_sums.shape[0] == m and row_sums.dtype == torch.float32 and row_sums.is_contiguous(), row_sums.shape
    num_sums = row_sums.shape[1] if row_sums is not None else 1
    interp = interpreting()
    block_n, block_k = (16, 32) if interp else (32, 128)
    _silu_mul_linear_kernel[(cdiv(inter, block_n),)](
        x, weight, out, row_sums if row_sums is not None else out, m, x.stride(0), weight.stride(0), out.stride(0),
        num_sums, eps,
        INTER=inter, K=k, BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        ROW_SCALE=row_sums is not None, SUMS_PARTS=next_pow2(num_sums),
        FIX_BF16=fix_bf16_rounding(x.dtype), PRECISION=dot_precision(x.dtype), UPCAST=upcast_dot(x.dtype),
        **pdl_launch(x.device),
        num_warps=4, num_stages=1 if interp else 5,
    )  # fmt: skip
    return out


def use_silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where silu_mul_linear replaces cuBLAS's gate|up and the separate activation: 16-bit
    rows, SILU_MUL_LINEAR_ROWS of them (measured at 64; fewer rows keep cuBLAS, whose tiles
    shrink with them), a contiguous weight."""
    lo, hi = SILU_MUL_LINEAR_ROWS
    return (
        x.dim() == 2
        and lo <= x.shape[0] <= hi
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and weight.shape[0] % 2 == 0
    )


def use_deferred_norms(x: torch.Tensor) -> bool:
    """Whether a decoder layer's rows take the deferred norms (splitk_linear's row_sums,
    splitk_add_residual, silu_mul_linear's row_sums): 16-bit rows, as many as both split-K and
    the fused gate|up take."""
    n = x.shape[0] if x.dim() == 2 else 0
    return (
        max(SPLITK_ROWS[0], SILU_MUL_LINEAR_ROWS[0]) <= n <= min(SPLITK_ROWS[1], SILU_MUL_LINEAR_ROWS[1])
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.is_contiguous()
    )
