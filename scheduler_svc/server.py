"""The scheduler gRPC service (picovllm.scheduler.v1): Generate (streamed; many on one call:
GenerateStream), Abort, model info.

A thin servicer: proto <-> domain at the boundary; the engine (a ServiceEngine) runs its loop
in a process of its own (scheduler_svc.engine_core) and hands back each step's outputs in one
frame (scheduler_svc.engine_client). Health is NOT_SERVING until both peers answered and the
KV state is in sync; SIGTERM stops new requests, lets the in-flight ones finish (bounded),
then stops.

Why the engine is not a thread of this process: every streamed message costs this process
Python work (the gRPC aio send, a protobuf message, an asyncio wake-up), and with the engine
in a thread that work and the engine's steps took turns on one interpreter lock, so the more
streams, the slower every step (bench/NOTES.md, "The service at the engine's speed"). Apart,
the engine steps as in embedded mode and this process only streams: the design of vLLM v1's
engine core behind its API server. What this process does is bounded per step, not per token: one frame per step
wakes each stream that waits, and a stream whose handler is behind (a slow client, or this
process busy) gets every token since its last message in its next one (coalescing: in
order, none lost; the final message carries the finish reason and the token counts).

Requests never wait without end on a peer: PeerMonitor probes the model and KV-cache
services; health turns NOT_SERVING while one is unreachable (past `peer_down_after_s`), and
once one has been unreachable for `dependency_timeout_s` the requests waiting on it end with
UNAVAILABLE, client deadline or not. What callers are told names no internal address or
store error (errors.public_message); the log has the detail. With an API key, every call
but health and reflection must present it (contracts.auth).

Limits come before work: gRPC itself refuses a message over `max_request_bytes`
(RESOURCE_EXHAUSTED), then the request's sizes (prompt characters or tokens, stop strings,
logprobs, ids) are checked (INVALID_ARGUMENT), and only then is a text prompt tokenized, on
a thread of its own, so that a long prompt never holds up the streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from contracts.auth import Credentials
from contracts.errors import InvalidArgument, NotFound, QueueFull, Unavailable
from contracts.generate_stream import generate_stream
from contracts.rpc import announce, freeze_heap, start_server, stop_event
from contracts.sampling_params import RequestLimits, SamplingParams
from contracts.service_config import SchedulerSection, ServiceConfig
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.engine_client import EngineClient, OutputStream
from scheduler_svc.engine_wire import EngineInfo
from scheduler_svc.generate_messages import next_messages
from scheduler_svc.metrics import SchedulerMetrics, StreamTimer
from scheduler_svc.peer_health import PeerMonitor

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SchedulerService"].full_name
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "skip_special_tokens",
    "n",
)
# Ids travel with every step of a request (the request id is the sequence id on the internal wire).
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024


# ----------------------------------------------------------------- proto <-> domain
def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(m, name) for name in _SAMPLING_FIELDS if m.HasField(name)}
    return SamplingParams(stop=list(m.stop), stop_token_ids=list(m.stop_token_ids), ignore_eos=m.ignore_eos, **kwargs)


def generate_from_pb(
    m: pb.GenerateRequest, limits: RequestLimits | None = None
) -> tuple[str | list[int], SamplingParams, str, str | None]:
    """(prompt, sampling, request id, cache salt); ValueError for what can never run. With
    `limits`, the repeated fields' counts are checked before they are converted."""
    kind = m.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("a prompt is required (text or token_ids)")
    if len(m.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id has {len(m.request_id)} characters; the limit is {MAX_REQUEST_ID_CHARS}")
    if len(m.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt has {len(m.cache_salt)} characters; the limit is {MAX_CACHE_SALT_CHARS}")
    if limits is not None and len(m.sampling.stop) > limits.max_stop_strings:
        raise InvalidArgument(f"stop: a count of {len(m.sampling.stop)} is over the limit of {limits.max_stop_strings}")
    if limits is not None and len(m.sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidArgument(
            f"stop_token_ids: a count of {len(m.sampling.stop_token_ids)} is over the limit of "
            f"{limits.max_stop_token_ids}"
        )
    prompt: str | list[int] = m.text if kind == "text" else list(m.token_ids.ids)
    params = sampling_from_pb(m.sampling) if m.HasField("sampling") else SamplingParams()
    return prompt, params, m.request_id or uuid.uuid4().hex, m.cache_salt or None


def model_info_to_pb(info: EngineInfo) -> pb.GetModelInfoResponse:
    return pb.GetModelInfoResponse(
        model=info.model,
        family=info.family,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        num_device_blocks=info.num_device_blocks,
        num_host_blocks=info.num_host_blocks,
        eos_token_ids=info.eos_token_ids,
        enable_prefix_caching=info.enable_prefix_caching,
    )


# ----------------------------------------------------------------- servicer
class ServerUnavailable(Unavailable):
    """UNAVAILABLE in words meant for callers (errors.public_message sends them as they are)."""

    public = True


PEERS_UNAVAILABLE = "the model or KV-cache service is unavailable; try again later"
# How often a waiting stream looks whether its peers have been unreachable too long.
_STALL_POLL_S = 0.5


class SchedulerServicer(pb_grpc.SchedulerServiceServicer):
    def __init__(self, config: SchedulerSection, metrics: SchedulerMetrics | None = None, replica_id: str = "") -> None:
        self.config = config
        self.metrics = metrics
        self.replica_id = replica_id  # the prefix index's name for this replica (GetLoad); "" = none
        self.llm: EngineClient | None = None
        self.active: set[str] = set()
        self.draining = False
        self.monitor: PeerMonitor | None = None  # set by serve()
        # Least seconds between two messages of one stream: 0 sends as soon as there is output
        # (tests raise it, so that every message carries the tokens of several steps).
        self.send_interval_s = 0.0
        # Text prompts are tokenized here, off the event loop (the tokenizer lets go of the
        # GIL while it works); one thread, so that one tokenizer is never entered twice.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tokenizing: dict[str, bool] = {}  # request id -> aborted meanwhile
        # Streams whose peers may stall them: request id -> (stream, deadline, margin, timer).
        self._watched: dict[str, tuple[OutputStream, float | None, float, asyncio.TimerHandle | None]] = {}
        self._watcher: asyncio.Future | None = None

    def _ready(self) -> EngineClient:
        if self.draining:
            raise ServerUnavailable("the server is shutting down")
        if self.llm is None:
            raise ServerUnavailable("the server is starting (waiting for the model and KV-cache services)")
        return self.llm

    def _stalled(self, deadline: float | None = None, margin: float = 0.0) -> str | None:
        """Why a request waiting now cannot go on (for the log), or None: a peer unreachable
        for the dependency timeout, or, a little before the request's deadline, at all."""
        monitor, now = self.monitor, time.monotonic()
        if monitor is not None and monitor.unreachable_for(now) >= self.config.dependency_timeout_s:
            return monitor.why or "a peer is unreachable"
        if deadline is not None and now >= deadline - margin:
            unavailable = self.llm.stats.unavailable if self.llm is not None else None
            return unavailable or (monitor.why if monitor is not None else None)
        return None

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        llm = self._ready()
        await llm.start()
        if self._stalled():  # it could only wait out the outage, then fail
            raise ServerUnavailable(PEERS_UNAVAILABLE)
        stats = llm.stats
        if len(self.active) - stats.num_running - stats.num_swapped >= self.config.max_waiting:
            raise QueueFull(f"{self.config.max_waiting} requests are already waiting")
        assert llm.info is not None  # start() has read it
        prompt, params, request_id, salt = generate_from_pb(request, llm.info.limits)
        llm.check_request(prompt, params)  # before any work: the prompt's size, the request limits
        if request_id in self.active:
            raise InvalidArgument(f"request_id {request_id!r} is already in use")
        remaining = context.time_remaining()
        now = time.monotonic()
        deadline = None if remaining is None else now + remaining
        self.active.add(request_id)
        timer = StreamTimer(self.metrics, now)
        ended = "cancelled"  # the label it is counted under, unless it finishes: the client went away, or "error"
        try:
            token_ids = await self._tokenize(prompt, request_id) if isinstance(prompt, str) else prompt
            if token_ids is None:  # aborted while it was tokenized: it never reached the engine
                ended = "abort"
                yield pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ABORT)
                return
            stream = llm.open(token_ids, params, request_id, salt, deadline)
            self._watch(request_id, stream, deadline)
            while True:
                # Every token since the last message; raises the request's error.
                messages, final, num_tokens = await next_messages(stream, request_id, params.n)
                now = time.monotonic()
                timer.on_output(now, num_tokens)
                if final is not None:
                    ended = ""
                    timer.on_finish(now, final[6], final[4])
                for message in messages:
                    yield message
                if final is not None:
                    return
                if self.send_interval_s:
                    await asyncio.sleep(self.send_interval_s)
        except ValueError:  # refused by the engine at admission (the prompt's tokens): not counted
            ended = ""
            raise
        except Exception:
            ended = "error"
            raise
        finally:
            self.active.discard(request_id)
            self._unwatch(request_id)
            llm.close(request_id)  # aborts the request if it is still running
            if ended and self.metrics is not None:
                self.metrics.requests.labels(ended).inc()

    async def GenerateStream(self, request_iterator, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Many Generate requests on one call (contracts.generate_stream)."""
        async for answer in generate_stream(self.Generate, request_iterator):
            yield answer

    async def _tokenize(self, text: str, request_id: str) -> list[int] | None:
        """The prompt's token ids, from the tokenizer thread; None when Abort came meanwhile."""
        self._tokenizing[request_id] = False
        try:
            assert self.llm is not None  # Generate checked it before the request got here
            token_ids = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self.llm.tokenize, text)
        finally:
            aborted = self._tokenizing.pop(request_id)
        return None if aborted else token_ids

    # ----------------------------------------------------------------- stalled streams
    def _watch(self, request_id: str, stream: OutputStream, deadline: float | None) -> None:
        """A stream stuck behind a peer that is down fails with UNAVAILABLE a little before
        its deadline, and, deadline or not, once the peer has been unreachable for the
        dependency timeout (a merely slow one runs into its deadline). One timer per stream
        with a deadline and one poll for all of them, never work per token."""
        margin = 0.0 if deadline is None else min(0.25, 0.1 * max(0.0, deadline - time.monotonic()))
        loop = asyncio.get_running_loop()
        timer = None if deadline is None else loop.call_at(deadline - margin, self._check_stalled, request_id)
        self._watched[request_id] = (stream, deadline, margin, timer)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._poll_stalled())

    def _unwatch(self, request_id: str) -> None:
        entry = self._watched.pop(request_id, None)
        if entry is not None and entry[3] is not None:
            entry[3].cancel()

    def _check_stalled(self, request_id: str) -> None:
        entry = self._watched.get(request_id)
        if entry is None or entry[0].waiter is None:  # gone, or not waiting for output (it has some to send)
            return
        why = self._stalled(entry[1], entry[2])
        if why:
            logger.warning("request %s ends UNAVAILABLE: %s", request_id, why)
            entry[0].fail(ServerUnavailable(PEERS_UNAVAILABLE))

    async def _poll_stalled(self) -> None:
        while self._watched:
            await asyncio.sleep(_STALL_POLL_S)
            for request_id in list(self._watched):
                self._check_stalled(request_id)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        llm = self._ready()
        if request.request_id not in self.active:
            raise NotFound(f"no running request {request.request_id!r}")
        self._abort(llm, request.request_id)
        return pb.AbortResponse()

    def _abort(self, llm: EngineClient, request_id: str) -> None:
        if request_id in self._tokenizing:  # the engine does not know it yet
            self._tokenizing[request_id] = True
        else:
            llm.abort(request_id)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        if self.llm is None:
            raise ServerUnavailable("the server is starting")
        await self.llm.start()
        assert self.llm.info is not None  # start() has read it
        return model_info_to_pb(self.llm.info)

    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.GetLoadResponse:
        """UNAVAILABLE whenever health is not SERVING: a router takes the replica out."""
        llm = self._ready()
        if self.monitor is not None and self.monitor.unreachable_for() >= self.config.peer_down_after_s:
            raise ServerUnavailable(PEERS_UNAVAILABLE)
        stats = llm.stats
        return pb.GetLoadResponse(
            num_waiting=max(0, len(self.active) - stats.num_running - stats.num_swapped),
            num_running=stats.num_running,
            num_swapped=stats.num_swapped,
            kv_usage=stats.device_usage,
            replica_id=self.replica_id,
        )

    async def drain(self, timeout: float) -> None:
        """Refuse new requests; wait for the in-flight ones (bounded), then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active and self.llm is not None:
            logger.warning("drain timeout: aborting %d requests", len(self.active))
            for request_id in list(self.active):
                self._abort(self.llm, request_id)
            end = time.monotonic() + 5
            while self.active and time.monotonic() < end:
                await asyncio.sleep(0.05)


# ----------------------------------------------------------------- serve
def tls_credentials(s: SchedulerSection) -> Any:
    """grpc.ServerCredentials from the PEM files of the config, or None without TLS."""
    if s.tls_cert is None or s.tls_key is None:
        return None
    import grpc

    with open(s.tls_key, "rb") as key, open(s.tls_cert, "rb") as cert:
        return grpc.ssl_server_credentials([(key.read(), cert.read())])


async def _start_engine(config: ServiceConfig, creds: Credentials, stopped: asyncio.Future) -> EngineClient | None:
    """The engine process, once it is built (it waits for the peers, bounded by the start-up
    timeout); None when SIGTERM came first. Raises what kept it from being built."""
    engine = EngineClient.spawn(config, creds.internal_token)
    build = asyncio.ensure_future(engine.start())
    await asyncio.wait([build, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not build.done():  # SIGTERM while it waits for its peers
        build.cancel()
        await engine.shutdown(timeout=0)
        return None
    if build.exception() is not None:
        await engine.shutdown(timeout=5)  # it exits by itself once it has said why
    build.result()
    return engine


async def serve(config: ServiceConfig, credentials: Credentials | None = None) -> None:
    """Run until SIGTERM/SIGINT. `credentials`: the API key callers must present (if any),
    and the internal token presented to the model and KV-cache services."""
    s = config.scheduler
    creds = credentials or Credentials()
    metrics = SchedulerMetrics(lambda: servicer.llm.stats if servicer.llm is not None else None)
    servicer = SchedulerServicer(s, metrics, config.kvcache.deployment if config.kvcache.publish_prefixes else "")
    # The public server's own message limit, far below the internal services' (gRPC refuses a
    # larger request with RESOURCE_EXHAUSTED before any of it is parsed).
    running = await start_server(
        s.address,
        [(pb_grpc.add_SchedulerServiceServicer_to_server, servicer, SERVICE_NAME)],
        options=[("grpc.max_receive_message_length", s.max_request_bytes)],
        auth_token=creds.api_key,
        public=True,
        credentials=tls_credentials(s),
    )
    listening = [f"gRPC {running.address}"]
    if s.metrics_port:
        try:
            listening.append(f"metrics {metrics.serve(s.metrics_port, running.address.rpartition(':')[0].strip('[]'))}")
        except OSError:
            await running.server.stop(None)  # the port is free again before the one-line error
            raise
    stopped = asyncio.ensure_future(stop_event().wait())
    try:
        servicer.llm = await _start_engine(config, creds, stopped)
    except BaseException:  # peers never up, or they refused us: the port is free before the one-line error
        await running.server.stop(None)
        raise
    watch, died = None, asyncio.get_running_loop().create_future()
    if servicer.llm is not None:
        llm = servicer.llm

        def on_exit(why: str) -> None:
            if not died.done():
                died.set_result(why)

        llm.on_exit = on_exit

        async def peers_down(down: bool) -> None:
            await running.set_serving(not down and not servicer.draining)

        servicer.monitor = PeerMonitor(
            {"model": config.model.address, "kvcache": config.kvcache.address},
            s.peer_down_after_s,
            lambda: llm.stats.unavailable,
            peers_down,
        )
        watch = asyncio.ensure_future(servicer.monitor.run())
        freeze_heap()  # start-up is done (the tokenizer is loaded): keep full collections off it
        await running.set_serving(True)
        announce(f"scheduler service ready: {', '.join(listening)}")
        await asyncio.wait([stopped, died], return_when=asyncio.FIRST_COMPLETED)
    servicer.draining = True  # before health: a peer coming back must not turn it SERVING again
    await running.set_serving(False)
    if watch is not None:
        watch.cancel()
    await servicer.drain(0.0 if died.done() else s.drain_timeout_s)
    await running.server.stop(grace=2)
    if servicer.llm is not None:
        await servicer.llm.shutdown()
    if died.done():
        raise ServerUnavailable(f"{died.result()}; stopping")
