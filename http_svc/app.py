"""The FastAPI app: routes, the guards in front of them, errors as OpenAI's error object, and
the gateway's own Prometheus metrics on /metrics.

Guards run as plain ASGI middleware, before any route reads the body: the API key (401,
compared in constant time) on /v1/*, then the body size (413: a Content-Length over the limit
at once, a chunked body as soon as it passes it). /health and /metrics need no key, as gRPC
health and the scheduler's metrics do not (docs/SECURITY.md).

A body that does not validate gets 400 with the first bad field as `param` (vLLM's status;
FastAPI's default would be 422).
"""

from __future__ import annotations

import hmac
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from starlette.exceptions import HTTPException

from http_svc.backend import SchedulerBackend
from http_svc.errors import APIError, error_body
from http_svc.routes import router

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class BodyTooLarge(HTTPException):
    """Raised from the body's reads; FastAPI lets HTTPExceptions through its body parsing."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes")


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "picovllm_http_requests_total",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "picovllm_http_request_duration_seconds",
            "HTTP request time, to the last byte of the answer (a stream's end)",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_progress = Gauge(
            "picovllm_http_requests_in_progress",
            "HTTP requests being answered",
            registry=self.registry,
            multiprocess_mode="livesum",  # several workers (http_svc.workers): the sum over the live ones
        )

    def exposed(self) -> CollectorRegistry:
        """What /metrics shows: this process's registry, or with several workers every
        worker's values (prometheus-client's multiprocess mode)."""
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # set by http_svc.workers
            return self.registry
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry


class Guards:
    """ASGI middleware: metrics around everything; the API key, then the body's size."""

    def __init__(self, app: Any, metrics: HttpMetrics, api_key: str | None, max_request_bytes: int) -> None:
        self.app, self.metrics, self.max_bytes = app, metrics, max_request_bytes
        self.api_key = api_key.encode() if api_key else None

    def _authorized(self, scope: dict) -> bool:
        presented = b""
        for key, value in scope["headers"]:
            if key == b"authorization" and value[:7].lower() == b"bearer ":
                presented = value[7:].strip()
        return hmac.compare_digest(presented, self.api_key)  # type: ignore[arg-type]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route, method, status = path if path in ROUTES else "other", scope["method"], [500]

        async def send_status(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        start = time.perf_counter()
        self.metrics.in_progress.inc()
        try:
            await self._guarded(scope, receive, send_status, path)
        finally:
            self.metrics.in_progress.dec()
            self.metrics.requests.labels(route, method, str(status[0])).inc()
            self.metrics.latency.labels(route, method).observe(time.perf_counter() - start)

    async def _guarded(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        if self.api_key is not None and path.startswith("/v1/") and not self._authorized(scope):
            return await APIError(
                401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            ).response()(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await APIError(413, BodyTooLarge(self.max_bytes).detail, code="request_too_large").response()(
                scope, receive, send
            )
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 naming the first bad field; the alternatives of a union field are said once."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return JSONResponse(
            error_body(400, f"the request body is not valid JSON ({errors[0].get('ctx', {}).get('error', '')})"),
            status_code=400,
        )
    fields: dict[str, list[str]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        fields.setdefault(".".join(loc[:1]) or "body", []).append(err.get("msg", "invalid"))
    parts = [
        f"{name}: {msgs[0]}" if len(msgs) == 1 else f"{name}: must be {_FORMS.get(name, 'one of the accepted forms')}"
        for name, msgs in list(fields.items())[:5]
    ]
    param = next(iter(fields), None)
    return JSONResponse(
        error_body(400, "; ".join(parts) or "invalid request body", None if param == "body" else param), status_code=400
    )


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = "request_too_large" if exc.status_code == 413 else None
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail), None, code),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(500, "internal error (the server log has the details)"), status_code=500)


def create_app(backend: SchedulerBackend, api_key: str | None, max_request_bytes: int) -> FastAPI:
    app = FastAPI(title="pico-vllm OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    metrics = HttpMetrics()
    app.include_router(router)
    # FastAPI's decorator form: Starlette's add_exception_handler types every handler as
    # taking Exception, though each gets the class it is registered for.
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(APIError)(lambda request, exc: exc.response())
    app.exception_handler(HTTPException)(_http_error)
    app.exception_handler(Exception)(_server_error)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.exposed()), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Guards, metrics=metrics, api_key=api_key, max_request_bytes=max_request_bytes)
    return app
