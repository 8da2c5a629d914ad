"""The split-K projection (kernels.triton_splitk) against F.linear: tiles and K slices that do
not divide the shapes, bias, strided rows; the same bits on every call whatever order the
slices finish in; the ticket counters left at zero; and where the model takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.triton_decode import arrival_counters
from kernels.triton_splitk import splitk_config, splitk_linear, use_splitk_linear
from tests.kernels.test_linear import DTYPES, check


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "m,n,k,split,bias",
    [(64, 48, 256, 4, False), (40, 33, 200, 3, True), (33, 16, 96, None, False), (17, 20, 100, 2, True), (5, 24, 64, 1, False)],
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
    assert splitk_config(64, 1024, 2048) == (32, 4, 128) and splitk_config(64, 1024, 3072) == (32, 4, 128)
    assert splitk_config(64, 64, 172)[1] == 1  # a short K is not split
