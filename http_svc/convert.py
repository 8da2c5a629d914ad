"""Requests into the scheduler's GenerateRequest, its messages into OpenAI's response objects.

Sampling: OpenAI's fields map one to one onto picovllm.scheduler.v1.SamplingParams (vLLM's
names); a field left out takes OpenAI's default where it differs from the engine's
(temperature 1.0 and top_p 1.0 are both), else the engine's. max_tokens left out: 16 for
/v1/completions (OpenAI's and vLLM's default there), and for chat whatever room the context
leaves (max_model_len - prompt tokens); a request that would outgrow the context stops there
with finish_reason "length".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from http_svc.protocol import SamplingFields
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb

COMPLETION_DEFAULT_MAX_TOKENS = 16
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_SAME_NAME = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
)


def sampling_to_pb(body: SamplingFields, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    m = pb.SamplingParams(ignore_eos=body.ignore_eos)
    for name in _SAME_NAME:
        value = getattr(body, name)
        if value is not None:
            setattr(m, name, value)
    if max_tokens is not None:
        m.max_tokens = max_tokens
    if logprobs is not None:
        m.logprobs = logprobs
    if not body.skip_special_tokens:
        m.skip_special_tokens = False
    if body.stop:
        m.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        m.stop_token_ids.extend(body.stop_token_ids)
    return m


def generate_request(request_id: str, prompt: str | list[int], sampling: pb.SamplingParams) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


@dataclass(slots=True)
class Choice:
    """One choice's output so far, built up from the scheduler's messages."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.GeneratedTokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, message: pb.GenerateResponse) -> None:
        self.text.append(message.text)
        self.logprobs.extend(message.logprobs)
        if message.finish_reason:
            self.finish_reason = FINISH_REASONS.get(message.finish_reason, "stop")
        if message.HasField("usage"):  # once per prompt: with n > 1 it counts all n completions
            self.prompt_tokens = message.usage.prompt_tokens
            self.completion_tokens = message.usage.completion_tokens


def usage(choices: list[Choice]) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def envelope(request_id: str, obj: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created or int(time.time()), "model": model}


# ----------------------------------------------------------------- logprobs
def _top(entry: pb.GeneratedTokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The top-n alternatives of one token, best first. The scheduler sends the sampled token
    apart from the others: it belongs among the top n when fewer than n others came."""
    top = [(t.token_id, t.logprob) for t in entry.top]
    if len(top) < n:
        top.append((entry.token_id, entry.logprob))
    return sorted(top, key=lambda x: -x[1])[:n]


def completion_logprobs(
    entries: list[pb.GeneratedTokenLogprobs], n: int, token_text, offset: int = 0
) -> dict[str, Any]:
    """The legacy completions form: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(token_text(e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in _top(e, n)} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[pb.GeneratedTokenLogprobs], n: int, token_text) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in _top(e, n)]} for e in entries
        ]
    }


# ----------------------------------------------------------------- whole responses
def completion_response(
    request_id: str, model: str, choices: list[Choice], num_logprobs: int | None, token_text
) -> dict[str, Any]:
    return {
        **envelope(request_id, "text_completion", model),
        "choices": [
            {
                "index": c.index,
                "text": "".join(c.text),
                "finish_reason": c.finish_reason,
                "logprobs": None if num_logprobs is None else completion_logprobs(c.logprobs, num_logprobs, token_text),
            }
            for c in choices
        ],
        "usage": usage(choices),
    }


def chat_response(
    request_id: str, model: str, choices: list[Choice], num_logprobs: int | None, token_text
) -> dict[str, Any]:
    return {
        **envelope(request_id, "chat.completion", model),
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "finish_reason": c.finish_reason,
                "logprobs": None if num_logprobs is None else chat_logprobs(c.logprobs, num_logprobs, token_text),
            }
            for c in choices
        ],
        "usage": usage(choices),
    }


def models_response(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "picovllm",
                "root": name,
                "max_model_len": max_model_len,
            }
        ],
    }
