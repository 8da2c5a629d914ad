"""A request's streamed text state and the output each step hands out for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.detokenizer import DetokenizerState
from scheduler_svc.outputs import CompletionOutput, RequestOutput
from scheduler_svc.request import Request


@dataclass(slots=True)
class Stream:
    """Per-request text state."""

    prompt: str | None
    detok: DetokenizerState
    emitted_text: int = 0  # characters of detok.text already handed out
    emitted_tokens: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, built once


def _advance(req: Request, stream: Stream) -> tuple[list[int], str, str, list[dict[int, float]] | None]:
    """What `req` (one sequence) hands out this step: (new ids, new text, the visible text,
    every logprob so far or None)."""
    text, stop = stream.detok.text, req.sampling.stop
    # While running, hold back what could be the start of a stop string.
    visible = len(text) if req.finished or not stop else max(stream.emitted_text, len(text) - max(map(len, stop)) + 1)
    delta_text, stream.emitted_text = text[stream.emitted_text : visible], visible
    delta_ids = req.token_ids[len(req.prompt_token_ids) + stream.emitted_tokens :]
    stream.emitted_tokens += len(delta_ids)
    if req.sampling.logprobs is None:
        return delta_ids, delta_text, text[:visible], None
    done = len(stream.logprobs)
    new = req.token_ids[len(req.prompt_token_ids) + done :]
    stream.logprobs += [dict([*top, (tok, lp)]) for tok, (lp, top) in zip(new, req.logprobs[done:])]
    return delta_ids, delta_text, text[:visible], list(stream.logprobs)


def stream_output(req: Request, stream: Stream, mode: bool | str) -> RequestOutput | tuple:
    """What `req` (of one completion) hands out this step. mode "delta": a running request
    without logprobs gives a (request id, new ids, new text, None) tuple instead of a
    RequestOutput."""
    if mode == "delta" and not req.finished and req.sampling.logprobs is None:
        delta_ids, delta_text, _, _ = _advance(req, stream)
        return (req.request_id, delta_ids, delta_text, None)  # no copy of the whole output per step
    delta_ids, delta_text, text, logprobs = _advance(req, stream)
    return RequestOutput(
        req.request_id,
        stream.prompt,
        req.prompt_token_ids,
        req.output_token_ids,
        text,
        req.finish_reason,
        req.finished,
        delta_ids,
        delta_text,
        req.stop_reason,
        req.num_cached_tokens,
        logprobs,
    )


def group_output(parent: Request, streams: dict[str, Stream]) -> RequestOutput:
    """What a request of n > 1 completions hands out this step: every completion (each
    child's stream is keyed by its sequence id); the first one's fields are the output's."""
    completions = []
    for child in parent.children:
        delta_ids, delta_text, text, logprobs = _advance(child, streams[child.request_id])
        completions.append(
            CompletionOutput(
                child.index,
                text,
                child.output_token_ids,
                child.finish_reason,
                child.stop_reason,
                logprobs,
                delta_ids,
                delta_text,
            )
        )
    first = completions[0]
    return RequestOutput(
        parent.request_id,
        streams[parent.children[0].request_id].prompt,
        parent.prompt_token_ids,
        first.token_ids,
        first.text,
        first.finish_reason,
        parent.finished,
        first.delta_token_ids,
        first.delta_text,
        first.stop_reason,
        parent.num_cached_tokens,
        first.logprobs,
        completions=completions,
    )


def failed_output(req: Request, streams: dict[str, Stream], error: Exception) -> RequestOutput:
    """The last output of a request that failed: finish_reason "abort", `error` set, and the
    text without what was still held back (the failure may have come from its checks)."""
    for seq in req.completions:
        stream = streams.get(seq.request_id)
        if stream is not None:
            stream.detok.text = stream.detok.text[: stream.emitted_text]
    if req.children:
        out = group_output(req, streams)
        out.error = error
        return out
    stream = streams.get(req.request_id)
    return RequestOutput(
        req.request_id,
        stream.prompt if stream is not None else None,
        req.prompt_token_ids,
        req.output_token_ids,
        stream.detok.text if stream is not None else "",
        "abort",
        True,
        num_cached_tokens=req.num_cached_tokens,
        error=error,
    )
