"""The router's gRPC service: picovllm.scheduler.v1 itself, in front of the replicas.

Generate picks a replica (router_svc.replicas.choose, from the prefix index and the load),
forwards the request unchanged but for its id (the router fills in one when the caller
left it empty, so that Abort finds the replica), and relays the stream. A replica that
cannot be reached, or whose queue is full, before the first message: the request goes to
another replica (each at most once). A stream that already sent messages and loses its
replica ends with UNAVAILABLE (its tokens cannot be taken back). Other statuses are the
replica's answer and go to the caller as they are. Abort goes to the replica serving the
request (one that has not registered it yet: the router cancels its stream there and ends
the caller's with ABORT); GetModelInfo to any replica that is up; GetLoad adds the replicas' loads up.

Health is SERVING while at least one replica can be routed to. SIGTERM refuses new requests
and lets the streams in flight run for up to `drain_timeout_s`, then stops. Callers present the API key
when one is configured, and the router presents the same key to the replicas.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from contracts.auth import Credentials, call_metadata
from contracts.block_hash import prompt_block_hashes
from contracts.errors import InvalidArgument, NotFound, Unavailable, error_from_rpc
from contracts.generate_stream import generate_stream
from contracts.rpc import announce, freeze_heap, start_server, stop_event
from contracts.service_config import RouterSection, ServiceConfig
from contracts.tokenizer import Tokenizer, load_tokenizer
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from router_svc.index import PrefixIndex
from router_svc.metrics import RouterMetrics
from router_svc.replicas import Replica, ReplicaSet, choose

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SchedulerService"].full_name
NO_REPLICA = "no replica is available; try again later"
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class RouterUnavailable(Unavailable):
    """UNAVAILABLE in words meant for callers (errors.public_message sends them as they are)."""

    public = True


@dataclass(slots=True)
class _Route:
    """A request in the router: its replica once chosen, and its prompt's hashes per block size."""

    replica: Replica | None = None
    call: grpc.aio.UnaryStreamCall | None = None  # the stream from `replica`
    aborted: bool = False
    token_ids: list[int] | None = None
    hashes: dict[int, list[int]] | None = None


class RouterServicer(pb_grpc.SchedulerServiceServicer):
    def __init__(
        self,
        config: RouterSection,
        replicas: ReplicaSet,
        tokenizer: Tokenizer | None,
        index: PrefixIndex | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.index = index
        self.metrics = metrics
        self.routes: dict[str, _Route] = {}
        self.draining = False
        # One thread: one tokenizer is never entered twice; off the event loop.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._index_failing = False

    # ----------------------------------------------------------------- routing
    async def _token_ids(self, request: pb.GenerateRequest) -> list[int]:
        if request.WhichOneof("prompt") == "token_ids":
            return list(request.token_ids.ids)
        if request.WhichOneof("prompt") != "text" or self.tokenizer is None:
            return []
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, request.text)

    async def _hits(self, request: pb.GenerateRequest, route: _Route, candidates: list[Replica]) -> dict[str, int]:
        """address -> leading prompt blocks each candidate holds (published, or recently routed)."""
        if route.token_ids is None:
            route.token_ids = await self._token_ids(request)
        route.hashes = route.hashes or {}
        hits: dict[str, int] = {}
        for block_size in {r.block_size for r in candidates}:
            hashes = route.hashes.get(block_size)
            if hashes is None:
                hashes = route.hashes[block_size] = prompt_block_hashes(
                    route.token_ids, block_size, request.cache_salt or None
                )
            group = [r for r in candidates if r.block_size == block_size]
            ids = [r.replica_id for r in group if r.replica_id and r.alive]
            published: dict[str, int] = {}
            if self.index is not None and ids and hashes:
                try:
                    published = await self.index.hits(ids, hashes)
                    self._index_failing = False
                except Exception as exc:  # noqa: BLE001 - Redis down: the recent routes alone
                    if not self._index_failing:
                        logger.warning("prefix index lookup failed (%s)", exc)
                    self._index_failing = True
            for r in group:
                hits[r.address] = max(published.get(r.replica_id, 0), self.replicas.recent.hits(r.address, hashes))
        return hits

    async def _route(self, request: pb.GenerateRequest, route: _Route, tried: set[str]) -> Replica:
        started = time.monotonic()
        candidates = self.replicas.routable(tried)
        if not candidates:
            raise RouterUnavailable(NO_REPLICA)
        prefix = self.config.policy == "prefix"
        hits = await self._hits(request, route, candidates) if prefix else {}
        chosen = choose(candidates, hits, self.config.policy, self.config.max_imbalance, self.replicas.next_turn())
        hashes = (route.hashes or {}).get(chosen.block_size)
        if hashes:
            self.replicas.recent.add(chosen.address, hashes)
        if self.metrics is not None:
            self.metrics.routed.labels(chosen.address).inc()
            self.metrics.decision_seconds.observe(time.monotonic() - started)
            if prefix:
                self.metrics.hit_tokens.observe(hits.get(chosen.address, 0) * chosen.block_size)
        return chosen

    # ----------------------------------------------------------------- the API
    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        if self.draining:
            raise RouterUnavailable("the router is shutting down")
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.routes:
            raise InvalidArgument(f"request_id {request_id!r} is already in use")
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.request_id = request_id
        route = self.routes[request_id] = _Route()
        tried: set[str] = set()
        try:
            while True:
                replica = await self._route(request, route, tried)
                if route.aborted:  # Abort came while it was routed: it never reached a replica
                    yield pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ABORT)
                    return
                tried.add(replica.address)
                route.replica = replica
                sent = False
                replica.in_flight += 1
                call = route.call = replica.stub.Generate(
                    forwarded, timeout=context.time_remaining(), metadata=self.replicas.metadata
                )
                try:
                    async for message in call:
                        sent = True
                        yield message
                    return
                except grpc.RpcError as err:
                    code = err.code()
                    if route.aborted and code == grpc.StatusCode.CANCELLED:  # Abort before the replica knew it
                        yield pb.GenerateResponse(request_id=request_id, finish_reason=pb.FINISH_REASON_ABORT)
                        return
                    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):  # the caller's own
                        await context.abort(code, code.value[1])
                    if sent or code not in _RETRY_CODES:
                        if code == grpc.StatusCode.UNAVAILABLE:
                            logger.warning("request %s lost replica %s: %s", request_id, replica.address, err.details())
                            raise RouterUnavailable("the replica serving this request failed; try again") from None
                        raise error_from_rpc(err) or RuntimeError(f"{code.name}: {err.details()}") from None
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self.replicas.take_out(replica, f"Generate: {err.details()}")
                    if not self.replicas.routable(tried):  # every other one is down or tried: its answer
                        raise error_from_rpc(err) or RouterUnavailable(NO_REPLICA) from None
                    if self.metrics is not None:
                        self.metrics.retries.inc()
                finally:
                    replica.in_flight -= 1
                    call.cancel()  # the caller went away: the replica aborts it (a no-op once done)
                    route.replica = route.call = None
        finally:
            self.routes.pop(request_id, None)

    async def GenerateStream(self, request_iterator, context) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Many Generate requests on one call (contracts.generate_stream), each routed on its own."""
        async for answer in generate_stream(self.Generate, request_iterator):
            yield answer

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        route = self.routes.get(request.request_id)
        if route is None:
            raise NotFound(f"no running request {request.request_id!r}")
        if route.replica is None:  # not forwarded yet
            route.aborted = True
            return pb.AbortResponse()
        try:
            return await route.replica.stub.Abort(request, timeout=10.0, metadata=self.replicas.metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND and route.call is not None:
                # Forwarded, but the replica has not registered it yet: stop the stream here.
                route.aborted = True
                route.call.cancel()
                return pb.AbortResponse()
            raise error_from_rpc(err) or RuntimeError(f"{err.code().name}: {err.details()}") from None

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        for replica in self.replicas.routable():
            try:
                return await replica.stub.GetModelInfo(request, timeout=5.0, metadata=self.replicas.metadata)
            except grpc.RpcError:
                continue
        raise RouterUnavailable(NO_REPLICA)

    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.GetLoadResponse:
        """The fleet's: the routable replicas' loads added up, their mean KV usage."""
        up = self.replicas.routable()
        if not up:
            raise RouterUnavailable(NO_REPLICA)
        return pb.GetLoadResponse(
            num_waiting=sum(r.num_waiting for r in up),
            num_running=sum(r.num_running for r in up),
            kv_usage=sum(r.kv_usage for r in up) / len(up),
        )


# ----------------------------------------------------------------- serve
async def serve(config: ServiceConfig, credentials: Credentials | None = None) -> None:
    """Run until SIGTERM/SIGINT. `credentials.api_key`: what callers must present, and what the
    router presents to the replicas."""
    r = config.router
    if not r.replicas:
        raise ValueError("no replicas: give --replica HOST:PORT (one or more) or router.replicas")
    creds = credentials or Credentials()
    tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer) if r.policy == "prefix" else None
    index = PrefixIndex(config.kvcache.redis_url) if config.kvcache.redis_url and r.policy == "prefix" else None
    replicas = ReplicaSet.connect(r.replicas, r.poll_interval_s, r.down_after_s, metadata=call_metadata(creds.api_key))
    replicas.index = index
    metrics = RouterMetrics(replicas)
    servicer = RouterServicer(r, replicas, tokenizer, index, metrics)
    running = await start_server(
        r.address,
        [(pb_grpc.add_SchedulerServiceServicer_to_server, servicer, SERVICE_NAME)],
        options=[("grpc.max_receive_message_length", r.max_request_bytes)],
        auth_token=creds.api_key,
        public=True,
    )
    listening = [f"gRPC {running.address}"]
    if r.metrics_port:
        try:
            listening.append(f"metrics {metrics.serve(r.metrics_port, running.address.rpartition(':')[0].strip('[]'))}")
        except OSError:
            await running.server.stop(None)
            raise

    async def routable(any_up: bool) -> None:
        await running.set_serving(any_up)

    replicas.on_change = routable
    polling = asyncio.ensure_future(replicas.run())
    freeze_heap()
    announce(f"router ready: {', '.join(listening)}; replicas {', '.join(r.replicas)} (policy {r.policy})")
    await stop_event().wait()
    servicer.draining = True  # new requests refused; the streams in flight go on, bounded
    await running.set_serving(False)
    deadline = time.monotonic() + r.drain_timeout_s
    while servicer.routes and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    polling.cancel()
    await running.server.stop(grace=1)
    await replicas.close()
    if index is not None:
        await index.close()
