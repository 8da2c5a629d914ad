"""Credentials of the services: where secrets come from, and the shared-secret check on gRPC.

Two secrets guard the gRPC services (docs/SECURITY.md has the threat model):

- the internal token: the KV-cache and model services accept calls only with it, and the
  scheduler sends it (`PICOVLLM_INTERNAL_TOKEN`, a file named by `PICOVLLM_INTERNAL_TOKEN_FILE`
  or `--internal-token-file`; `serve all` makes one per launch);
- the API key, optional: the scheduler's public API then requires it (`PICOVLLM_API_KEY`,
  `PICOVLLM_API_KEY_FILE` or `--api-key-file`).

Secrets come from the environment or from files, never from argv, where every local user
reads them (`ps`, /proc/<pid>/cmdline). A caller presents one in the call's metadata as
`authorization: Bearer <secret>` (or `x-picovllm-token: <secret>`); the server compares it in
constant time. Health checks and server reflection stay open: load balancers and container
healthchecks call them, and they reveal only whether a service is up and the public protos.
"""

from __future__ import annotations

import functools
import hmac
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

INTERNAL_TOKEN_ENV = "PICOVLLM_INTERNAL_TOKEN"
API_KEY_ENV = "PICOVLLM_API_KEY"
REDIS_URL_ENV = "PICOVLLM_REDIS_URL"
MIN_SECRET_CHARS = 16
# Calls that need no credential: health (probes, load balancers) and reflection (the protos).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_PRINTABLE = re.compile(r"^[\x21-\x7e]+$")  # what a gRPC metadata value can carry verbatim


class SecretError(ValueError):
    """A secret that is missing, unreadable or unusable; the message names where it came from,
    never its value."""


@dataclass(frozen=True, slots=True)
class Credentials:
    """The secrets one service process holds (None: not configured). Never printed."""

    internal_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)


def read_secret(
    var: str, path: str | None = None, env: Mapping[str, str] | None = None, check: bool = True
) -> str | None:
    """The secret named by environment variable `var`: from the file `path` (a flag), else the
    file named by `${var}_FILE`, else `$var` itself; None when none is set. Surrounding
    whitespace (a file's trailing newline) is dropped. `check`: refuse a value that cannot be
    a token (too short, or not printable ASCII)."""
    env = os.environ if env is None else env
    file_var = f"{var}_FILE"
    if path is None and env.get(var) and env.get(file_var):
        raise SecretError(f"both ${var} and ${file_var} are set: set one")
    where = path or env.get(file_var)
    if where:
        try:
            with open(where, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as exc:
            raise SecretError(f"cannot read the secret file {where}: {exc.strerror}") from None
        source = f"the file {where}"
    else:
        value, source = (env.get(var) or "").strip(), f"${var}"
    if not value:
        if where:
            raise SecretError(f"{source} is empty")
        return None
    if check:
        check_token(value, source)
    return value


def check_token(value: str, source: str) -> None:
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(f"the secret in {source} is shorter than {MIN_SECRET_CHARS} characters")
    if not _PRINTABLE.match(value):
        raise SecretError(f"the secret in {source} must be printable ASCII without spaces")


def mask_url(url: str | None) -> str | None:
    """The URL with its password (and user) replaced by ***, for logs and error messages."""
    if not url:
        return url
    return re.sub(r"^([a-z][a-z0-9+.-]*://)[^@/]*@", r"\1***@", url, flags=re.IGNORECASE)


def url_has_credentials(url: str | None) -> bool:
    """True when the URL carries a user or password (redis://:secret@host)."""
    return bool(url) and mask_url(url) != url


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata that presents `token` on a call (None: no credential)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def with_token(method: Callable[..., Any], token: str | None) -> Callable[..., Any]:
    """A gRPC multi-callable that presents `token` on every call (`method` itself without one)."""
    metadata = call_metadata(token)
    return method if metadata is None else functools.partial(method, metadata=metadata)


def presented_tokens(metadata: Any) -> list[bytes]:
    """The secrets a call presents in its metadata."""
    found = []
    for key, value in metadata or ():
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if key == "authorization" and value[:7].lower() == "bearer ":
            found.append(value[7:].strip().encode())
        elif key == "x-picovllm-token":
            found.append(value.strip().encode())
    return found


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection that does not present `token`, with
    UNAUTHENTICATED, before its request message is parsed."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def allowed(self, method: str, metadata: Any) -> bool:
        if method.startswith(OPEN_METHOD_PREFIXES):
            return True
        # Every presented value is compared in full (constant time in the token's length).
        ok = False
        for candidate in presented_tokens(metadata):
            ok |= hmac.compare_digest(candidate, self._token)
        return ok

    async def intercept_service(self, continuation, handler_call_details):
        if self.allowed(handler_call_details.method, handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return None if handler is None else _refusal(handler)


_REFUSED = "missing or invalid credentials"


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED; the request bytes
    are never deserialized."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        yield  # an async generator, as streaming handlers are

    serialize = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, None, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, None, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, None, serialize)
    return grpc.unary_unary_rpc_method_handler(deny, None, serialize)
