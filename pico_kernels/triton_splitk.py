"""Projections of tens of rows into a narrow output, split along K: o_proj and down_proj at
decode batches of 33-64 (Qwen3-0.6B: 1,024 outputs from 2,048 and 3,072 inputs).

With 64-row tiles such a product has few output tiles (32 at 32 columns a tile), so a kernel
that gives each tile all of K keeps a quarter of the H200's SMs busy and walks K in a long
chain of dependent loads, and cuBLAS takes several times what the bytes need (bench/NOTES.md,
"Figures behind the code's choices"). Here each program takes one output tile over a slice
of K (a grid of tiles x SPLIT), writes its fp32 partial sums to a workspace and takes a
ticket; the tile's last program to arrive adds the SPLIT partials in slice order (so the
result does not depend on who arrives last), rounds once and stores the tile, then puts the
ticket counter back to zero for the next launch. One launch, no memset, no second kernel. The
tickets are the decode kernel's arrival counters (pico_kernels.triton_decode.arrival_counters):
every launch of either leaves them at zero.

The same kernel carries a decoder layer's deferred norms (model_svc.models.llama,
LlamaDecoderLayer.forward_deferred): `splitk_add_residual` adds o_proj's or down_proj's output
to the residual stream in its epilogue and leaves the new rows' sums of squares, one part per
output tile; `splitk_linear(..., row_sums=...)` (q|k|v, in one slice: a wide output has tiles
enough) scales its rows by the RMSNorm factor those sums give, the norm's weight folded into
W. A layer then launches no norm.

Contract: `splitk_linear(x, weight, bias)` equals `torch.nn.functional.linear(x, weight,
bias)` up to the order of the fp32 sum (one rounding at the end), for up to 64 rows.
Launches that share a device's counters must not run concurrently (one stream, as the model
runs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pico_kernels.triton_common import (
    cdiv,
    dot_precision,
    fix_bf16_rounding,
    interpreting,
    mma,
    next_pow2,
    pdl_launch,
    pdl_prologue,
    round_to,
    row_rstd,
    upcast_dot,
)
from pico_kernels.triton_decode import arrival_counters

SPLITK_ROWS = (33, 64)  # the row counts it takes (see use_splitk_linear)


@triton.jit
def _workspace_tile(ws_ptr, s, pid_n, num_tiles, offs_m, offs_c, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pointers to slice s's partial sums of output tile pid_n: (BLOCK_M, BLOCK_N), fp32."""
    base = ws_ptr + (s * num_tiles + pid_n).to(tl.int64) * (BLOCK_M * BLOCK_N)
    return base + offs_m[:, None] * BLOCK_N + offs_c[None, :]


@triton.jit
def _store_tile(total, rstd, resid, b_ptr, out_ptr, sums_out_ptr, pid_n, num_tiles,
                offs_m, offs_n, m_mask, n_mask, stride_om, HAS_BIAS: tl.constexpr,
                ROW_SCALE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, FIX_BF16: tl.constexpr):  # fmt: skip
    """An output tile's fp32 sums, scaled by its rows' RMSNorm factors rstd (ROW_SCALE), + bias,
    rounded once, stored; with ADD_RESIDUAL added to resid (out's tile as it was, the residual;
    rounded as the fused norm's residual add rounds) and the new rows' sums of squares over the
    tile's columns stored as part pid_n of each row."""
    if ROW_SCALE:
        total *= rstd[:, None]
    if HAS_BIAS:
        total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    dt = out_ptr.dtype.element_ty
    out = round_to(total, dt, FIX_BF16)
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RESIDUAL:
        out = round_to(out.to(tl.float32) + resid.to(tl.float32), dt, FIX_BF16)
        h = tl.where(mask, out.to(tl.float32), 0.0)
        tl.store(sums_out_ptr + offs_m * num_tiles + pid_n, tl.sum(h * h, axis=1), mask=m_mask)
    tl.store(ptrs, out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _splitk_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, ws_ptr, tickets_ptr, sums_in_ptr, sums_out_ptr,
    M, stride_xm, stride_wn, stride_om, num_sums_in, eps,
    N: tl.constexpr, K: tl.constexpr, SPLIT: tl.constexpr, K_SLICE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROW_SCALE: tl.constexpr, SUMS_PARTS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FIX_BF16: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (i, s): output columns [i * BLOCK_N, (i + 1) * BLOCK_N) of every row, summed
    over inputs [s * K_SLICE, (s + 1) * K_SLICE) on tensor cores."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    num_tiles = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_N)
    offs_n = pid_n * BLOCK_N + offs_c
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn  # W^T tiles: (BLOCK_K, BLOCK_N)
    if ROW_SCALE:  # loaded before the K loop, which hides the load
        rstd = row_rstd(sums_in_ptr, offs_m, m_mask, num_sums_in, K, eps, SUMS_PARTS)
    else:
        rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
    if ADD_RESIDUAL:  # likewise; only this tile's last program writes the tile, after its loads
        resid = tl.load(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0
        )
    else:
        resid = tl.zeros((BLOCK_M, BLOCK_N), out_ptr.dtype.element_ty)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # Whole tiles (Qwen3-0.6B's o and down) load without masks, which the pipeliner needs to
    # keep several weight tiles in flight.
    EVEN: tl.constexpr = (K_SLICE % BLOCK_K == 0) and (K_SLICE * SPLIT == K) and (N % BLOCK_N == 0)
    k_begin = pid_s * K_SLICE
    for k0 in range(0, K_SLICE, BLOCK_K):
        k = k_begin + k0 + offs_k
        if EVEN:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_cols + k[:, None])
        else:
            k_mask = (k < K) & (k0 + offs_k < K_SLICE)
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
            )
            w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc) if not UPCAST else acc + mma(x, w, PRECISION, UPCAST)
    if SPLIT == 1:
        _store_tile(acc, rstd, resid, b_ptr, out_ptr, sums_out_ptr, pid_n, num_tiles,
                    offs_m, offs_n, m_mask, n_mask, stride_om, HAS_BIAS, ROW_SCALE, ADD_RESIDUAL, FIX_BF16)  # fmt: skip
    else:
        tl.store(_workspace_tile(ws_ptr, pid_s, pid_n, num_tiles, offs_m, offs_c, BLOCK_M, BLOCK_N), acc)
        tl.debug_barrier()  # every thread's partials are written before the ticket (a release) is taken
        ticket = tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:  # the last of the tile's slices: the others' partials are visible
            tl.store(tickets_ptr + pid_n, 0)  # ready for the next launch
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s in tl.static_range(SPLIT):  # in slice order, whoever arrives last
                total += tl.load(_workspace_tile(ws_ptr, s, pid_n, num_tiles, offs_m, offs_c, BLOCK_M, BLOCK_N),
                                 cache_modifier=".cg")  # fmt: skip
            _store_tile(total, rstd, resid, b_ptr, out_ptr, sums_out_ptr, pid_n, num_tiles, offs_m, offs_n,
                        m_mask, n_mask, stride_om, HAS_BIAS, ROW_SCALE, ADD_RESIDUAL, FIX_BF16)  # fmt: skip


class SplitKConfig(NamedTuple):
    block_n: int  # output columns a tile
    split: int  # K slices
    block_k: int  # K a step
    num_stages: int
    num_warps: int


def splitk_config(m: int, n: int, k: int) -> SplitKConfig:
    """On the GPU, outputs narrower than the input (o_proj, down_proj): 32-column tiles, K in 4
    slices (Qwen3-0.6B's 1,024 outputs: 128 programs), 128-deep steps, the best of the tilings
    measured; six or eight slices, or 64-column tiles, were slower. Wider outputs (q|k|v with
    the deferred norm): one slice, 32-column tiles, 256-deep steps, four stages, level with
    cuBLAS and faster than cuBLAS plus the RMSNorm launch before it; more slices were slower.
    The measurements: bench/NOTES.md, "Figures behind the code's choices"."""
    if n >= k:
        return SplitKConfig(32, 1, 256, 4, 4)
    return SplitKConfig(32, max(1, min(4, k // 256)), 128, 4, 4)


def splitk_linear(
    x: torch.Tensor,  # (M, K), M <= 64
    weight: torch.Tensor,  # (N, K)
    bias: torch.Tensor | None = None,  # (N,)
    split: int | None = None,  # K slices (default: splitk_config's)
    block_n: int | None = None,
    row_sums: torch.Tensor | None = None,  # (M, P) fp32: x's rows' sums of squares in P parts
    eps: float = 0.0,
) -> torch.Tensor:  # (M, N), dtype of x
    """x @ W^T (+ bias) for up to 64 16-bit rows, in one launch of output tiles x K slices.

    With row_sums, x is the residual stream before an RMSNorm whose weight is folded into W
    (model_svc.models.llama.LlamaModel.fold_norm_weights): the product's rows are scaled by
    1 / sqrt(sum(row_sums) / K + eps) before the bias, so the result is the projection of the
    normalised rows without a launch for the norm (the deferred norm)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, split, block_n, row_sums, eps)
    return out


def splitk_add_residual(
    x: torch.Tensor,  # (M, K), M <= 64
    weight: torch.Tensor,  # (N, K)
    residual: torch.Tensor,  # (M, N), dtype of x, unit stride along N: updated in place
    bias: torch.Tensor | None = None,
    split: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # (M, tiles) fp32
    """residual += x @ W^T (+ bias), in place, each value rounded as the projection's output
    and then as the fused norm's residual add (pico_kernels.triton_fused.rms_norm). Returns the new
    residual rows' sums of squares, one part per output tile: the row_sums of the next
    projection, which then normalises in its epilogue instead of a norm launch in between."""
    assert residual.shape == (x.shape[0], weight.shape[0]) and residual.dtype == x.dtype and residual.stride(-1) == 1, (
        residual.shape,
        residual.dtype,
    )
    sums = _launch(x, weight, bias, residual, split, block_n, None, 0.0, add_residual=True)
    assert sums is not None, "add_residual returns them"
    return sums


def _tiling(m: int, n: int, k: int, split: int | None, block_n: int | None) -> tuple[SplitKConfig, int]:
    """The launch's config (block_n and split as given, else splitk_config's; split then the
    slices there are) and its K_SLICE."""
    cfg = splitk_config(m, n, k)
    if interpreting():  # programs run one after another there: small tiles, the same math
        cfg = cfg._replace(block_n=16, block_k=32, num_stages=1)
    k_slice = cdiv(cdiv(k, split or cfg.split), cfg.block_k) * cfg.block_k
    return cfg._replace(block_n=block_n or cfg.block_n, split=cdiv(k, k_slice)), k_slice


def _launch(x, weight, bias, out, split, block_n, row_sums, eps, add_residual: bool = False) -> torch.Tensor | None:
    """One launch into out (with add_residual: added to it); returns the new rows' sums of
    squares (M, tiles) with add_residual, else None."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.shape, weight.shape)
    assert m <= 64, m
    if row_sums is not None:
        assert row_sums.shape[0] == m and row_sums.dtype == torch.float32 and row_sums.is_contiguous(), row_sums.shape
    cfg, k_slice = _tiling(m, n, k, split, block_n)
    block_n, split = cfg.block_n, cfg.split
    tiles = cdiv(n, block_n)
    sums_out = torch.empty((m, tiles), dtype=torch.float32, device=x.device) if add_residual else None
    if m == 0:
        return sums_out
    block_m = max(16, next_pow2(m))
    workspace = torch.empty(
        (split, tiles, block_m, block_n) if split > 1 else (1,), dtype=torch.float32, device=x.device
    )
    num_sums_in = row_sums.shape[1] if row_sums is not None else 1
    _splitk_linear_kernel[(tiles, split)](
        x, weight, bias if bias is not None else weight, out, workspace, arrival_counters(x.device, tiles),
        row_sums if row_sums is not None else workspace, sums_out if sums_out is not None else workspace,
        m, x.stride(0), weight.stride(0), out.stride(0), num_sums_in, eps,
        N=n, K=k, SPLIT=split, K_SLICE=k_slice, HAS_BIAS=bias is not None,
        ROW_SCALE=row_sums is not None, SUMS_PARTS=next_pow2(num_sums_in), ADD_RESIDUAL=add_residual,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        FIX_BF16=fix_bf16_rounding(x.dtype), PRECISION=dot_precision(x.dtype), UPCAST=upcast_dot(x.dtype),
        **pdl_launch(x.device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return sums_out


def use_splitk_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Where splitk_linear replaces cuBLAS: 16-bit rows, SPLITK_ROWS of them, into an output
    narrower than the input (o_proj, down_proj), contiguous weights."""
    lo, hi = SPLITK_ROWS
    n, k = weight.shape
    return (
        x.dim() == 2
        and lo <= x.shape[0] <= hi
        and n < k
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )
