"""The Generate stream's messages: what a request's OutputStream gathered since the last
message, as GenerateResponses (scheduler_svc.server sends them).

A request of one completion gets one message per take, the last with the finish reason and
the usage. A request of n > 1 gets one message per completion that changed, each with its
index; a completion's last message has its finish reason, and the request's last message
the usage of every completion.
"""

from __future__ import annotations

from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.engine_client import Chunk, OutputStream

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def _message(
    request_id: str,
    index: int,
    token_ids: list[int],
    text: str,
    logprobs: list | None,
    reason: str | None,
    stop_reason: int | str | None,
) -> pb.GenerateResponse:
    m = pb.GenerateResponse(request_id=request_id, token_ids=token_ids, text=text, index=index)
    for token_id, logprob, top in logprobs or ():
        m.logprobs.append(
            pb.GeneratedTokenLogprobs(
                token_id=token_id, logprob=logprob, top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top]
            )
        )
    if reason is not None:
        m.finish_reason = _FINISH.get(reason, pb.FINISH_REASON_UNSPECIFIED)
        if isinstance(stop_reason, str):
            m.stop_string = stop_reason
        elif isinstance(stop_reason, int):
            m.stop_token_id = stop_reason
    return m


def _usage(final: tuple) -> pb.Usage:
    _, _, _, _, _, _, num_prompt, num_output, num_cached, _ = final
    return pb.Usage(prompt_tokens=num_prompt, completion_tokens=num_output, cached_tokens=num_cached)


def chunk_to_pb(request_id: str, chunk: Chunk) -> pb.GenerateResponse:
    """One message: every token (and text, logprobs) the stream had gathered; the last one
    also the finish reason, the stop reason and the token counts."""
    token_ids, text, logprobs, final = chunk
    if final is None:
        return _message(request_id, 0, token_ids, text, logprobs, None, None)
    m = _message(request_id, 0, token_ids, text, logprobs, final[4] or "", final[5])
    m.usage.CopyFrom(_usage(final))
    return m


async def next_messages(
    stream: OutputStream, request_id: str, n: int
) -> tuple[list[pb.GenerateResponse], tuple | None, int]:
    """The messages of what the stream gathered since the last take, the final delta (or
    None) and the number of tokens in them: one message for a request of one completion;
    for n > 1 one per completion that changed, the usage on the last."""
    if n == 1:
        chunk = await stream.take()
        return [chunk_to_pb(request_id, chunk)], chunk[3], len(chunk[0])
    chunks, final = await stream.take_completions()
    messages = [_message(request_id, *chunk) for chunk in chunks]
    if final is not None:
        if not messages:
            messages.append(pb.GenerateResponse(request_id=request_id))
        messages[-1].usage.CopyFrom(_usage(final))
    return messages, final, sum(len(chunk[1]) for chunk in chunks)
