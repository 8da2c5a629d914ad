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


class PeerError(PicoError, RuntimeError):
    """A peer answered with a status no domain error stands for (UNIMPLEMENTED: another
    service at that address; INTERNAL): said in one line where a service starts."""


class Unauthenticated(PicoError):
    """A peer refused this process's credentials (its internal token differs). Not mapped to
    a status of its own: a public caller whose request it stops gets INTERNAL, not a hint
    that its own key was wrong."""


class OutOfRange(PicoError):
    """A request that cannot go on within the server's limits (it outgrew the KV cache)."""


class ModelLost(Unavailable):
    """The in-process model runner can run no step any more (a rank of a tensor-parallel
    group died): the embedded engine raises it instead of failing requests one by one."""


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


# On a public server (the scheduler's API), the details of these codes are about the caller's
# own request and go out as they are, any address in them masked; other codes' details can
# name internal peers or quote a store's errors, so the caller gets a fixed line and the log
# the detail. An exception with `public = True` is worded for callers (starting, draining).
_CALLER_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
_PUBLIC_TEXT = {
    grpc.StatusCode.UNAVAILABLE: "the service is temporarily unavailable; try again later",
    grpc.StatusCode.INTERNAL: "internal error (the server log has the details)",
}
_ADDRESS = re.compile(r"[a-z][a-z0-9+.-]*://\S+|\[[0-9a-fA-F:.]+\](?::\d+)?|\b[\w.-]+:\d{2,5}\b", re.IGNORECASE)


def public_message(exc: BaseException, code: grpc.StatusCode) -> str:
    """What a public caller is told for `exc` (mapped to `code`)."""
    text = str(exc) or type(exc).__name__
    if code in _CALLER_CODES or getattr(exc, "public", False):
        return _ADDRESS.sub("<internal>", text)
    return _PUBLIC_TEXT.get(code, "the request failed (the server log has the details)")


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, public: bool = False) -> None:
    code = status_code_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error in an RPC", exc_info=exc)
    text = str(exc) or type(exc).__name__
    if public:
        shown = public_message(exc, code)
        if shown != text and code != grpc.StatusCode.INTERNAL:
            logger.warning("%s: %s", code.name, text)
        text = shown
    await context.abort(code, text)


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


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], public: bool) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
        try:
            return await behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never lost
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, public)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]], public: bool) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
        try:
            async for item in behavior(request, context):
                yield item
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc, public)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain exceptions raised by unary-unary, unary-stream and stream-stream handlers to
    status codes; a unary request message that does not parse gets INVALID_ARGUMENT.
    `public`: the details go through public_message (the scheduler's public API)."""

    def __init__(self, public: bool = False) -> None:
        self.public = public

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, self.public),
                _tolerant(handler.request_deserializer),
                handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, self.public),
                _tolerant(handler.request_deserializer),
                handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream, self.public),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler


def error_from_rpc(err: grpc.RpcError) -> PicoError | None:
    """The domain error a client-side status stands for (None: not one of ours)."""
    code = err.code() if hasattr(err, "code") else None
    detail = err.details() if hasattr(err, "details") else str(err)
    for cls, c in _CODES:
        error = InvalidArgument if cls is ValueError else cls
        if code == c and issubclass(error, PicoError):  # every class of _CODES but ValueError is
            return error(detail)
    return None
