"""The runner takes cascade decode for a batch that shares a long prompt prefix (prefix-cache
hits give every sequence the same leading block ids), and its tokens equal plain decode's.
The Triton cascade kernel runs here (interpreter on the CPU) inside the bundled model, whose
other ops are the torch references."""

from __future__ import annotations

import dataclasses

import numpy as np

from contracts.step import PLACEHOLDER, SeqStep, StepInput
from model_svc.attention_metadata import CASCADE_MIN_SEQS, CASCADE_MIN_TOKENS, shared_prefix_blocks
from model_svc.loader import BUNDLED_MODEL_DIR
from model_svc.runner import ModelRunner
from pico_kernels.ops import REFERENCE_OPS
from scheduler_svc import SamplingParams


def test_shared_prefix_blocks_rule():
    bs = 16
    lens = np.full(CASCADE_MIN_SEQS, 40 * bs)
    tables = np.tile(np.arange(40), (CASCADE_MIN_SEQS, 1))
    tables[:, 20:] += 100 * np.arange(1, CASCADE_MIN_SEQS + 1)[:, None]  # rows differ from block 20 on
    assert shared_prefix_blocks(tables, lens, bs) == 20
    assert shared_prefix_blocks(tables[:-1], lens[:-1], bs) == 0  # too few sequences
    short = lens.copy()
    short[3] = 18 * bs + 5  # the prefix may not reach past the shortest sequence
    assert shared_prefix_blocks(tables, short, bs) == 18
    assert shared_prefix_blocks(tables[:, : CASCADE_MIN_TOKENS // bs - 1], lens, bs) == 0  # too short to pay
    other = tables.copy()
    other[5, 0] = 999  # one row differs at the start: none shared
    assert shared_prefix_blocks(other, lens, bs) == 0


def test_runner_takes_cascade_for_a_shared_prefix_and_matches_plain_decode():
    from pico_kernels.triton_cascade import cascade_decode_attention

    calls = []

    def counted(*args):
        calls.append(int(args[6].item()))
        return cascade_decode_attention(*args)

    n, bs, steps = CASCADE_MIN_SEQS, 16, 2  # the prefill, then one decode step
    prefix_blocks = CASCADE_MIN_TOKENS // bs
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 500, prefix_blocks * bs).tolist()
    prompts = [prefix + rng.integers(3, 500, 5).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=steps)

    layers = []

    def run(cascade_ops: bool) -> dict[str, list[int]]:
        runner = ModelRunner(str(BUNDLED_MODEL_DIR), device="cpu", num_device_blocks=prefix_blocks + 2 * n + 1)
        if cascade_ops:
            ops = dataclasses.replace(REFERENCE_OPS, cascade_decode_attention=counted)
            for layer in runner.model.model.layers:
                layer.self_attn.attn.ops = ops
            layers.append(len(runner.model.model.layers))
        shared = list(range(prefix_blocks))  # the prefix's blocks, in every table (as prefix-cache hits)
        first = [
            SeqStep(f"s{i}", p, 0, True, 0, shared + [prefix_blocks + 2 * i, prefix_blocks + 2 * i + 1], params, p)
            for i, p in enumerate(prompts)
        ]
        got = {t.seq_id: [t.token_id] for t in runner.step(StepInput(seqs=first)).sampled}
        for k in range(1, steps):
            seqs = [SeqStep(f"s{i}", [PLACEHOLDER], len(p) + k - 1, True) for i, p in enumerate(prompts)]
            for t in runner.step(StepInput(seqs=seqs)).sampled:
                got[t.seq_id].append(t.token_id)
        return got

    plain = run(cascade_ops=False)
    assert run(cascade_ops=True) == plain
    assert calls == [prefix_blocks] * layers[0]  # the decode step's every layer, the whole prefix
