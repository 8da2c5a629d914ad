"""Step inputs through reused pinned buffers (model_svc.transfer.PinnedStaging)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_svc.transfer import PinnedStaging

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_staged_copies_keep_their_values_while_slots_are_reused():
    """More copies than slots, of several dtypes and growing sizes, queued behind device work:
    every result holds its own array (a slot is never rewritten before its copy ran), buffers
    are allocated only to grow, and empty arrays work."""
    staging = PinnedStaging(torch.device("cuda"), slots=3, min_bytes=64)
    rng = np.random.default_rng(0)
    busy = torch.randn(4096, 4096, device="cuda")
    arrays, outs = [], []
    for i in range(20):
        busy = busy @ busy.T / 4096  # keep the stream busy, so copies queue behind it
        n = 8 * (i + 1) if i < 10 else 50
        a = [rng.integers(-1000, 1000, n), rng.random(n).astype(np.float32), rng.random(n) > 0.5][i % 3]
        arrays.append(a)
        outs.append(staging.to_device(a))
    torch.cuda.synchronize()
    for a, out in zip(arrays, outs):
        assert out.device.type == "cuda" and out.dtype == torch.from_numpy(a).dtype
        assert torch.equal(out.cpu(), torch.from_numpy(a))
    allocs = staging.num_allocs
    for a in arrays[-6:]:  # same sizes again: nothing new
        staging.to_device(a)
    assert staging.num_allocs == allocs <= 3 * 4
    assert staging.to_device(np.empty((0,), dtype=np.int64)).shape == (0,)


@needs_cuda
def test_copy_into_fills_strided_views_in_stream_order():
    """copy_into writes a block of a wider device tensor (as the decode graphs' block tables
    are written) and leaves the rest alone; each copy lands before the work queued after it."""
    staging = PinnedStaging(torch.device("cuda"), slots=2, min_bytes=64)
    rng = np.random.default_rng(1)
    dst = torch.full((8, 32), -5, dtype=torch.int32, device="cuda")
    busy = torch.randn(2048, 2048, device="cuda")
    seen, want = [], []
    for i in range(6):
        busy = busy @ busy.T / 2048
        a = rng.integers(0, 1000, (2 + i, 10 + 3 * i)).astype(np.int32)
        staging.copy_into(a, dst[: a.shape[0], : a.shape[1]])
        seen.append(dst.clone())  # queued after the copy
        expect = seen[-2].cpu().clone() if i else torch.full((8, 32), -5, dtype=torch.int32)
        expect[: a.shape[0], : a.shape[1]] = torch.from_numpy(a)
        want.append(expect)
    torch.cuda.synchronize()
    for got, expect in zip(seen, want):
        assert torch.equal(got.cpu(), expect)
