"""/v1/chat/completions through the official openai client, sync and async, against `serve all`
with a tiny random Qwen3 and the real Qwen2 tokenizer: the messages go through the ChatML
template, streamed text == whole text == the gRPC Generate text of the same rendered prompt;
usage, logprobs; n choices; and 64 streaming chats at once all complete."""

from __future__ import annotations

import asyncio

from tests.http.conftest import QWEN2_TOKENIZER

MODEL = "tiny-qwen3"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello in Japanese: こんにちは?"},
]
GREEDY = dict(max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})


def rendered(messages) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QWEN2_TOKENIZER), local_files_only=True)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def test_chat_whole_and_streamed_equal_grpc(qwen):
    prompt = rendered(MESSAGES)
    assert prompt[0] == 151644 and prompt[-3:] == [151644, 77091, 198]  # <|im_start|> ... <|im_start|>assistant\n
    with qwen.client() as c:
        expected, ids, last = c.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    client = qwen.openai()
    assert [m.id for m in client.models.list().data] == [MODEL]
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert expected and whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == len(ids) == 12
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(prompt) + 12


def test_async_chat_streamed_with_logprobs_and_max_completion_tokens(qwen):
    async def run():
        client = qwen.async_openai()
        whole = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY
        )
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **GREEDY)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        capped = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=3,
            max_tokens=9,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        await client.close()
        return whole, text, capped

    whole, streamed, capped = asyncio.run(run())
    assert streamed == whole.choices[0].message.content
    content = whole.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].logprob == max(alt.logprob for alt in content[0].top_logprobs)  # greedy: the best one
    assert bytes(content[0].bytes).decode("utf-8", "replace") == content[0].token
    assert capped.usage.completion_tokens == 3


def test_64_concurrent_streaming_chats_complete(qwen):
    async def one(client, i: int) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Request {i}: tell me a story."}],
            stream=True,
            max_tokens=8,
            temperature=0.8,
            seed=i,
            extra_body={"ignore_eos": True},
        )
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run():
        client = qwen.async_openai()
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), 60)
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 64 and all(reason == "length" for _, reason in results), results
    qwen.wait_kv_clean()


def test_chat_template_flag_gives_chat_to_a_model_without_one(bundled, tmp_path):
    """A second gateway, alone (`serve http`), in front of the bundled model's scheduler, whose
    tokenizer has no chat template: --chat-template supplies one."""
    import openai

    from tests.http.conftest import API_KEY, http_ok
    from tests.services.conftest import ServiceProcess, free_port, wait_for

    port = free_port()
    gateway = ServiceProcess(
        "http",
        [
            "--scheduler-addr",
            bundled.addr["scheduler"],
            "--port",
            str(port),
            "--chat-template",
            str(QWEN2_TOKENIZER / "chat_template.jinja"),
        ],
        tmp_path,
        env={"PICOVLLM_API_KEY": API_KEY},
    )
    try:
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 60, "the second gateway", gateway.proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        reply = client.chat.completions.create(
            model="stories260k", messages=[{"role": "user", "content": "Tell me a story."}], **GREEDY
        )
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 12
    finally:
        gateway.kill()


def test_chat_n_choices_whole_and_streamed(qwen):
    client = qwen.openai()
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, **GREEDY)
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.content == one.choices[0].message.content for c in whole.choices)
    assert whole.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True, **GREEDY))
    texts, roles = ["", ""], set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1} and texts == [one.choices[0].message.content] * 2
