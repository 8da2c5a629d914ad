"""Skinny linear layer in Triton: y = x @ W^T (+ bias) for a handful of rows (decode at small
batch), where the whole cost is reading W once.

cuBLAS picks tile shapes made for large M; at M = 1 on the H200 its kernels for Qwen3-0.6B's
projections with an output narrower than the input (o_proj, down_proj) read the weights at
0.3-1 TB/s (bench/results/linear_h200.md). Here every program owns
BLOCK_N output columns for all (at most 16) rows, streams its BLOCK_N weight rows through a
deep pipeline, and multiplies on the tensor cores with the rows padded to 16. When N alone gives
too few programs to keep every SM loading, K is split across programs too; their fp32 partial
sums are added by a second small kernel, which also rounds to the output dtype.

Contract: `skinny_linear(x, weight, bias)` equals `torch.nn.functional.linear(x, weight, bias)`
(fp32 accumulation, one rounding at the end) for x with at most MAX_ROWS rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import cdiv, fix_bf16_rounding, interpreting, mma, next_pow2, num_sms, round_to, upcast_dot

MAX_ROWS = 16  # one tensor-core tile of rows
DISPATCH_MAX_ROWS = 4  # where it beats cuBLAS on the H200 (bench/results/linear_h200.md)
PROGRAMS_PER_SM = 2


@triton.jit(do_not_specialize=["M", "k_chunk"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr,
    M, N, K, k_chunk,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, FIX_BF16: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = split * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_end
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_M, BLOCK_K)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # (BLOCK_N, BLOCK_K)
        acc += mma(x, tl.trans(w), "tf32", UPCAST)
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = round_to(acc, out_ptr.dtype.element_ty, FIX_BF16)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])
    else:
        part = part_ptr + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M", "num_splits"])
def _sum_splits_kernel(
    part_ptr, b_ptr, out_ptr, M, N, num_splits, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, FIX_BF16: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, round_to(acc, out_ptr.dtype.element_ty, FIX_BF16), mask=mask)


def pick_split_k(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """Split K so that the grid has about PROGRAMS_PER_SM programs per SM, each with at least
    two BLOCK_K steps of K (shorter chunks only add partial sums)."""
    programs = cdiv(n, block_n)
    want = max(1, round(PROGRAMS_PER_SM * sms / programs))
    return max(1, min(want, k // (2 * block_k)))


def skinny_linear(
    x: torch.Tensor,  # (M, K), M <= MAX_ROWS, unit stride along K
    weight: torch.Tensor,  # (N, K), unit stride along K
    bias: torch.Tensor | None = None,  # (N,)
    split_k: int | None = None,
) -> torch.Tensor:  # (M, N), dtype of x
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k, (x.shape, weight.shape)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k = (16, 32) if interpreting() else (16, 256)
    if split_k is None:
        split_k = pick_split_k(n, k, block_n, block_k, num_sms(x.device))
    k_chunk = cdiv(cdiv(k, split_k), block_k) * block_k
    split_k = cdiv(k, k_chunk)
    direct = split_k == 1
    part = out if direct else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    has_bias = bias is not None
    fix = fix_bf16_rounding(x.dtype)
    _skinny_kernel[(cdiv(n, block_n), split_k)](
        x, weight, bias if has_bias else weight, out, part,
        m, n, k, k_chunk,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=has_bias, DIRECT=direct,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=upcast_dot(x.dtype), FIX_BF16=fix,
        num_warps=4, num_stages=1 if interpreting() else 4,
    )  # fmt: skip
    if not direct:
        block = 1024
        _sum_splits_kernel[(cdiv(n, block), m)](
            part, bias if has_bias else part, out, m, n, split_k, out.stride(0),
            HAS_BIAS=has_bias, BLOCK=block, FIX_BF16=fix, num_warps=4,
        )  # fmt: skip
    return out


# ---- gemv: one to four rows, no tensor cores, no second launch ----

GEMV_MAX_ROWS = 4
GEMV_WARPS = 8
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
):  # fmt: skip
    """Program i: outputs [i * BLOCK_N, (i + 1) * BLOCK_N) of all rows, over the whole of K
    in steps of BLOCK_K (K is a compile-time constant; the loop is unrolled). At one row the
    launcher makes BLOCK_K cover all of K, so the program's weight loads are one tile, issued
    together: at batch 1 the time is the latency of one round of loads, not of several.

    The input row is x, or silu(gate) * up of x's halves (SILU_MUL), or RMSNorm(x + residual)
    (NORM; every program normalises the few rows itself, they sit in L2, and program 0 writes
    the new residual). Each is rounded where the separate kernels round."""
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
    rstd = tl.zeros([ROWS], tl.float32)
    if NORM:  # first pass over the rows: their sums of squares
        for k0 in tl.static_range(0, K, BLOCK_K):
            k = k0 + offs_k
            for r in tl.static_range(ROWS):
                h = _norm_input(x_ptr + r * stride_xm + k, res_ptr + r * stride_rm + k, (k < K) & (r < M), HAS_RESIDUAL, dt, FIX_BF16)
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
            xm = k_mask & (r < M)
            if SILU_MUL:  # x is [gate | up] (M, 2K): the input is silu(gate) * up, rounded as torch does
                gate = tl.load(x_row, mask=xm, other=0.0).to(tl.float32)
                up = tl.load(x_row + K, mask=xm, other=0.0).to(tl.float32)
                silu = round_to(gate / (1.0 + tl.exp(-gate)), dt, FIX_BF16).to(tl.float32)
                x = round_to(silu * up, dt, FIX_BF16).to(tl.float32)
            elif NORM:  # as kernels.triton_fused.rms_norm: round(round(h * rstd) * weight)
                h = _norm_input(x_row, res_ptr + r * stride_rm + k, xm, HAS_RESIDUAL, dt, FIX_BF16)
                if HAS_RESIDUAL:
                    tl.store(new_res_ptr + r * stride_nrm + k, h.to(dt), mask=xm & (pid == 0))
                row_rstd = tl.sum(tl.where(offs_m == r, rstd, 0.0), axis=0)
                normed = round_to(h * row_rstd, dt, FIX_BF16).to(tl.float32)
                x = round_to(tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32) * normed, dt, FIX_BF16).to(tl.float32)
            else:
                x = tl.load(x_row, mask=xm, other=0.0).to(tl.float32)  # (BLOCK_K,)
            part = tl.sum(w * x[None, :], axis=1)  # (BLOCK_N,)
            acc += tl.where(offs_m[:, None] == r, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], round_to(acc, dt, FIX_BF16),
             mask=m_mask[:, None] & n_mask[None, :])


def gemv_block_n(n: int, sms: int) -> int:
    """Output columns per program: the largest power of two up to 16 that still gives every
    SM a program (Qwen3-0.6B on 132 SMs: o_proj and down_proj 4 -> 256 programs; q|k|v 16 ->
    256; gate|up 16 -> 384)."""
    block = 16
    while block > 1 and n // block < sms:
        block //= 2
    return block


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
    itself without a residual), as kernels.triton_fused.rms_norm followed by gemv: the
    decoder layer's input and post-attention norms at decode batch sizes."""
    assert x.shape[1] == weight.shape[1] == norm_weight.shape[0] and x.stride(-1) == 1
    assert norm_weight.dtype == x.dtype, "the fused norm rounds its product to the activation dtype"
    if residual is None:
        return _launch_gemv(x, weight, bias, norm=(norm_weight, eps, None, None)), x
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    return _launch_gemv(x, weight, bias, norm=(norm_weight, eps, residual, new_residual)), new_residual


def _launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False, norm=None) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    assert m <= GEMV_MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.shape, x.stride(), weight.stride())
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    rows = next_pow2(m)
    block_n = gemv_block_n(n, num_sms(x.device))
    # One step over the whole of K where it fits in GEMV_ELEMS_PER_THREAD (one row of
    # Qwen3-0.6B's projections: all of them), so that every weight load is issued at once.
    step = GEMV_ELEMS_PER_THREAD * 32 * GEMV_WARPS // block_n
    block_k = max(16, min(next_pow2(k), 64 if interpreting() else step))
    norm_weight, eps, residual, new_residual = norm if norm is not None else (x, 0.0, None, None)
    has_residual = residual is not None
    residual = residual if has_residual else x
    new_residual = new_residual if has_residual else x
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out,
        residual, norm_weight, new_residual, eps,
        m, n, x.stride(0), weight.stride(0), out.stride(0), residual.stride(0), new_residual.stride(0),
        K=k, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None, HAS_RESIDUAL=has_residual,
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, FIX_BF16=fix_bf16_rounding(x.dtype),
        num_warps=GEMV_WARPS,
    )  # fmt: skip
    return out


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The decode projections at batch 1 to 4: 16-bit x of at most GEMV_MAX_ROWS rows with
    unit strides (any N up to 32768; the vocabulary-sized logits product stays with cuBLAS).
    fp32 (exact tests), prefill and larger batches keep cuBLAS."""
    n, _ = weight.shape
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and n <= 32768
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def use_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where the Triton path wins, measured on the H200 in CUDA graphs: 16-bit inputs of at
    most DISPATCH_MAX_ROWS rows into an output narrower than the input (Qwen3-0.6B's o_proj:
    5.1 vs 12.4 us at one row; down_proj 5.7 vs 6.1 us). cuBLAS keeps the wide ones (q|k|v,
    gate|up, the logits: 3.7-5.0 us and 78 us, at 55-95 % of the copy bandwidth), fp32 (exact
    tests), prefill and larger batches."""
    n, k = weight.shape
    return (
        x.dim() == 2
        and x.shape[0] <= DISPATCH_MAX_ROWS
        and n < k
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )
