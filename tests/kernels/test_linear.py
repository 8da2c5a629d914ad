"""The small-batch projections (pico_kernels.triton_linear) against F.linear: one to four rows, any
N and K (partial tiles), with and without bias, strided rows, and the fused SiLU-and-mul and
RMSNorm inputs against their separate kernels; the gate|up projection with SiLU-and-mul in its
epilogue against the two separate steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pico_kernels.reference import rms_norm_ref, silu_and_mul_ref
from pico_kernels.triton_linear import (
    GEMV_MAX_ROWS,
    gemv,
    gemv_shape,
    rms_norm_gemv,
    silu_mul_linear,
    use_gemv,
    use_silu_mul_linear,
)

DTYPES = [torch.bfloat16, torch.float16]


def check(out: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    """fp32 accumulation in another order, rounded once: equal but for one-ulp ties (`ulps`
    where the rounded value feeds a further product)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(ref.dtype).eps
    bound = ulps * eps * torch.maximum(out.float().abs(), ref.float().abs()).clamp(min=2**-6)
    assert ((out.float() - ref.float()).abs() <= bound).all()
    assert (out != ref).float().mean() < 0.05


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 100, 300), (4, 33, 96), (2, 16, 8), (1, 300, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(device, dtype, m, n, k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn((m, k), generator=gen).to(device, dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn((n,), generator=gen).to(device, dtype) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    check(gemv(x, w, b), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (4, 24, 96), (2, 70, 200)])
def test_gemv_silu_mul_is_silu_and_mul_then_linear(device, dtype, m, n, k):
    """down_proj(SiluAndMul(gate_up)) in one launch: the activation is rounded as the separate
    op rounds it, so the result is the two-step result up to the sum's order."""
    gen = torch.Generator().manual_seed(n + k)
    gate_up = torch.randn((m, 2 * k), generator=gen).to(device, dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(device, dtype)
    act = silu_and_mul_ref(gate_up)
    check(gemv(gate_up, w, silu_mul=True), F.linear(act.float(), w.float()).to(dtype))


def test_gemv_strided_rows_poisoned_output_and_empty(device):
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn((3, 96), generator=gen).to(device, torch.bfloat16)
    x = wide[:, 16:80]  # rows 96 apart
    w = torch.randn((40, 64), generator=gen).to(device, torch.bfloat16)
    out = gemv(x, w)
    assert torch.isfinite(out.float()).all()  # every output written (torch.empty may hold NaN)
    check(out, F.linear(x.float(), w.float()).to(torch.bfloat16))
    assert gemv(x[:0], w).shape == (0, 40)
    with pytest.raises(AssertionError):
        gemv(torch.zeros((GEMV_MAX_ROWS + 1, 64), dtype=torch.bfloat16, device=device), w)


def test_gemv_dispatch_and_tiling():
    narrow, wide = torch.zeros((16, 32), dtype=torch.bfloat16), torch.zeros((64, 32), dtype=torch.bfloat16)
    one, four = torch.zeros((1, 32), dtype=torch.bfloat16), torch.zeros((GEMV_MAX_ROWS, 32), dtype=torch.bfloat16)
    assert use_gemv(one, narrow) and use_gemv(one, wide)  # one row: every projection
    assert use_gemv(four, narrow)  # up to four rows into a narrower output (o_proj, down_proj)
    assert not use_gemv(four, wide)  # cuBLAS is faster for q|k|v and gate|up from two rows
    assert not use_gemv(torch.zeros((GEMV_MAX_ROWS + 1, 32), dtype=torch.bfloat16), narrow)
    assert not use_gemv(one.float(), narrow.float())  # fp32 stays exact with cuBLAS
    assert not use_gemv(one, torch.zeros((151936, 32), dtype=torch.bfloat16))  # the logits product: cuBLAS
    # Qwen3-0.6B on 132 SMs: every SM gets a program; the narrowing o_proj and down_proj 2
    # columns a program on 4 warps
    assert gemv_shape(4096, 1024, 132) == (16, 8) and gemv_shape(6144, 1024, 132) == (16, 8)
    assert gemv_shape(1024, 2048, 132) == (2, 4) and gemv_shape(1024, 3072, 132) == (2, 4)
    assert gemv_shape(40, 64, 132) == (1, 4) and gemv_shape(40, 32, 132) == (1, 8)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 33, 96)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gemv_is_norm_then_linear(device, dtype, m, n, k, with_residual):
    """linear(RMSNorm(x + residual)) and the new residual in one launch: the new residual is
    exactly the separate norm's, the output the two-step one up to the sum's order."""
    gen = torch.Generator().manual_seed(7 * m + n + k)
    wide = torch.randn((m, k + 8), generator=gen).to(device, dtype)
    x = wide[:, 8:]  # strided rows
    residual = torch.randn((m, k), generator=gen).to(device, dtype) if with_residual else None
    norm_w = (1 + 0.2 * torch.randn((k,), generator=gen)).to(device, dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn((n,), generator=gen).to(device, dtype)
    normed, new_residual = rms_norm_ref(x, norm_w, 1e-6, residual)
    out, got_residual = rms_norm_gemv(x, residual, norm_w, 1e-6, w, b)
    assert torch.equal(got_residual, new_residual)
    check(out, F.linear(normed.float(), w.float(), b.float()).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,inter,k", [(64, 48, 64), (33, 40, 80), (5, 16, 32)])
def test_silu_mul_linear_is_linear_then_silu_and_mul(device, dtype, m, inter, k):
    """Partial tiles in every dimension (40 of 16-column tiles, K = 80 in 32-deep steps, 33 or
    5 of 64 or 16 rows), strided input rows: gate and up rounded as the projection's output,
    then the activation as the separate op rounds it."""
    gen = torch.Generator().manual_seed(m + inter + k)
    wide = torch.randn((m, k + 8), generator=gen).to(device, dtype)
    x = wide[:, 8:]
    w = (torch.randn((2 * inter, k), generator=gen) / k**0.5).to(device, dtype)
    gate_up = F.linear(x.float(), w.float()).to(dtype)
    act = silu_and_mul_ref(gate_up)
    out = silu_mul_linear(x, w)
    assert torch.isfinite(out.float()).all()
    # A gate or up value one ulp off (another summation order) moves the product by about an
    # ulp of each factor: two ulps of the result.
    check(out, act, ulps=2)
    assert silu_mul_linear(x[:0], w).shape == (0, inter)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,inter,k,parts", [(64, 48, 64, 2), (33, 40, 80, 5)])
def test_silu_mul_linear_with_row_sums(device, dtype, m, inter, k, parts):
    """The deferred norm: with the input rows' sums of squares, gate and up are scaled by each
    row's RMSNorm factor before they are rounded (the norm's weight folded into W)."""
    gen = torch.Generator().manual_seed(m + inter + k + parts)
    x = (2 * torch.randn((m, k), generator=gen)).to(device, dtype)
    w = (torch.randn((2 * inter, k), generator=gen) / k**0.5).to(device, dtype)
    eps = 1e-6
    sums = torch.stack([piece.float().square().sum(1) for piece in x.tensor_split(parts, dim=1)], 1).contiguous()
    rstd = torch.rsqrt(x.float().square().mean(1) + eps)
    gate_up = ((x.float() @ w.float().t()) * rstd[:, None]).to(dtype)
    out = silu_mul_linear(x, w, row_sums=sums, eps=eps)
    check(out, silu_and_mul_ref(gate_up), ulps=2)


def test_silu_mul_linear_dispatch():
    w = torch.zeros((6144, 1024), dtype=torch.bfloat16)
    rows = lambda m, dtype=torch.bfloat16: torch.zeros((m, 1024), dtype=dtype)  # noqa: E731
    assert use_silu_mul_linear(rows(64), w) and use_silu_mul_linear(rows(33), w)
    assert not use_silu_mul_linear(rows(32), w) and not use_silu_mul_linear(rows(65), w)
    assert not use_silu_mul_linear(rows(64, torch.float32), w.float())  # fp32 keeps the exact path
    assert not use_silu_mul_linear(rows(64), w.t().contiguous().t())  # weight rows not contiguous
