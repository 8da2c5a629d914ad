"""Domain errors and the one server interceptor that maps them to gRPC status codes.

Services raise plain domain exceptions; servicers never pick status codes themselves. The
same interceptor is installed on all three services.

    ValueError / InvalidArgument  -> INVALID_ARGUMENT  (a request that can never run)
    QueueFull                     -> RESOURCE_EXHAUSTED
    NotFound                      -> NOT_FOUND
    Unavailable                   -> UNAVAILABLE       (a peer is down past the deadline)
    FailedPrecondition            -> FAILED_PRECONDITION (state out of step: resync)
    anything else                 -> INTERNAL
"""

from __future__ import annotations

import logging
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


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
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


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never lost
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, exc)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps domain exceptions raised by unary-unary, unary-stream and stream-stream handlers to status codes."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream), handler.request_deserializer, handler.response_serializer)
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
