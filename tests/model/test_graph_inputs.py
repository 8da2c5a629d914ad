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
    want = [
        rng.integers(-1, 2**40, n),
        rng.integers(0, 2**31, n),
        rng.integers(-1, 2**33, n),
        rng.integers(0, 4096, n),
        rng.integers(1, 2**31 - 1, n).astype(np.int32),
    ]
    for field, values in zip(host, want):
        field[:n] = values
    host.prefix_blocks[0] = 77
    temps = rng.uniform(0.1, 2.0, n).astype(np.float32)
    greedy = rng.integers(0, 2, n)
    host.temperature[:n], host.greedy[:n], host.seed[0] = temps, greedy, 2**31 - 5
    host.pad(n, 16, spare_row=4096)

    dev = GraphInputs.views(torch.from_numpy(host_buf).clone(), max_batch)  # the one copy
    for field, values in zip(dev, want):
        assert torch.equal(field[:n], torch.from_numpy(np.asarray(values, dtype=field.numpy().dtype)))
    assert [f.dtype for f in dev] == [torch.int64] * 4 + [torch.int32] * 3 + [torch.float32, torch.int64]
    assert [f.numel() for f in dev] == [max_batch] * 5 + [1] + [max_batch] * 2 + [1]
    assert dev.prefix_blocks.item() == 77 and dev.seed.item() == 2**31 - 5
    assert torch.equal(dev.temperature[:n], torch.from_numpy(temps)) and dev.greedy[:n].tolist() == greedy.tolist()
    # padding rows of the bucket: token 0 at position 0, no slot, one token of context, the
    # spare row, greedy at temperature 1
    assert dev.input_ids[n:16].eq(0).all() and dev.positions[n:16].eq(0).all() and dev.rows[n:16].eq(4096).all()
    assert dev.slot_mapping[n:].eq(-1).all() and dev.seq_lens[n:].eq(1).all()
    assert dev.greedy[n:].eq(1).all() and dev.temperature[n:].eq(1.0).all()
    # no field overlaps another
    starts = sorted((f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in dev)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(starts, starts[1:]))
    assert starts[-1][1] <= dev.input_ids.data_ptr() + GraphInputs.nbytes(max_batch)


class _Graph:
    def __init__(self, key, log):
        self.key, self.log = key, log

    def replay(self):
        self.log.append(self.key)


class _Staging:
    """PinnedStaging's copy_into on the CPU: a plain copy."""

    def copy_into(self, array, dst):
        dst.copy_(torch.from_numpy(np.ascontiguousarray(array)))


def test_replay_decode_writes_what_the_graphs_read():
    """DecodeGraphs.replay_decode (no graphs captured; the CPU): the device buffers hold the
    step's tokens (placeholders kept), positions, rows, context lengths, slots and block
    tables, the bucket's padding rows are reset, and the cascade graph runs for a batch whose
    tables share enough leading blocks, the plain one otherwise."""
    from contracts.step import PLACEHOLDER
    from model_svc.attention_metadata import CASCADE_MIN_SEQS, CASCADE_MIN_TOKENS
    from model_svc.cuda_graphs import DecodeGraphs

    bs, width = 16, 24
    shared = CASCADE_MIN_TOKENS // bs  # blocks of the common prefix
    g = DecodeGraphs(None, [], 16, width, torch.device("cpu"), max_prefix_blocks=width, capture=False)
    log = []
    keys = [(b, c) for b in g.buckets for c in (False, True) if not c or b >= CASCADE_MIN_SEQS]
    g.graphs = {k: _Graph(k, log) for k in keys}
    g.outputs = {k: torch.arange(k[0] * 2).view(k[0], 2) for k in keys}
    sample_log = []
    g.sample_graphs = {k: _Graph(k, sample_log) for k in keys}

    def step(n, common, sampling=None):
        tables = np.stack(
            [np.r_[np.arange(common), 100 + 10 * i + np.arange(width - common - 4)] for i in range(n)]
        ).astype(np.int32)
        positions = [shared * bs + 3 + i for i in range(n)]
        tokens = [PLACEHOLDER if i % 2 else 7 + i for i in range(n)]
        rows = [40 - i for i in range(n)]
        before = len(sample_log)
        out = g.replay_decode(tokens, positions, rows, tables, bs, _Staging(), sampling)
        assert out.hidden.shape == (n, 2)
        bucket = g.bucket(n)
        d = g.inputs
        assert d.input_ids[:n].tolist() == tokens and d.rows[:n].tolist() == rows
        assert d.positions[:n].tolist() == positions and d.seq_lens[:n].tolist() == [p + 1 for p in positions]
        assert d.slot_mapping[:n].tolist() == [int(tables[i, p // bs]) * bs + p % bs for i, p in enumerate(positions)]
        assert d.slot_mapping[n:bucket].eq(-1).all() and d.seq_lens[n:bucket].eq(1).all()
        assert d.rows[n:bucket].eq(g.spare_row).all() and d.greedy[n:bucket].eq(1).all()
        assert torch.equal(g.block_tables[:n, : tables.shape[1]], torch.from_numpy(tables))
        if sampling is None:  # the caller samples from the hidden states
            assert out.token_ids is None and len(sample_log) == before
        else:  # the sampling graph of the same key ran, on the step's knobs
            assert sample_log[before:] == [log[-1]] and out.token_ids is not None and out.token_ids.shape == (n,)
            temps, greedy, seed = sampling
            assert d.temperature[:n].tolist() == temps and d.greedy[:n].tolist() == greedy and d.seed.item() == seed
        return log[-1], d.prefix_blocks.item()

    # tables share shared + 2 blocks, but the contexts fill only `shared` blocks wholly
    assert step(CASCADE_MIN_SEQS + 1, shared + 2) == ((16, True), shared)
    assert step(3, shared + 2) == ((4, False), 0)  # too few sequences for cascade
    assert step(CASCADE_MIN_SEQS, 0) == ((8, False), 0)  # nothing shared
    knobs = lambda n: ([0.5 + 0.25 * (i % 3) for i in range(n)], [int(i % 4 == 0) for i in range(n)], 1234 + n)  # noqa: E731
    assert step(CASCADE_MIN_SEQS + 1, shared + 2, knobs(CASCADE_MIN_SEQS + 1)) == ((16, True), shared)
    assert step(3, 0, knobs(3)) == ((4, False), 0)
