"""The scheduler gRPC service (picovllm.scheduler.v1): Generate (streamed), Abort, model info.

A thin servicer: proto <-> domain at the boundary, AsyncLLM over a ServiceEngine behind it.
Health is NOT_SERVING until both peers answered and the KV state is in sync; SIGTERM stops
new requests, lets the in-flight ones finish (bounded), then stops.

Requests never wait without end on a peer: PeerMonitor probes the model and KV-cache
services; health turns NOT_SERVING while one is unreachable (past `peer_down_after_s`), and
once one has been unreachable for `dependency_timeout_s` the requests waiting on it end with
UNAVAILABLE, client deadline or not. What callers are told names no internal address or
store error (errors.public_message); the log has the detail. With an API key, every call
but health and reflection must present it (contracts.auth).

Limits come before work: gRPC itself refuses a message over `max_request_bytes`
(RESOURCE_EXHAUSTED), then the request's sizes (prompt characters or tokens, stop strings,
logprobs, ids) are checked (INVALID_ARGUMENT), and only then is a text prompt tokenized, on
a thread of its own, so that a long prompt never holds up the engine's steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from contracts.auth import Credentials
from contracts.errors import InvalidArgument, NotFound, QueueFull, Unavailable
from contracts.rpc import announce, start_server, stop_event
from contracts.sampling_params import RequestLimits, SamplingParams
from contracts.service_config import SchedulerSection, ServiceConfig
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_svc.llm import AsyncLLM
from scheduler_svc.metrics import SchedulerMetrics, StreamTimer
from scheduler_svc.outputs import RequestOutput
from scheduler_svc.peer_health import PeerMonitor

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SchedulerService"].full_name
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "logprobs", "skip_special_tokens")
# Ids travel with every step of a request (the request id is the sequence id on the internal wire).
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024


# ----------------------------------------------------------------- proto <-> domain
def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(m, name) for name in _SAMPLING_FIELDS if m.HasField(name)}
    return SamplingParams(stop=list(m.stop), stop_token_ids=list(m.stop_token_ids), ignore_eos=m.ignore_eos, **kwargs)


def generate_from_pb(m: pb.GenerateRequest, limits: RequestLimits | None = None) -> tuple[str | list[int], SamplingParams, str, str | None]:
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
        raise InvalidArgument(f"stop_token_ids: a count of {len(m.sampling.stop_token_ids)} is over the limit of {limits.max_stop_token_ids}")
    prompt: str | list[int] = m.text if kind == "text" else list(m.token_ids.ids)
    params = sampling_from_pb(m.sampling) if m.HasField("sampling") else SamplingParams()
    return prompt, params, m.request_id or uuid.uuid4().hex, m.cache_salt or None


def output_to_pb(out: RequestOutput) -> pb.GenerateResponse:
    m = pb.GenerateResponse(request_id=out.request_id, token_ids=out.delta_token_ids, text=out.delta_text)
    if out.logprobs is not None and out.delta_token_ids:
        for token_id, entry in zip(out.delta_token_ids, out.logprobs[-len(out.delta_token_ids):]):
            top = [pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in entry.items() if t != token_id]
            m.logprobs.append(pb.GeneratedTokenLogprobs(token_id=token_id, logprob=entry.get(token_id, 0.0), top=top))
    if out.finished:
        m.finish_reason = _FINISH.get(out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
        if isinstance(out.stop_reason, str):
            m.stop_string = out.stop_reason
        elif isinstance(out.stop_reason, int):
            m.stop_token_id = out.stop_reason
        m.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                                  cached_tokens=out.num_cached_tokens))
    return m


def model_info_to_pb(engine: Any) -> pb.GetModelInfoResponse:
    info = engine.model.info
    return pb.GetModelInfoResponse(
        model=info.model, family=info.config.family, vocab_size=info.config.vocab_size, max_model_len=engine.max_model_len,
        block_size=info.block_size, num_device_blocks=info.num_device_blocks, num_host_blocks=info.num_host_blocks,
        eos_token_ids=info.config.eos_token_ids, enable_prefix_caching=engine.config.enable_prefix_caching,
    )


# ----------------------------------------------------------------- servicer
class ServerUnavailable(Unavailable):
    """UNAVAILABLE in words meant for callers (errors.public_message sends them as they are)."""

    public = True


PEERS_UNAVAILABLE = "the model or KV-cache service is unavailable; try again later"
# How often a waiting stream looks whether its peers have been unreachable too long.
_STALL_POLL_S = 0.5


class SchedulerServicer(pb_grpc.SchedulerServiceServicer):
    def __init__(self, config: SchedulerSection, metrics: SchedulerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.llm: AsyncLLM | None = None
        self.active: set[str] = set()
        self.draining = False
        self.monitor: PeerMonitor | None = None  # set by serve()
        # Text prompts are tokenized here, off the engine's thread (the tokenizer lets go of
        # the GIL while it works); one thread, so that one tokenizer is never entered twice.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tokenizing: dict[str, bool] = {}  # request id -> aborted meanwhile

    @property
    def engine(self) -> Any:
        return self.llm.engine if self.llm is not None else None

    def _ready(self) -> AsyncLLM:
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
            return self.engine.unavailable or (monitor.why if monitor is not None else None)
        return None

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        llm = self._ready()
        if self._stalled():  # it could only wait out the outage, then fail
            raise ServerUnavailable(PEERS_UNAVAILABLE)
        engine = self.engine
        sched = engine.scheduler
        if len(self.active) - len(sched.running) - len(sched.swapped) >= self.config.max_waiting:
            raise QueueFull(f"{self.config.max_waiting} requests are already waiting")
        prompt, params, request_id, salt = generate_from_pb(request, engine.limits)
        engine.check_request(prompt, params)  # before any work: the prompt's size, the request limits
        if request_id in self.active:
            raise InvalidArgument(f"request_id {request_id!r} is already in use")
        remaining = context.time_remaining()
        now = time.monotonic()
        deadline = None if remaining is None else now + remaining
        if deadline is not None:
            self.engine.deadlines[request_id] = deadline
        self.active.add(request_id)
        timer = StreamTimer(self.metrics, now)
        ended = "cancelled"  # the label it is counted under, unless it finishes: the client went away, or "error"
        try:
            if isinstance(prompt, str):
                prompt = await self._tokenize(prompt, request_id)
                if prompt is None:  # aborted while it was tokenized: it never reached the engine
                    ended = "abort"
                    yield pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ABORT)
                    return
            async for out in self._stream(llm.generate(prompt, params, request_id, salt), deadline, request_id):
                if out.error is not None:
                    raise out.error
                timer.on_output(time.monotonic(), len(out.delta_token_ids))
                if out.finished:
                    ended = ""
                    timer.on_finish(time.monotonic(), len(out.prompt_token_ids), out.finish_reason)
                yield output_to_pb(out)
        except ValueError:  # refused by the engine at admission (the prompt's tokens): not counted
            ended = ""
            raise
        except Exception:
            ended = "error"
            raise
        finally:
            self.active.discard(request_id)
            self.engine.deadlines.pop(request_id, None)
            if ended and self.metrics is not None:
                self.metrics.requests.labels(ended).inc()

    async def _tokenize(self, text: str, request_id: str) -> list[int] | None:
        """The prompt's token ids, from the tokenizer thread; None when Abort came meanwhile."""
        self._tokenizing[request_id] = False
        try:
            token_ids = await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self.engine.tokenize, text)
        finally:
            aborted = self._tokenizing.pop(request_id)
        return None if aborted else token_ids

    async def _stream(self, outputs: AsyncIterator[RequestOutput], deadline: float | None, request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's outputs. A request stuck behind a peer that is down fails with
        UNAVAILABLE a little before its deadline, and, deadline or not, once the peer has been
        unreachable for the dependency timeout (a merely slow one runs into its deadline)."""
        margin = 0.0 if deadline is None else min(0.25, 0.1 * max(0.0, deadline - time.monotonic()))
        task: asyncio.Future | None = None
        try:
            while True:
                task = asyncio.ensure_future(anext(outputs))
                while not (await asyncio.wait({task}, timeout=_stall_wait(deadline, margin)))[0]:
                    why = self._stalled(deadline, margin)
                    if why:
                        logger.warning("request %s ends UNAVAILABLE: %s", request_id, why)
                        raise ServerUnavailable(PEERS_UNAVAILABLE)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    return
                yield out
                if out.finished:
                    return
        finally:
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task})
            await outputs.aclose()  # aborts the request if it is still running

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        llm = self._ready()
        if request.request_id not in self.active:
            raise NotFound(f"no running request {request.request_id!r}")
        self._abort(llm, request.request_id)
        return pb.AbortResponse()

    def _abort(self, llm: AsyncLLM, request_id: str) -> None:
        if request_id in self._tokenizing:  # the engine does not know it yet
            self._tokenizing[request_id] = True
        else:
            llm.abort(request_id)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        if self.llm is None:
            raise ServerUnavailable("the server is starting")
        return model_info_to_pb(self.engine)

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


def _stall_wait(deadline: float | None, margin: float) -> float:
    """How long a stream waits for its next output before it looks at its peers again: the
    poll interval, or less to wake just before its deadline."""
    if deadline is None:
        return _STALL_POLL_S
    until = deadline - margin - time.monotonic()
    return _STALL_POLL_S if until <= 0 else min(_STALL_POLL_S, until)


# ----------------------------------------------------------------- serve
def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run a blocking call in a daemon thread (a start-up wait must not keep the process
    alive after SIGTERM)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the loop
            loop.call_soon_threadsafe(lambda e=exc: fut.done() or fut.set_exception(e))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    threading.Thread(target=run, name="scheduler-start", daemon=True).start()
    return fut


def tls_credentials(s: SchedulerSection) -> Any:
    """grpc.ServerCredentials from the PEM files of the config, or None without TLS."""
    if s.tls_cert is None or s.tls_key is None:
        return None
    import grpc

    with open(s.tls_key, "rb") as key, open(s.tls_cert, "rb") as cert:
        return grpc.ssl_server_credentials([(key.read(), cert.read())])


async def serve(config: ServiceConfig, credentials: Credentials | None = None) -> None:
    """Run until SIGTERM/SIGINT. `credentials`: the API key callers must present (if any),
    and the internal token presented to the model and KV-cache services."""
    from scheduler_svc.remote_engine import build_service_engine

    s = config.scheduler
    creds = credentials or Credentials()
    metrics = SchedulerMetrics(lambda: servicer.engine)
    servicer = SchedulerServicer(s, metrics)
    # The public server's own message limit, far below the internal services' (gRPC refuses a
    # larger request with RESOURCE_EXHAUSTED before any of it is parsed).
    running = await start_server(s.address, [(pb_grpc.add_SchedulerServiceServicer_to_server, servicer, SERVICE_NAME)],
                                 options=[("grpc.max_receive_message_length", s.max_request_bytes)],
                                 auth_token=creds.api_key, public=True, credentials=tls_credentials(s))
    listening = [f"gRPC {running.address}"]
    if s.metrics_port:
        try:
            listening.append(f"metrics {metrics.serve(s.metrics_port, running.address.rpartition(':')[0].strip('[]'))}")
        except OSError:
            await running.server.stop(None)  # the port is free again before the one-line error
            raise
    stop = stop_event()
    build = _in_daemon_thread(build_service_engine, config, False, creds.internal_token)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([build, stopped], return_when=asyncio.FIRST_COMPLETED)
    watch = None
    if build.done():
        if build.exception() is not None:  # peers never up, or they refused us: the port is free before the one-line error
            await running.server.stop(None)
        servicer.llm = AsyncLLM(build.result())

        async def peers_down(down: bool) -> None:
            await running.set_serving(not down and not servicer.draining)

        servicer.monitor = PeerMonitor({"model": config.model.address, "kvcache": config.kvcache.address}, s.peer_down_after_s,
                                       lambda: servicer.engine.unavailable, peers_down)
        watch = asyncio.ensure_future(servicer.monitor.run())
        await running.set_serving(True)
        announce(f"scheduler service ready: {', '.join(listening)}")
        await stopped
    servicer.draining = True  # before health: a peer coming back must not turn it SERVING again
    await running.set_serving(False)
    if watch is not None:
        watch.cancel()
    await servicer.drain(s.drain_timeout_s)
    await running.server.stop(grace=2)
    if servicer.llm is not None:
        servicer.llm.shutdown()
