"""The model runner orders a decode batch longest context first (for the decode kernel's
load balance); sampled tokens must still go to the right sequences, whatever order the
scheduler sent them in."""

from __future__ import annotations

import pytest

from contracts.step import PLACEHOLDER, SeqStep, StepInput
from model_svc.loader import BUNDLED_MODEL_DIR
from model_svc.runner import ModelRunner
from model_svc.step_batch import longest_first
from scheduler_svc import SamplingParams

PROMPTS = {"a": [1, 403, 407], "b": [1, 317, 269, 274, 287, 263, 377, 267, 265, 282], "c": [1, 261, 378, 295, 433, 426]}


def greedy(order: list[str], steps: int = 6) -> dict[str, list[int]]:
    runner = ModelRunner(str(BUNDLED_MODEL_DIR), device="cpu", num_device_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=steps)
    tables = {"a": [5, 1], "b": [9, 2], "c": [0, 7]}  # 16-token blocks: room for every token
    out = runner.step(
        StepInput(seqs=[SeqStep(s, PROMPTS[s], 0, True, 0, tables[s], params, PROMPTS[s]) for s in order])
    )
    got = {t.seq_id: [t.token_id] for t in out.sampled}
    for _ in range(steps - 1):
        seqs = [SeqStep(s, [got[s][-1]], len(PROMPTS[s]) + len(got[s]) - 1, True) for s in order]
        assert [x.seq_id for x in longest_first(seqs)] == sorted(order, key=lambda s: -len(PROMPTS[s]))
        for t in runner.step(StepInput(seqs=seqs)).sampled:
            got[t.seq_id].append(t.token_id)
    return got


def test_decode_tokens_follow_their_sequence_in_any_order():
    together = greedy(["a", "b", "c"])
    assert together == greedy(["c", "a", "b"])
    assert together == {s: greedy([s])[s] for s in PROMPTS}  # each as if alone


def test_only_decode_batches_are_reordered():
    decode = [SeqStep("x", [1], 3, True), SeqStep("y", [2], 9, True), SeqStep("z", [3], 9, True)]
    assert [s.seq_id for s in longest_first(decode)] == ["y", "z", "x"]  # stable among equals
    mixed = [SeqStep("x", [1], 3, True), SeqStep("y", [2, 3], 9, True)]
    assert longest_first(mixed) is mixed


def test_placeholders_take_each_sequence_latest_sample_with_steps_ahead():
    """Pipelined schedulers launch steps before reading earlier ones back: a placeholder is the
    sequence's latest sampled token, even two launches ahead, and even when the sequence sat
    out the step before (it then refers to an older launch)."""
    reference = greedy(["a", "b", "c"])
    runner = ModelRunner(str(BUNDLED_MODEL_DIR), device="cpu", num_device_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=6)
    tables = {"a": [5, 1], "b": [9, 2], "c": [0, 7]}
    launched = [
        runner.launch(
            StepInput(seqs=[SeqStep(s, PROMPTS[s], 0, True, 0, tables[s], params, PROMPTS[s]) for s in PROMPTS])
        )
    ]
    fed = {s: len(PROMPTS[s]) for s in PROMPTS}  # next position to feed
    for k in range(5):
        live = [s for s in PROMPTS if not (s == "c" and k == 1)]  # "c" sits out one step
        launched.append(runner.launch(StepInput(seqs=[SeqStep(s, [PLACEHOLDER], fed[s], True) for s in live])))
        for s in live:
            fed[s] += 1
    launched.append(runner.launch(StepInput(seqs=[SeqStep("c", [PLACEHOLDER], fed["c"], True)])))  # its last token
    got: dict[str, list[int]] = {s: [] for s in PROMPTS}
    for step in launched:  # read back only now
        for t in step.result().sampled:
            got[t.seq_id].append(t.token_id)
    assert got == reference


def test_a_placeholder_for_a_never_sampled_sequence_is_refused():
    runner = ModelRunner(str(BUNDLED_MODEL_DIR), device="cpu", num_device_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=6)
    prompt = PROMPTS["b"]
    runner.launch(StepInput(seqs=[SeqStep("b", prompt[:4], 0, False, 0, [9], params, prompt)]))  # a chunk: no sample
    with pytest.raises(ValueError, match="placeholder"):
        runner.launch(StepInput(seqs=[SeqStep("b", [PLACEHOLDER], 4, True)]))
