"""A request that fails fails alone (embedded engine, bundled model): a failure injected into
one request's stop checks, into the sampling of one sequence, or into a whole model step
ends only the requests it concerns; the others end with the tokens of an undisturbed greedy
run and every block is free afterwards. Request limits are checked at admission with a
ValueError naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from contracts.errors import RequestFailed, SequenceFailed
from scheduler_svc import LLM, SamplingParams

PROMPTS = ["Once upon a time", "Lily and Tom went to the park.", "One day, a little dog named Max", "The sun was"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
VICTIM = "r1"


@pytest.fixture(scope="module", params=["synchronous", "overlapped"])
def llm(request):
    return LLM(num_gpu_blocks=64, device="cpu", async_scheduling=request.param == "overlapped")


@pytest.fixture(scope="module")
def reference(llm) -> dict[str, list[int]]:
    return {f"r{i}": out.token_ids for i, out in enumerate(llm.generate(PROMPTS, GREEDY))}


def run(llm: LLM, params: list[SamplingParams] | None = None, max_steps: int = 500) -> dict[str, object]:
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params[i] if params else GREEDY, request_id=f"r{i}")
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished() and len(done) == len(PROMPTS)
    engine.kv.check_invariants()
    assert engine.kv.all_free_or_cached()
    return done


def test_failure_in_one_requests_stop_check_fails_it_alone(llm, reference, monkeypatch):
    engine = llm.engine
    check_stop = engine._check_stop

    def failing(req):
        if req.request_id == VICTIM and req.num_output_tokens == 3:
            raise RuntimeError("injected: detokenizer broke")
        check_stop(req)

    monkeypatch.setattr(engine, "_check_stop", failing)
    done = run(llm)
    assert isinstance(done[VICTIM].error, RequestFailed) and "injected" in str(done[VICTIM].error)
    assert done[VICTIM].finish_reason == "abort" and len(done[VICTIM].token_ids) == 3
    for request_id, tokens in reference.items():
        if request_id != VICTIM:
            assert done[request_id].error is None and done[request_id].token_ids == tokens


def test_failure_in_one_requests_detokenization_fails_it_alone(llm, reference, monkeypatch):
    """The step's batched detokenization hands back one request's decode error: that request
    fails, the others' text and tokens stand."""
    engine = llm.engine
    texts = {f"r{i}": out.text for i, out in enumerate(llm.generate(PROMPTS, GREEDY))}
    step = engine._detok.step

    def failing(states, token_ids, skip):
        errors = step(states, token_ids, skip)
        victim, stream = engine.requests.get(VICTIM), engine._streams.get(VICTIM)
        if victim is None or stream is None or victim.num_output_tokens != 3:
            return errors
        return [RuntimeError("injected: decode broke") if st is stream.detok else e for st, e in zip(states, errors)]

    monkeypatch.setattr(engine._detok, "step", failing)
    done = run(llm)
    assert isinstance(done[VICTIM].error, RequestFailed) and "injected" in str(done[VICTIM].error)
    assert done[VICTIM].finish_reason == "abort" and len(done[VICTIM].token_ids) == 3
    for request_id, tokens in reference.items():
        if request_id != VICTIM:
            assert done[request_id].error is None and done[request_id].token_ids == tokens
            assert done[request_id].text == texts[request_id]


def test_failure_in_one_sequences_sampling_fails_it_alone(llm, reference, monkeypatch):
    """The sampler breaks on a batch holding the victim's row (its marker: a seed); the batch
    is retried row by row, the victim is named and failed, the others recomputed."""
    sampler = llm.engine.model.sampler
    sample_batch = sampler._sample_batch
    calls = {"failed": 0}

    def failing(logits, batch):
        if any(g is not None and g.initial_seed() == 4242 for g in batch.generators):
            calls["failed"] += 1
            raise RuntimeError("injected: selected index out of range")
        return sample_batch(logits, batch)

    monkeypatch.setattr(sampler, "_sample_batch", failing)
    params = [GREEDY] * len(PROMPTS)
    params[1] = SamplingParams(temperature=0.8, seed=4242, max_tokens=24)
    done = run(llm, params)
    assert calls["failed"] >= 2  # the batch, then the victim's row alone
    assert isinstance(done[VICTIM].error, RequestFailed) and "sampling failed" in str(done[VICTIM].error)
    for request_id, tokens in reference.items():
        if request_id != VICTIM:
            assert done[request_id].error is None and done[request_id].token_ids == tokens


def test_model_step_failure_naming_nobody_fails_that_steps_requests_only(llm, reference, monkeypatch):
    """max_num_seqs 2: the first step holds r0 and r1 only; it fails without naming anyone.
    Those two fail, r2 and r3 (waiting then) run to the reference tokens."""
    engine = llm.engine
    step_attr = "launch" if engine.async_scheduling else "step"
    real = getattr(engine.model, step_attr)
    failed = []

    def failing(inp):
        if not failed:
            failed.append([s.seq_id for s in inp.seqs])
            raise RuntimeError("injected: device fault")
        return real(inp)

    monkeypatch.setattr(engine.model, step_attr, failing)
    monkeypatch.setattr(engine.scheduler, "config", dataclasses.replace(engine.scheduler.config, max_num_seqs=2))
    done = run(llm)
    assert failed == [["r0", "r1"]]
    for request_id in ("r0", "r1"):
        assert isinstance(done[request_id].error, RequestFailed) and "device fault" in str(done[request_id].error)
    for request_id in ("r2", "r3"):
        assert done[request_id].error is None and done[request_id].token_ids == reference[request_id]


def test_sequence_named_by_the_model_fails_alone(llm, reference, monkeypatch):
    """A model step that raises SequenceFailed (as the runner does for a sequence it cannot
    take) ends that request only."""
    engine = llm.engine
    step_attr = "launch" if engine.async_scheduling else "step"
    real = getattr(engine.model, step_attr)
    seen = []

    def failing(inp):
        if any(s.seq_id == VICTIM and s.start_pos > 10 for s in inp.seqs) and not seen:
            seen.append(1)
            raise SequenceFailed(VICTIM, "injected")
        return real(inp)

    monkeypatch.setattr(engine.model, step_attr, failing)
    done = run(llm)
    assert seen and isinstance(done[VICTIM].error, RequestFailed)
    for request_id, tokens in reference.items():
        if request_id != VICTIM:
            assert done[request_id].error is None and done[request_id].token_ids == tokens


def test_runner_names_a_sequence_it_cannot_sample(llm):
    """Past a scheduler that did not check (another client of the model service), the runner
    refuses logprobs over the vocabulary for that sequence, before the step does any work."""
    from contracts.step import SeqStep, StepInput

    runner = llm.engine.model
    bad = SeqStep("bad-seq", [1, 2, 3], 0, True, 0, [0], SamplingParams(logprobs=1000), [1, 2, 3])
    with pytest.raises(SequenceFailed, match="logprobs 1000") as err:
        runner.step(StepInput([bad]))
    assert err.value.seq_id == "bad-seq" and "bad-seq" not in runner.seqs


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(logprobs=1000), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=[f"s{i}" for i in range(65)]), "stop"),
        (dict(stop=["x" * 4097]), "stop"),
        (dict(stop_token_ids=[1] * 1025), "stop_token_ids"),
        (dict(stop_token_ids=[512]), "stop_token_ids"),
    ],
)
def test_request_limits_are_checked_at_admission(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate("Once upon a time", SamplingParams(**kwargs))
    assert not llm.engine.has_unfinished()


def test_prompt_text_over_the_character_cap_is_refused_before_tokenizing(llm, monkeypatch):
    limit = llm.engine.limits.prompt_chars(llm.engine.max_model_len)
    monkeypatch.setattr(llm.engine.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(ValueError, match="prompt has .* characters"):
        llm.generate("x" * (limit + 1), GREEDY)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_k=1 << 31), "top_k"),
        (dict(seed=1 << 63), "seed"),
    ],
)
def test_sampling_params_refuse_values_the_model_side_cannot_take(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
