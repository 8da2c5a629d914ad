"""/v1/completions and /v1/models through the official openai client, sync and async, against
`picovllm serve all` with the bundled model: streamed text == whole text == the gRPC
Generate text of the same greedy request, and the counts agree; n completions per prompt."""

from __future__ import annotations

import asyncio

from tests.http.conftest import raw

PROMPT = "Once upon a time"
GREEDY = dict(max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})


def grpc_text(stack, prompt, max_tokens: int = 24) -> tuple[str, int, int]:
    with stack.client() as c:
        text, ids, last = c.complete(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return text, last.usage.prompt_tokens, len(ids)


def test_models_lists_the_served_model(bundled):
    models = bundled.openai().models.list()
    assert [m.id for m in models.data] == ["stories260k"]
    assert models.data[0].model_extra["max_model_len"] > 0


def test_sync_completion_whole_and_streamed_equal_grpc(bundled):
    client = bundled.openai()
    expected, prompt_tokens, n = grpc_text(bundled, PROMPT)
    whole = client.completions.create(model="stories260k", prompt=PROMPT, **GREEDY)
    assert whole.choices[0].text == expected and expected
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        prompt_tokens,
        n,
        prompt_tokens + n,
    )
    chunks = list(
        client.completions.create(
            model="stories260k", prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_async_completion_token_prompts_and_several_prompts(bundled):
    ids = [1, 400, 401, 402, 403]
    expected = [grpc_text(bundled, PROMPT)[0], grpc_text(bundled, ids)[0]]

    async def run():
        client = bundled.async_openai()
        whole = await client.completions.create(model="stories260k", prompt=[PROMPT, "x"], **GREEDY)
        by_ids = await client.completions.create(model="stories260k", prompt=ids, **GREEDY)
        stream = await client.completions.create(model="stories260k", prompt=[ids, ids], stream=True, **GREEDY)
        texts = ["", ""]
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        await client.close()
        return whole, by_ids, texts

    whole, by_ids, streamed = asyncio.run(run())
    assert [c.index for c in whole.choices] == [0, 1] and whole.choices[0].text == expected[0]
    assert whole.usage.completion_tokens == 2 * 24
    assert by_ids.choices[0].text == expected[1] and streamed == [expected[1], expected[1]]


def test_sampling_fields_reach_the_engine(bundled):
    client = bundled.openai()
    base = dict(model="stories260k", prompt=PROMPT, max_tokens=16)
    seeded = [
        client.completions.create(
            **base,
            temperature=1.0,
            seed=7,
            top_p=0.9,
            extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    stopped = client.completions.create(**base, temperature=0.0, stop=[" little"])
    assert stopped.choices[0].finish_reason == "stop" and " little" not in stopped.choices[0].text
    short = {**base, "max_tokens": 4}
    lp = client.completions.create(**short, temperature=0.0, logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == client.completions.create(**short, temperature=0.0).choices[0].text


def test_default_max_tokens_is_16_as_openai(bundled):
    whole = bundled.openai().completions.create(
        model="stories260k", prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert whole.usage.completion_tokens == 16


def test_health_and_metrics_need_no_key(bundled):
    assert raw(bundled, "GET", "/health", key=None)[0] == 200
    status, metrics = raw(bundled, "GET", "/metrics", key=None)
    metrics = metrics["text"]
    assert status == 200
    assert raw(bundled, "GET", "/v1/models", key=None)[0] == 401
    assert raw(bundled, "GET", "/v1/models")[0] == 200
    assert 'picovllm_http_requests_total{method="POST",route="/v1/completions",status="200"}' in metrics
    assert "picovllm_http_request_duration_seconds_bucket" in metrics


def test_n_completions_whole_and_streamed(bundled):
    client = bundled.openai()
    expected, prompt_tokens, n = grpc_text(bundled, PROMPT)
    whole = client.completions.create(model="stories260k", prompt=[PROMPT, PROMPT], n=3, **GREEDY)
    assert [c.index for c in whole.choices] == list(range(6))  # completion j of prompt i: i * 3 + j
    assert all(c.text == expected and c.finish_reason == "length" for c in whole.choices)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (2 * prompt_tokens, 6 * n)
    stream = client.completions.create(
        model="stories260k", prompt=PROMPT, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, reasons, chunks = ["", ""], [None, None], list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [expected, expected] and reasons == ["length", "length"]
    assert chunks[-1].usage.completion_tokens == 2 * n and chunks[-1].usage.prompt_tokens == prompt_tokens
    seeded = [
        [
            c.text
            for c in client.completions.create(model="stories260k", prompt=PROMPT, n=4, seed=5, max_tokens=16).choices
        ]
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1] and len(set(seeded[0])) > 1
