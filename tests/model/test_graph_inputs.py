"""The decode graphs' input layout: a step's values written into the host image arrive, after
one byte copy, as the typed device views the graphs were captured on."""

from __future__ import annotations

import numpy as np
import torch

from model_svc.cuda_graphs import GraphInputs


def test_host_image_reads_back_as_the_typed_views_after_one_copy():
    max_batch = 24
    host_buf = np.zeros(GraphInputs.nbytes(max_batch), dtype=np.uint8)
    host = GraphInputs.views(host_buf, max_batch)
    host.pad(0, max_batch)
    rng = np.random.default_rng(0)
    n = 13
    want = [rng.integers(-1, 2**40, n), rng.integers(0, 2**31, n), rng.integers(-1, 2**33, n), rng.integers(0, 4096, n),
            rng.integers(1, 2**31 - 1, n).astype(np.int32)]
    for field, values in zip(host, want):
        field[:n] = values
    host.prefix_blocks[0] = 77
    host.pad(n, 16)

    dev = GraphInputs.views(torch.from_numpy(host_buf).clone(), max_batch)  # the one copy
    for field, values in zip(dev, want):
        assert torch.equal(field[:n], torch.from_numpy(np.asarray(values, dtype=field.numpy().dtype)))
    assert [f.dtype for f in dev] == [torch.int64] * 4 + [torch.int32] * 2
    assert [f.numel() for f in dev] == [max_batch] * 5 + [1]
    assert dev.prefix_blocks.item() == 77
    # padding rows of the bucket: token 0 at position 0, no slot, one token of context, row 0
    assert dev.input_ids[n:16].eq(0).all() and dev.positions[n:16].eq(0).all() and dev.rows[n:16].eq(0).all()
    assert dev.slot_mapping[n:].eq(-1).all() and dev.seq_lens[n:].eq(1).all()
    # no field overlaps another
    starts = sorted((f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in dev)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(starts, starts[1:]))
    assert starts[-1][1] <= dev.input_ids.data_ptr() + GraphInputs.nbytes(max_batch)
