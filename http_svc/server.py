"""`picovllm serve http`: the gateway under uvicorn.

It binds its port first (a taken port is one line and exit status 2, as for the gRPC
services), answers 503 until the scheduler has answered and the tokenizer has loaded, then
prints one line naming its URL. SIGTERM stops new connections and lets the requests in
flight finish for up to scheduler.drain_timeout_s (uvicorn's graceful shutdown); `serve all`
stops the gateway before it drains the scheduler.

Credentials: the API key (PICOVLLM_API_KEY, PICOVLLM_API_KEY_FILE or --api-key-file; never a
flag) is both what HTTP callers must present and what the gateway presents to the scheduler.
The gateway needs no internal token: it calls only the public API. TLS to the scheduler
trusts http.tls_ca, else scheduler.tls_cert (its own certificate, on one machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

import uvicorn

from contracts.auth import Credentials
from contracts.rpc import ListenError, announce, stop_event
from contracts.service_config import ServiceConfig
from http_svc.app import create_app
from http_svc.backend import SchedulerBackend

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """Signals are the process's (rpc.stop_event), as in the gRPC services: uvicorn's own
    handlers would raise SIGTERM again after the graceful stop, and the process would end by
    the signal instead of with status 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def dial_address(address: str) -> str:
    """Where to connect for an address a server listens on (a wildcard host: loopback)."""
    host, _, port = address.rpartition(":")
    return f"{ {'0.0.0.0': '127.0.0.1', '[::]': '[::1]'}.get(host, host) }:{port}"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or ListenError naming the address."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ListenError(f"cannot listen on {host}:{port} (HTTP): {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port} (HTTP): {(exc.strerror or str(exc)).lower()}") from None
    sock.set_inheritable(True)
    return sock


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def make_backend(config: ServiceConfig, creds: Credentials) -> SchedulerBackend:
    h = config.http
    return SchedulerBackend(
        dial_address(config.scheduler.address),
        creds.api_key,
        config.tokenizer,
        served_model_name=h.served_model_name,
        chat_template_file=h.chat_template,
        root_certificates=_read(h.tls_ca or config.scheduler.tls_cert),
    )


async def serve(
    config: ServiceConfig,
    credentials: Credentials | None = None,
    sock: socket.socket | None = None,
    first: bool = True,
    on_ready: Callable[[], object] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT. sock: a listening socket to serve on (a worker's, shared;
    http_svc.workers), else this binds its own. first: answer 503 while starting and print the
    readiness line (then call on_ready); a later worker instead takes no connection before it
    is ready, so that the workers already up answer them."""
    h = config.http
    creds = credentials or Credentials()
    if h.chat_template is not None:  # unreadable: one line now, not a failure later
        try:
            _read(h.chat_template)
        except OSError as exc:
            raise ValueError(f"cannot read the chat template {h.chat_template}: {exc.strerror}") from None
    sock = sock if sock is not None else bind(h.host, h.port)
    port = sock.getsockname()[1]
    backend = make_backend(config, creds)
    app = create_app(backend, creds.api_key, h.max_request_bytes)
    # log_config None: uvicorn's loggers go through the process's own logging set-up (-v, --log-level).
    server = _Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(config.scheduler.drain_timeout_s)),
        )
    )
    await backend.start()
    stop = stop_event()
    ready = asyncio.ensure_future(backend.wait_ready())
    stopping = asyncio.ensure_future(_exit_on(stop, server))
    try:
        if not first:
            await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if stopping.done():
                return
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is None:
            if first:
                announce(f"http gateway ready: {url(h.host, port)} (OpenAI-compatible API, model {backend.model_name})")
                if on_ready is not None:
                    on_ready()
        elif ready.done():  # the tokenizer did not load: nothing to serve
            server.should_exit = True
            await serving
            why = " ".join(str(ready.exception()).split())  # one line: transformers' messages span several
            raise ValueError(f"cannot load the tokenizer from {config.tokenizer}: {why}")
        await serving
    finally:
        ready.cancel()
        stopping.cancel()
        await backend.close()
        sock.close()


async def _exit_on(stop: asyncio.Event, server: uvicorn.Server) -> None:
    await stop.wait()
    server.should_exit = True  # uvicorn's graceful stop: no new connections, the open ones finish
