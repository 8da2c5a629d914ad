"""The skinny linear kernel (kernels.triton_linear) against F.linear: a few rows, any N and K
(partial tiles), with and without bias, with K split across programs or not, strided rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.reference import rms_norm_ref, silu_and_mul_ref
from kernels.triton_linear import (
    DISPATCH_MAX_ROWS,
    GEMV_MAX_ROWS,
    gemv,
    gemv_block_n,
    pick_split_k,
    rms_norm_gemv,
    skinny_linear,
    use_gemv,
    use_skinny,
)

DTYPES = [torch.bfloat16, torch.float16]


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32 accumulation in another order, rounded once: equal but for one-ulp ties."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(ref.dtype).eps
    bound = eps * torch.maximum(out.float().abs(), ref.float().abs()).clamp(min=2**-6)
    assert ((out.float() - ref.float()).abs() <= bound).all()
    assert (out != ref).float().mean() < 0.05


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 100, 300), (16, 33, 96), (2, 16, 8)])
@pytest.mark.parametrize("split_k", [None, 1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(device, dtype, m, n, k, split_k, bias):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn((m, k), generator=gen).to(device, dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn((n,), generator=gen).to(device, dtype) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    check(skinny_linear(x, w, b, split_k=split_k), ref)


def test_skinny_linear_strided_rows_and_empty(device):
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn((4, 80), generator=gen).to(device, torch.bfloat16)
    x = wide[:, 8:72]  # rows 80 apart
    w = torch.randn((24, 64), generator=gen).to(device, torch.bfloat16)
    check(skinny_linear(x, w), F.linear(x.float(), w.float()).to(torch.bfloat16))
    assert skinny_linear(x[:0], w).shape == (0, 24)


def test_dispatch_rule():
    narrow, wide = torch.zeros((4, 8), dtype=torch.bfloat16), torch.zeros((16, 8), dtype=torch.bfloat16)
    x = torch.zeros((DISPATCH_MAX_ROWS, 8), dtype=torch.bfloat16)
    assert use_skinny(x, narrow)
    assert not use_skinny(x, wide)  # cuBLAS is at the bandwidth roof there
    assert not use_skinny(torch.zeros((DISPATCH_MAX_ROWS + 1, 8), dtype=torch.bfloat16), narrow)
    assert not use_skinny(x.float(), narrow.float())  # fp32 stays exact with cuBLAS
    # Qwen3-0.6B on 132 SMs: q|k|v and gate|up have enough columns; o_proj and down split K
    assert pick_split_k(4096, 1024, 16, 256, 132) == 1
    assert pick_split_k(1024, 2048, 16, 256, 132) == 4
    assert pick_split_k(1024, 512, 16, 256, 132) == 1  # capped: at least 2 K steps per chunk
    assert pick_split_k(1024, 3072, 16, 256, 132) == 4


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
    x = torch.zeros((GEMV_MAX_ROWS, 8), dtype=torch.bfloat16)
    w = torch.zeros((16, 8), dtype=torch.bfloat16)
    assert use_gemv(x, w) and use_gemv(x[:1], w)
    assert not use_gemv(torch.zeros((GEMV_MAX_ROWS + 1, 8), dtype=torch.bfloat16), w)  # cuBLAS from 5 rows
    assert not use_gemv(x.float(), w.float())  # fp32 stays exact with cuBLAS
    assert not use_gemv(x, torch.zeros((151936, 8), dtype=torch.bfloat16))  # the logits product: cuBLAS
    # Qwen3-0.6B on 132 SMs: every SM gets a program
    assert gemv_block_n(1024, 132) == 4 and gemv_block_n(4096, 132) == 16 and gemv_block_n(6144, 132) == 16
    assert gemv_block_n(40, 132) == 1


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
