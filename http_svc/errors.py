"""OpenAI's error object and the HTTP status of every failure the gateway answers.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

    a body that does not validate, an unsupported field  400  invalid_request_error
    missing or wrong API key                               401  authentication_error
    a model other than the one served                      404  not_found_error
    a body over http.max_request_bytes                     413  invalid_request_error
    scheduler INVALID_ARGUMENT / OUT_OF_RANGE              400  invalid_request_error
    scheduler RESOURCE_EXHAUSTED (its queue is full)       429  rate_limit_error
    starting, or scheduler UNAVAILABLE                     503  service_unavailable_error
    any other gRPC status                                  500  server_error

The scheduler's details for the codes that are about the caller's request go out as they
are (the scheduler already worded them for callers, errors.public_message); any other detail
stays in the gateway's log.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.NOT_FOUND: 404,
}
_CODES = {429: "rate_limit_exceeded", 503: "service_unavailable"}
_CALLER_STATUSES = (400, 404, 429)


class APIError(Exception):
    """A failure answered with OpenAI's error object and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else _CODES.get(status)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def from_rpc(err: grpc.RpcError) -> APIError:
    """The HTTP answer to a failed scheduler call."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    status = _STATUS.get(code, 500)
    if status in _CALLER_STATUSES:
        return APIError(status, err.details() or code.name)
    if status == 503:
        return APIError(503, "the service is temporarily unavailable; try again later")
    if code == grpc.StatusCode.UNAUTHENTICATED:  # the gateway's own key: an operator's mistake
        logger.error("the scheduler refused the gateway's API key: set the same PICOVLLM_API_KEY for both")
    else:
        logger.error("scheduler call failed: %s: %s", code.name, err.details() if hasattr(err, "details") else err)
    return APIError(500, "internal error (the server log has the details)")


def starting() -> APIError:
    """A new one per answer (an exception object raised again keeps growing its traceback)."""
    return APIError(503, "the server is starting (waiting for the scheduler and the tokenizer); try again later")
