"""What the three gRPC servers share: an aio server with the error interceptor, grpc.health.v1
health (NOT_SERVING until the service says it is ready), server reflection, stop signals,
the one-line messages of start-up (a port that is taken, a service that is ready), and the
channel options and retry loop of the internal clients."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contracts.auth import TokenAuthInterceptor
from contracts.errors import ErrorInterceptor, PeerError, Unauthenticated, error_from_rpc

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20
_MESSAGE_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
# gRPC on Linux binds with SO_REUSEPORT by default: a second copy of a service would bind the
# same port beside the first and the kernel would split the connections between them.
SERVER_OPTIONS = _MESSAGE_OPTIONS + [("grpc.so_reuseport", 0)]
# Internal clients notice a restarted peer within about a second (gRPC's default reconnect
# backoff grows to two minutes).
CHANNEL_OPTIONS = _MESSAGE_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ListenError(OSError):
    """An address a server cannot listen on; its message is the one line an operator sees."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def why_not_listen(address: str) -> str | None:
    """Why a server could not listen on `address` now ('address already in use', 'permission
    denied'), or None when nothing stands in the way. Binds a throwaway socket on each address
    the host resolves to, with SO_REUSEADDR as servers use it; reasons other than a taken or
    forbidden port (a missing IPv6 loopback, say) are left to the server's own bind."""
    host, port = _split(address)
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    return os.strerror(exc.errno).lower()
    return None


def check_can_listen(address: str, what: str = "") -> None:
    """Raise ListenError naming `address` when a server could not listen on it."""
    reason = why_not_listen(address)
    if reason is not None:
        raise ListenError(f"cannot listen on {address}{f' ({what})' if what else ''}: {reason}")


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now and not handed out before by this process. The OS may offer a
    port it has just released again, so ports picked one after another (one for each listener
    of a stack, a rendezvous port) would otherwise collide now and then."""
    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@contextlib.contextmanager
def _core_log_silenced() -> Iterator[None]:
    """gRPC's C core writes a failed bind to the process's stderr itself, a line of its own
    beside the one-line error that says the same; GRPC_VERBOSITY set keeps it (debugging)."""
    if "GRPC_VERBOSITY" in os.environ:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def announce(line: str) -> None:
    """A start-up line for the operator on stderr, whatever the log level. `serve all` sets
    PICOVLLM_QUIET_READY in its children and prints one line for the three."""
    if not os.environ.get("PICOVLLM_QUIET_READY"):
        print(f"picovllm: {line}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    port: int
    address: str  # where it listens, with the port it got (for "host:0")

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("",) + self.service_names:
            await self.health.set(name, status)


def _add_health(server: grpc.aio.Server) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def _add_reflection(server: grpc.aio.Server, names: tuple[str, ...]) -> None:
    reflection.enable_server_reflection(names + (health.SERVICE_NAME, reflection.SERVICE_NAME), server)


async def start_server(
    address: str,
    services: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    options: Sequence[tuple[str, Any]] = (),
    *,
    auth_token: str | None = None,
    public: bool = False,
    credentials: grpc.ServerCredentials | None = None,
) -> RunningServer:
    """Bind `address` and start; `services` are (add_XServicer_to_server, servicer, full service
    name). Health answers NOT_SERVING until `set_serving(True)`. ListenError when the
    address is taken (checked first: gRPC's own bind failure logs lines of its own).
    `auth_token`: calls other than health and reflection must present it (UNAUTHENTICATED
    otherwise); `public`: error details sent to callers name no internal peer (ErrorInterceptor);
    `credentials`: TLS."""
    # PICOVLLM_LISTEN (set by `serve --listen`) binds elsewhere than the address peers dial,
    # e.g. 0.0.0.0:50052 inside a container that others reach as kvcache:50052.
    address = os.environ.get("PICOVLLM_LISTEN") or address
    check_can_listen(address)
    # `options` override SERVER_OPTIONS by name (the public server's smaller message limit).
    interceptors = ([TokenAuthInterceptor(auth_token)] if auth_token else []) + [ErrorInterceptor(public=public)]
    server = grpc.aio.server(interceptors=interceptors, options=list({**dict(SERVER_OPTIONS), **dict(options)}.items()))
    for add, servicer, _ in services:
        add(servicer, server)
    health_servicer = _add_health(server)
    names = tuple(name for _, _, name in services)
    _add_reflection(server, names)
    try:
        with _core_log_silenced():
            port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # taken since the check, or a host gRPC cannot bind
        port = 0
    if port == 0:
        raise ListenError(f"cannot listen on {address}: {why_not_listen(address) or 'gRPC could not bind it'}")
    await server.start()
    running = RunningServer(server, health_servicer, names, port, f"{address.rpartition(':')[0]}:{port}")
    await running.set_serving(False)
    logger.info("listening on %s (%s)", address, ", ".join(names))
    return running


def stop_event() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT (in the running loop)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, event.set)
    return event


def freeze_heap() -> None:
    """Call once start-up is done: move every object alive now (modules, torch's and gRPC's
    objects, a model, a tokenizer: 10^5 objects and more) out of the garbage collector's
    sight. A step allocates a few objects per sequence (messages converted to and from
    protobuf, block ops and results), and enough of them outlive the young generations that
    full collections ran every few dozen steps, each walking the whole start-up heap
    (bench/NOTES.md, "Figures behind the code's choices"). Objects that die
    later are still freed (by reference counting; only garbage cycles among the frozen
    objects are never collected)."""
    gc.collect()
    gc.freeze()


# ----------------------------------------------------------------- internal clients
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def call_with_retry(
    method: Callable[..., Any],
    request: Any,
    retry_until: float,
    timeout: float,
    what: str,
    unavailable: type[Exception],
    first: Callable[[], Any] | None = None,
) -> Any:
    """Call a unary method; while the peer is down (UNAVAILABLE, or no answer in time) retry
    with backoff until `retry_until` (monotonic), then raise `unavailable`. Other statuses
    become the domain error they stand for. `first`: the first attempt, already made
    (`method(request, timeout=timeout)`, e.g. on another thread): a function that returns its
    answer or raises its RpcError, called instead of calling `method` the first time."""
    delay, attempt = 0.02, 0
    while True:
        now = time.monotonic()
        # The first attempt gets the full timeout; retries wait for the channel to be ready
        # but never past the retry window.
        t = timeout if attempt == 0 else max(0.05, min(timeout, retry_until - now))
        try:
            if attempt == 0 and first is not None:
                return first()  # a failed call raises its RpcError here
            return method(request, timeout=t, wait_for_ready=attempt > 0)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Unauthenticated(
                    f"{what}: refused this process's internal token (every service needs the same "
                    f"PICOVLLM_INTERNAL_TOKEN)"
                ) from None
            if err.code() not in RETRYABLE:
                # Unmapped (UNIMPLEMENTED: another service at that address): one line, no traceback.
                problem = f"{what}: {err.code().name}: {err.details()}"
                raise (error_from_rpc(err) or PeerError(problem)) from None
            if time.monotonic() + delay >= retry_until:
                raise unavailable(f"{what}: {err.code().name}: {err.details()}") from None
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
        attempt += 1
