"""Piecewise prefill (model_svc.prefill_graphs): the layer's two halves around its attention,
run piece by piece, equal the model's forward, and on a GPU the captured pieces do too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_svc.attention_metadata import AttentionMetadata
from model_svc.loader import BUNDLED_MODEL_DIR
from model_svc.prefill_graphs import PrefillGraphs, supports_piecewise
from model_svc.runner import ModelRunner

BS = 16


def _meta(
    starts: list[int], lens: list[int], tables: list[list[int]], device
) -> tuple[torch.Tensor, AttentionMetadata]:
    """positions and metadata of a batch: sequence b feeds lens[b] tokens from position starts[b]."""
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    seq = np.repeat(np.arange(len(lens)), lens)
    width = max(len(t) for t in tables)
    table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    slots = table[seq, pos // BS].astype(np.int64) * BS + pos % BS
    as_t = lambda a, dt: torch.tensor(np.asarray(a), dtype=dt, device=device)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=as_t(slots, torch.long),
        block_tables=as_t(table, torch.int32),
        seq_lens=as_t(np.add(starts, lens), torch.int32),
        cu_seqlens_q=as_t(np.cumsum([0, *lens]), torch.int32),
        is_decode=False,
    )
    return as_t(pos, torch.long), meta


def _two_steps(device: str, dtype: str, piecewise) -> tuple[list[torch.Tensor], list]:
    """A prefill of 20 tokens, then a mixed step: a new 5-token prompt, 9 more tokens of the
    first sequence (20 cached) and one decode row of a third. `piecewise(runner)` returns the
    forward used for the second step. Returns both steps' hidden states and the caches."""
    torch.manual_seed(0)
    runner = ModelRunner(
        str(BUNDLED_MODEL_DIR),
        device=device,
        dtype=dtype,
        num_device_blocks=16,
        kernel_backend="triton",
        enforce_eager=True,
    )
    model, caches = runner.model, runner.pools.layer_caches
    model.model.layers = model.model.layers[:2]  # two layers are enough (interpreter time)
    for k, v in caches:  # poison: a slot written by mistake shows
        k.fill_(float("nan")), v.fill_(float("nan"))
    ids = torch.randint(3, 500, (64,), device=device)
    hidden = []
    with torch.inference_mode():
        pos, meta = _meta([0, 0], [20, 17], [[1, 2], [4, 5]], device)
        hidden.append(model(ids[:37], pos, caches, meta))
        pos, meta = _meta([0, 20, 17], [5, 9, 1], [[3], [1, 2], [4, 5]], device)
        hidden.append(piecewise(runner)(ids[37:52], pos, meta))
    return hidden, [torch.cat([k.flatten(), v.flatten()]) for k, v in caches]


def _assert_same(got, want, exact: bool) -> None:
    for a, b in zip(got, want):
        if exact:
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        else:
            torch.testing.assert_close(a.nan_to_num(7.0), b.nan_to_num(7.0), rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under the Triton interpreter, set only without CUDA")
def test_pieces_run_eagerly_equal_the_forward():
    """CPU, Triton interpreter: the same kernels on the same rows in the same order, so every
    hidden state and every cache entry is bit for bit the forward's."""
    eager = lambda r: lambda ids, pos, meta: r.model(ids, pos, r.pools.layer_caches, meta)  # noqa: E731

    def pieces(r):
        assert supports_piecewise(r.model)
        return PrefillGraphs(r.model, r.pools.layer_caches, 64, r.device, capture=False).run_eager

    want_h, want_c = _two_steps("cpu", "float32", eager)
    got_h, got_c = _two_steps("cpu", "float32", pieces)
    assert not supports_piecewise(
        ModelRunner(str(BUNDLED_MODEL_DIR), device="cpu", num_device_blocks=4).model
    )  # torch ops
    _assert_same(got_h, want_h, exact=True)
    _assert_same(got_c, want_c, exact=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_pieces_equal_the_forward():
    """CUDA, fp32: the graphs of the 16-token bucket (15 rows and a padding row) give the
    forward's hidden states and write the same cache entries and no others."""
    eager = lambda r: lambda ids, pos, meta: r.model(ids, pos, r.pools.layer_caches, meta)  # noqa: E731
    graphs = {}

    def captured(r):
        graphs["g"] = PrefillGraphs(r.model, r.pools.layer_caches, 32, r.device)
        return graphs["g"].run

    want_h, want_c = _two_steps("cuda", "float32", eager)
    got_h, got_c = _two_steps("cuda", "float32", captured)
    assert graphs["g"].buckets == [16, 32]
    _assert_same(got_h, want_h, exact=False)
    _assert_same(got_c, want_c, exact=False)
