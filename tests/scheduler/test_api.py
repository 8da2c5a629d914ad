"""The public surface on the bundled model: the CLI, SamplingParams validation, stop
conditions, abort, streaming with AsyncLLM, and bad input."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from scheduler_svc import AsyncLLM, SamplingParams
from scheduler_svc.cli import main as cli_main
from tests.scheduler.common import assert_clean

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball."
)


# ------------------------------------------------------------------ CLI
def test_cli_generate_prints_the_story(capsys):
    assert cli_main(["generate", "Once upon a time", "--max-tokens", "40", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() == STORY


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "x", "--model", "/no/such/model/dir"], "model directory not found"),
        (["generate", "x", "--top-p", "2"], "top_p"),
        (["generate", "x", "--max-tokens", "0"], "max_tokens"),
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate", "x", "--max-tokens", "abc"], "invalid int value"),
        (["generate", "x", "--block-size", "12"], "block_size"),
    ],
)
def test_cli_errors_are_one_line(argv, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_value_error(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request([1, 99999], SamplingParams())
    with pytest.raises(ValueError, match="limit"):
        engine.add_request([5] * engine.max_model_len, SamplingParams())
    for bad in ([1, 2.0], [1, "2"], [1, None], [-1], [2**70]):
        with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, 512\)"):
            engine.add_request(bad, SamplingParams())
    assert not engine.has_unfinished()


def test_prompt_ids_of_any_integer_type_become_ints(llm):
    """numpy integers, a tuple or a generator of ids: checked and stored as plain ints."""
    import numpy as np

    engine = llm.engine
    for prompt in (np.array([5, 6, 7]).tolist(), list(np.array([5, 6, 7])), (5, 6, 7), (t for t in [5, 6, 7])):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
        req = engine.requests[rid]
        assert req.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in req.prompt_token_ids)
        engine.abort(rid)
    assert_clean(llm)


# ------------------------------------------------------------------ stop conditions
def test_stop_string_truncates_text(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=["Lily"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Lily"
    assert out.text == ", there was a little girl named "
    assert_clean(llm)


def test_stop_token_and_length(llm):
    ref = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10))[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10
    stop_id = ref.token_ids[3]
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    first = ref.token_ids.index(stop_id)
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    assert_clean(llm)


def test_text_streams_in_deltas_that_add_up(llm):
    engine = llm.engine
    request_id = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=40))
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                deltas.append(out.delta_text)
                final = out
    assert "".join(deltas) == final.text == STORY[len("Once upon a time") :]


def test_abort_frees_blocks(llm):
    engine = llm.engine
    request_id = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    out = engine.abort(request_id)
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort(request_id) is None  # unknown / already done
    while engine.has_unfinished():
        engine.step()
    assert_clean(llm)


# ------------------------------------------------------------------ streaming API
def test_async_llm_streams_and_cancel_frees_blocks(llm):
    async_llm = AsyncLLM(llm.engine)

    async def run():
        texts = []
        async for out in async_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40)):
            texts.append(out.delta_text)
        assert "".join(texts) == STORY[len("Once upon a time") :]
        # A consumer that goes away aborts its request.
        agen = async_llm.generate("Lily and Tom", SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not llm.engine.has_unfinished():
                break
        with pytest.raises(ValueError):
            async for _ in async_llm.generate("", SamplingParams()):
                pass

    try:
        asyncio.run(run())
    finally:
        async_llm.shutdown()
    assert_clean(llm)
