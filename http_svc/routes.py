"""The endpoints: /v1/models, /v1/completions, /v1/chat/completions, /health.

Each API call: the gateway must be ready (503), the model must be the one served (404), no
unsupported field (400); then one scheduler stream per prompt, answered whole or as SSE. A
stream's message of completion j (GenerateResponse.index) of prompt i is choice i * n + j.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from http_svc import convert, stream
from http_svc.backend import ChatTokenizer, SchedulerBackend, Serving
from http_svc.errors import APIError, from_rpc, starting
from http_svc.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

router = APIRouter()
CLIENT_CLOSED = 499  # nginx's status for a client that left before the answer: only in the metrics


def _backend(request: Request) -> tuple[SchedulerBackend, Serving]:
    backend: SchedulerBackend = request.app.state.backend
    serving = backend.serving()
    if serving is None:
        raise starting()
    return backend, serving


def _check(serving: Serving, body: SamplingFields) -> None:
    if body.model != serving.model_name:
        raise APIError(
            404,
            f"The model `{body.model}` does not exist; this server serves `{serving.model_name}`.",
            param="model",
            code="model_not_found",
        )
    refused = body.unsupported()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0])


def _include_usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _run(request: Request, backend: SchedulerBackend, requests: list, body: SamplingFields, events, whole) -> Any:
    """Start the scheduler streams; answer as SSE (`events(messages)` -> event strings) or
    whole (`whole(choices)` -> the response object)."""
    messages = stream.merged([backend.generate(r) for r in requests])
    try:
        if body.stream:
            return stream.SSEResponse(request, events(await stream.first_then_rest(request, messages)))
        choices = [convert.Choice(i) for i in range(len(requests) * body.n)]
        await stream.until_disconnect(
            request, stream.collect(messages, lambda i, m: choices[i * body.n + m.index].add(m))
        )
        return JSONResponse(whole(choices))
    except grpc.RpcError as err:
        raise from_rpc(err) from None
    except stream.ClientGone:
        return Response(status_code=CLIENT_CLOSED)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    backend, serving = _backend(request)
    return convert.models_response(serving.model_name, backend.created, serving.max_model_len)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    backend, serving = _backend(request)
    _check(serving, body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    sampling = convert.sampling_to_pb(body, body.max_tokens or convert.COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs)
    prompts = body.prompts()
    requests = [
        convert.generate_request(request_id if len(prompts) == 1 else f"{request_id}-{i}", p, sampling)
        for i, p in enumerate(prompts)
    ]
    model, created, token_text = serving.model_name, int(time.time()), serving.tokenizer.token_text
    n_logprobs = body.logprobs

    async def events(messages: AsyncIterator[stream.Tagged]) -> AsyncIterator[str]:
        choices = [convert.Choice(i) for i in range(len(prompts) * body.n)]
        offsets = [0] * len(choices)
        head = convert.envelope(request_id, "text_completion", model, created)
        async for prompt_index, m in messages:
            index = prompt_index * body.n + m.index
            choices[index].add(m)
            if not (m.text or m.logprobs or m.finish_reason):
                continue
            lp = None
            if n_logprobs is not None:
                lp = convert.completion_logprobs(list(m.logprobs), n_logprobs, token_text, offsets[index])
                offsets[index] += sum(map(len, lp["tokens"]))
            choice = {"index": index, "text": m.text, "logprobs": lp, "finish_reason": choices[index].finish_reason}
            yield stream.sse({**head, "choices": [choice], **({"usage": None} if _include_usage(body) else {})})
        if _include_usage(body):
            yield stream.sse({**head, "choices": [], "usage": convert.usage(choices)})
        yield stream.DONE

    return await _run(
        request,
        backend,
        requests,
        body,
        events,
        lambda choices: convert.completion_response(request_id, model, choices, n_logprobs, token_text),
    )


async def _render(backend: SchedulerBackend, tokenizer: ChatTokenizer, body: ChatCompletionRequest) -> list[int]:
    if not tokenizer.chat_template:
        raise APIError(
            400,
            "this model's tokenizer has no chat template: use /v1/completions, or start the gateway with "
            "--chat-template FILE",
            param="messages",
        )
    messages = [m.as_template_dict() for m in body.messages]
    try:
        return await asyncio.get_running_loop().run_in_executor(
            backend.render_pool, tokenizer.render, messages, body.add_generation_prompt, body.chat_template_kwargs
        )
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError and kin: the messages did not fit the template
        raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from None


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    backend, serving = _backend(request)
    _check(serving, body)
    prompt = await _render(backend, serving.tokenizer, body)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = body.max_new_tokens() or max(1, serving.max_model_len - len(prompt))
    n_logprobs = body.num_logprobs()
    sampling = convert.sampling_to_pb(body, max_tokens, n_logprobs)
    model, created, token_text = serving.model_name, int(time.time()), serving.tokenizer.token_text

    async def events(messages: AsyncIterator[stream.Tagged]) -> AsyncIterator[str]:
        choices = [convert.Choice(i) for i in range(body.n)]
        head = convert.envelope(request_id, "chat.completion.chunk", model, created)
        tail = {"usage": None} if _include_usage(body) else {}
        role = {"role": "assistant", "content": ""}
        yield stream.sse(
            {
                **head,
                "choices": [
                    {"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(body.n)
                ],
                **tail,
            }
        )
        async for _, m in messages:
            choice = choices[m.index]
            choice.add(m)
            if not (m.text or m.logprobs or m.finish_reason):
                continue
            lp = None if n_logprobs is None else convert.chat_logprobs(list(m.logprobs), n_logprobs, token_text)
            delta = {"content": m.text} if m.text else {}
            yield stream.sse(
                {
                    **head,
                    "choices": [
                        {"index": m.index, "delta": delta, "logprobs": lp, "finish_reason": choice.finish_reason}
                    ],
                    **tail,
                }
            )
        if _include_usage(body):
            yield stream.sse({**head, "choices": [], "usage": convert.usage(choices)})
        yield stream.DONE

    return await _run(
        request,
        backend,
        [convert.generate_request(request_id, prompt, sampling)],
        body,
        events,
        lambda choices: convert.chat_response(request_id, model, choices, n_logprobs, token_text),
    )


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the gateway is ready and the scheduler says SERVING, else 503 (no key needed:
    probes and load balancers call it)."""
    backend: SchedulerBackend = request.app.state.backend
    if backend.ready and await backend.scheduler_serving():
        return JSONResponse({"status": "ok"})
    why = "the server is starting" if not backend.ready else "the scheduler is not serving"
    return APIError(503, why).response()
