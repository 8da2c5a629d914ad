"""Parallel sampling (SamplingParams.n) on the bundled model: greedy completions equal n = 1,
seeded runs repeat, the children share the prompt's blocks and copy the partial last block
once each (copy-on-write), preemption by swap and by recompute, per-completion stop and
length, abort frees every child, streaming with AsyncLLM, and bad values of n."""

from __future__ import annotations

import asyncio

import pytest

from contracts.sampling_params import RequestLimits
from scheduler_svc import LLM, AsyncLLM, SamplingParams
from tests.scheduler.common import assert_clean

# 39 tokens: two full blocks and a partial one once the parent has prefilled all but the last.
PROMPT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big"
)


def test_greedy_n4_gives_four_copies_of_n1(llm):
    one = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0]
    four = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, n=4))[0]
    assert [c.index for c in four.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == one.token_ids and c.text == one.text for c in four.outputs)
    assert (four.text, four.token_ids, four.finish_reason) == (one.text, one.token_ids, one.finish_reason)
    assert len(one.outputs) == 1 and one.outputs[0].text == one.text
    assert_clean(llm)


def test_seeded_n4_repeats_and_children_differ(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, n=4)
    first = llm.generate(PROMPT, params)[0]
    again = llm.generate(PROMPT, params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    # Completion i samples with seed + i: it equals an n = 1 request seeded so.
    alone = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=1236, max_tokens=24))[0]
    assert alone.token_ids == first.outputs[2].token_ids
    assert_clean(llm)


def _record_steps(engine) -> list:
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(out.step)
        return out

    engine.scheduler.schedule = recording
    return steps


def _blocks_after_first_token(llm: LLM, prompts: list, params: SamplingParams):
    """Device blocks in use once every sequence has its first token, and the steps run."""
    engine = llm.engine
    steps = _record_steps(engine)
    try:
        ids = [engine.add_request(p, params) for p in prompts]
        while any(
            len(seq.token_ids) == seq.num_prompt_tokens for rid in ids for seq in engine.requests[rid].completions
        ):
            engine.step()
        used = engine.kv.device.num_used_blocks
        tables = {
            s.request_id: list(engine.kv.block_table(s.request_id)) for r in ids for s in engine.requests[r].completions
        }
        while engine.has_unfinished():
            engine.step()
    finally:
        del engine.scheduler.schedule
    return used, tables, steps


def test_children_share_blocks_and_copy_the_partial_block_once_each(llm):
    engine = llm.engine
    num_prompt = len(engine.tokenize(PROMPT))
    bs = engine.kv.block_size
    assert (num_prompt - 1) % bs, "the shared last block must be partial"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.engine.reset_prefix_cache()  # four separate requests admitted in one step share nothing
    separate, _, _ = _blocks_after_first_token(llm, [PROMPT] * 4, params)
    llm.engine.reset_prefix_cache()
    used, tables, steps = _blocks_after_first_token(
        llm, [PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=4)
    )
    full = partial = (num_prompt - 1) // bs  # the full prompt blocks; the index of the shared partial one
    assert full >= 2 and separate == 4 * (full + 1)
    assert used < separate
    assert used == full + 4  # the full prompt blocks once, a last block per child
    copies = [c for step in steps for c in step.copies]
    # The first three children to write copy the shared partial block, the last keeps it.
    assert len(copies) == 3 and len({src for src, _ in copies}) == 1
    (src,) = {src for src, _ in copies}
    lasts = [table[partial] for table in tables.values()]
    assert sorted(lasts) == sorted([src] + [dst for _, dst in copies])
    assert all(table[:full] == next(iter(tables.values()))[:full] for table in tables.values())
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_greedy_completions(mode):
    small = LLM(num_gpu_blocks=14, num_cpu_blocks=64, preemption_mode=mode, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = small.generate(PROMPT, params)[0].token_ids
    other = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = small.generate(
        [PROMPT, "The cat sat on the mat"], [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, n=4), other]
    )
    assert small.engine.scheduler.stats.num_preemptions > 0
    assert all(c.token_ids == want for c in outs[0].outputs)
    assert_clean(small)


def test_stop_and_length_per_completion(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=30, n=6, stop=[" the"])
    out = llm.generate(PROMPT, params)[0]
    reasons = {c.finish_reason for c in out.outputs}
    assert reasons <= {"stop", "length"} and out.finished
    for c in out.outputs:
        assert " the" not in c.text
        assert len(c.token_ids) <= 30
        assert (c.finish_reason == "length") == (len(c.token_ids) == 30 and c.stop_reason is None)
    assert len({len(c.token_ids) for c in out.outputs}) > 1  # they end apart
    assert_clean(llm)


def test_abort_frees_every_child(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, n=4))
    while len(engine.requests[rid].children[3].token_ids) < engine.requests[rid].num_prompt_tokens + 3:
        engine.step()
    assert engine.kv.device.num_used_blocks > 0
    out = engine.abort(rid)
    assert out is not None and out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert engine.kv.device.num_used_blocks == 0
    while engine.has_unfinished():
        engine.step()
    assert_clean(llm)


def test_abort_before_the_fork(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, n=3))
    out = engine.abort(rid)
    assert out is not None and out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    while engine.has_unfinished():
        engine.step()
    assert_clean(llm)


def test_one_token_prompt(llm):
    out = llm.generate([[7]], SamplingParams(temperature=0, max_tokens=5, n=3))[0]
    one = llm.generate([[7]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert all(c.token_ids == one.token_ids for c in out.outputs)
    assert_clean(llm)


def test_async_stream_carries_every_completion(llm):
    async def run():
        agen = AsyncLLM(llm.engine)
        try:
            texts = ["", ""]
            last = None
            async for out in agen.generate(PROMPT, SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2)):
                for c in out.outputs:
                    texts[c.index] += c.delta_text
                last = out
            return texts, last
        finally:
            agen.shutdown()

    texts, last = asyncio.run(run())
    assert last is not None and last.finished
    assert texts == [c.text for c in last.outputs]
    assert_clean(llm)


def test_request_id_of_a_child_is_taken(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=4, n=2), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), request_id="x#1")
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert_clean(llm)


@pytest.mark.parametrize("kwargs", [dict(n=0), dict(n=-1), dict(n="2"), dict(n=True), dict(n=3, seed=(1 << 63) - 2)])
def test_bad_n(kwargs):
    with pytest.raises(ValueError, match="n" if "seed" not in kwargs else "seed"):
        SamplingParams(**kwargs)


def test_grpc_client_complete_is_one_completion():
    from scheduler_svc.client import Client

    with Client("127.0.0.1:1") as c, pytest.raises(ValueError, match="generate"):
        c.complete("x", n=2)


def test_n_over_the_limit(llm):
    with pytest.raises(ValueError, match="n: a count of 129"):
        SamplingParams(n=129).check_limits(RequestLimits(), 512)
    # More completions than max_num_seqs: the ones without room start alone (prefix-cache hits).
    small = LLM(num_gpu_blocks=32, max_num_seqs=2)
    want = small.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    out = small.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, n=5))[0]
    assert [c.token_ids for c in out.outputs] == [want] * 5
    assert_clean(small)


def test_overlapped_scheduling_penalties_and_logprobs():
    overlapped = LLM(num_gpu_blocks=128, async_scheduling=True)
    assert overlapped.engine.async_scheduling
    for extra in ({}, {"repetition_penalty": 1.3}):
        one = overlapped.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, **extra))[0]
        four = overlapped.generate(PROMPT, SamplingParams(temperature=0, max_tokens=20, n=4, **extra))[0]
        assert all(c.token_ids == one.token_ids for c in four.outputs), extra
    out = overlapped.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=10, n=3, logprobs=2))[0]
    for c in out.outputs:
        assert len(c.logprobs) == 10 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    assert_clean(overlapped)
