"""A request's streamed text state and the output each step hands out for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.detokenizer import DetokenizerState
from scheduler_svc.outputs import RequestOutput
from scheduler_svc.request import Request


@dataclass(slots=True)
class Stream:
    """Per-request text state."""

    prompt: str | None
    detok: DetokenizerState
    emitted_text: int = 0  # characters of detok.text already handed out
    emitted_tokens: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, built once


def stream_output(req: Request, stream: Stream, mode: bool | str) -> RequestOutput | tuple:
    """What `req` hands out this step. mode "delta": a running request without logprobs gives
    a (request id, new ids, new text, None) tuple instead of a RequestOutput."""
    text, stop = stream.detok.text, req.sampling.stop
    # While running, hold back what could be the start of a stop string.
    visible = len(text) if req.finished or not stop else max(stream.emitted_text, len(text) - max(map(len, stop)) + 1)
    delta_text, stream.emitted_text = text[stream.emitted_text : visible], visible
    delta_ids = req.token_ids[len(req.prompt_token_ids) + stream.emitted_tokens :]
    stream.emitted_tokens += len(delta_ids)
    if mode == "delta" and not req.finished and req.sampling.logprobs is None:
        return (req.request_id, delta_ids, delta_text, None)  # no copy of the whole output per step
    logprobs = None
    if req.sampling.logprobs is not None:
        done = len(stream.logprobs)
        new = req.token_ids[len(req.prompt_token_ids) + done :]
        stream.logprobs += [dict([*top, (tok, lp)]) for tok, (lp, top) in zip(new, req.logprobs[done:])]
        logprobs = list(stream.logprobs)
    out = RequestOutput(
        req.request_id,
        stream.prompt,
        req.prompt_token_ids,
        req.output_token_ids,
        text[:visible],
        req.finish_reason,
        req.finished,
        delta_ids,
        delta_text,
        req.stop_reason,
        req.num_cached_tokens,
        logprobs,
    )
    return out
