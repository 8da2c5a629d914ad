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
