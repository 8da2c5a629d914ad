"""The split-K projection (pico_kernels.triton_splitk) against F.linear: tiles and K slices that do
not divide the shapes, bias, strided rows; the same bits on every call whatever order the
slices finish in; the ticket counters left at zero; and where the model takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pico_kernels.reference import rms_norm_ref
from pico_kernels.triton_decode import arrival_counters
from pico_kernels.triton_splitk import splitk_add_residual, splitk_config, splitk_linear, use_splitk_linear
from tests.kernels.test_linear import DTYPES, check


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "m,n,k,split,bias",
    [
        (64, 48, 256, 4, False),
        (40, 33, 200, 3, True),
        (33, 16, 96, None, False),
        (17, 20, 100, 2, True),
        (5, 24, 64, 1, False),
    ],
)
def test_splitk_linear_matches_f_linear(device, dtype, m, n, k, split, bias):
    """Partial output tiles (33 of 16 columns), K slices ending inside a step (200 in three
    slices of 96-deep rounds of 32), one slice (a plain GEMM), 5 of 16 rows: the fp32 sum in
    another order, rounded once."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    wide = torch.randn((m, k + 8), generator=gen).to(device, dtype)
    x = wide[:, 8:]  # strided rows
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn((n,), generator=gen).to(device, dtype) if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    out = splitk_linear(x, w, b, split=split)
    check(out, ref)
    assert torch.equal(splitk_linear(x, w, b, split=split), out)  # the slices' sum has one order
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0  # ready for the next launch
    assert splitk_linear(x[:0], w, b).shape == (0, n)


def test_splitk_linear_poisoned_output_and_workspace(device):
    """Every output element is written (the output and the workspace come from an allocator
    that may hand back old values): fill the cache with NaNs first."""
    torch.full((1 << 16,), float("nan"), device=device).clone()  # a freed NaN block for empty()
    x = torch.randn((48, 128), device=device).to(torch.bfloat16)
    w = (torch.randn((40, 128), device=device) / 128**0.5).to(torch.bfloat16)
    out = splitk_linear(x, w, split=4)
    assert torch.isfinite(out.float()).all()
    check(out, F.linear(x.float(), w.float()).to(torch.bfloat16))


def test_splitk_dispatch_and_config():
    o = torch.zeros((1024, 2048), dtype=torch.bfloat16)
    down = torch.zeros((1024, 3072), dtype=torch.bfloat16)
    qkv = torch.zeros((4096, 1024), dtype=torch.bfloat16)
    rows = lambda m, k, dtype=torch.bfloat16: torch.zeros((m, k), dtype=dtype)  # noqa: E731
    assert use_splitk_linear(rows(64, 2048), o) and use_splitk_linear(rows(33, 3072), down)
    assert not use_splitk_linear(rows(32, 2048), o) and not use_splitk_linear(rows(65, 2048), o)
    assert not use_splitk_linear(rows(64, 1024), qkv)  # a wide output has tiles enough: cuBLAS
    assert not use_splitk_linear(rows(64, 2048, torch.float32), o.float())  # fp32 keeps the exact path
    assert splitk_config(64, 1024, 2048)[:3] == (32, 4, 128) and splitk_config(64, 1024, 3072)[:3] == (32, 4, 128)
    assert splitk_config(64, 64, 172).split == 1  # a short K is not split
    assert splitk_config(64, 4096, 1024).split == 1  # a wide output (q|k|v, deferred norm): tiles enough


def _sums_by_tile(h: torch.Tensor, block_n: int) -> torch.Tensor:
    """Each row's sum of squares over every block_n columns, fp32: (M, tiles)."""
    m, n = h.shape
    padded = torch.zeros((m, -(-n // block_n) * block_n), dtype=torch.float32, device=h.device)
    padded[:, :n] = h.float()
    return padded.square().view(m, -1, block_n).sum(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k,split,bias", [(64, 48, 256, 4, False), (40, 33, 200, 3, True), (5, 24, 64, 1, False)])
def test_splitk_add_residual(device, dtype, m, n, k, split, bias):
    """residual += x @ W^T (+ bias): the product rounded, then the add rounded (as the fused
    norm's residual add); the returned sums of squares are the new rows' over each output
    tile's columns, and add up to the rows' sums."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn((m, k), generator=gen).to(device, dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn((n,), generator=gen).to(device, dtype) if bias else None
    residual = torch.randn((m, n), generator=gen).to(device, dtype)
    before = residual.clone()
    sums = splitk_add_residual(x, w, residual, b, split=split, block_n=16)
    proj = splitk_linear(x, w, b, split=split, block_n=16)
    assert torch.equal(residual, (proj.float() + before.float()).to(dtype))  # the same product, then the add
    check(proj, F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype))
    torch.testing.assert_close(sums, _sums_by_tile(residual, 16), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums.sum(1), residual.float().square().sum(1), rtol=1e-5, atol=1e-5)
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k,split,parts", [(64, 80, 64, 1, 4), (40, 48, 96, 2, 3), (33, 16, 128, None, 8)])
def test_splitk_row_sums_normalise_in_the_epilogue(device, dtype, m, n, k, split, parts):
    """With row_sums the product is of the RMSNorm'd rows (the norm's weight folded into W):
    x @ W'^T times each row's 1 / sqrt(mean(x^2) + eps), rounded once; against the classic
    norm-then-project path only the roundings differ."""
    gen = torch.Generator().manual_seed(m * n + k)
    x = (3 * torch.randn((m, k), generator=gen)).to(device, dtype)
    norm_w = (1 + 0.1 * torch.randn((k,), generator=gen)).to(device, dtype)
    w = (torch.randn((n, k), generator=gen) / k**0.5).to(device, dtype)
    folded = (w.float() * norm_w.float()).to(dtype)
    eps = 1e-6
    # The sums in `parts` uneven pieces, as a producer's tiles would leave them.
    cuts = torch.linspace(0, k, parts + 1).round().long().tolist()
    sums = torch.stack([x[:, a:b].float().square().sum(1) for a, b in zip(cuts, cuts[1:])], 1).contiguous()
    rstd = torch.rsqrt(x.float().square().mean(1) + eps)
    out = splitk_linear(x, folded, split=split, row_sums=sums, eps=eps)
    check(out, ((x.float() @ folded.float().t()) * rstd[:, None]).to(dtype))
    classic = F.linear(rms_norm_ref(x, norm_w, eps)[0].float(), w.float()).to(dtype)
    torch.testing.assert_close(out.float(), classic.float(), rtol=0.03, atol=0.03)
