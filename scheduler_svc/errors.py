"""Domain errors and the one server interceptor that maps them to gRPC status codes.

Services raise plain domain exceptions; servicers never pick status codes themselves. The
same interceptor is installed on all three services.

    ValueError / InvalidArgument  -> INVALID_ARGUMENT  (a request that can never run;
                                                        also a request message that does not parse)
    QueueFull                     -> RESOURCE_EXHAUSTED
    OutOfRange                    -> OUT_OF_RANGE      (a request that outgrew the KV cache)
    NotFound                      -> NOT_FOUND
    Unavailable                   -> UNAVAILABLE       (a peer is down past the deadline)
    FailedPrecondition            -> FAILED_PRECONDITION (state out of step: resync)
    SequenceFailed                -> INVALID_ARGUMENT  (a model step that fails for one sequence)
    RequestFailed                 -> INTERNAL          (one request failed; the others go on)
    anything else                 -> INTERNAL
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class PicoError(Exception):
    """Base of the errors a service raises on purpose."""


class InvalidArgument(PicoError, ValueError):
    pass


class QueueFull(PicoError):
    pass


class NotFound(PicoError):
    pass


class Unavailable(PicoError):
    pass


class FailedPrecondition(PicoError):
    pass


class OutOfRange(PicoError):
    """A request that cannot go on within the server's limits (it outgrew the KV cache)."""


class RequestFailed(PicoError):
    """One request failed on its own (an error in its stop checks, detokenization or
    sampling); the requests beside it are not affected."""


class SequenceFailed(PicoError, ValueError):
    """A model step failed because of one sequence, named in the message in a form that
    survives a gRPC status (the scheduler reads it back with `failed_seq_id` and fails that
    request alone)."""

    def __init__(self, seq_id: str, why: str) -> None:
        super().__init__(f"sequence {json.dumps(seq_id)} failed: {why}")
        self.seq_id = seq_id


_FAILED_SEQ = re.compile(r'sequence ("(?:[^"\\]|\\.)*") failed: ')


def failed_seq_id(exc: BaseException) -> str | None:
    """The sequence a SequenceFailed (or an error carrying its message, e.g. from a remote
    model service) names; None for any other error."""
    if isinstance(exc, SequenceFailed):
        return exc.seq_id
    match = _FAILED_SEQ.search(str(exc))
    if match is None:
        return None
    try:
        seq_id = json.loads(match.group(1))
    except ValueError:
        return None
    return seq_id if isinstance(seq_id, str) else None


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
)


def status_code_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error in an RPC", exc_info=exc)
    await context.abort(code, str(exc) or type(exc).__name__)


class _Malformed:
    """What a request message that does not parse deserializes to: the handler answers
    INVALID_ARGUMENT instead of gRPC's UNKNOWN for a deserializer that raised."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and kin: the caller's bytes
            return _Malformed(f"malformed request message: {exc}")

    return parse


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
        try:
            return await behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never lost
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
        try:
            async for item in behavior(request, context):
                yield item
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain exceptions raised by unary-unary, unary-stream and stream-stream handlers to
    status codes; a unary request message that does not parse gets INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), _tolerant(handler.request_deserializer), handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), _tolerant(handler.request_deserializer), handler.response_serializer)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer)
        return handler


def error_from_rpc(err: grpc.RpcError) -> PicoError | None:
    """The domain error a client-side status stands for (None: not one of ours)."""
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    for cls, c in _CODES:
        if code == c:
            return (InvalidArgument if cls is ValueError else cls)(detail)
    return None
