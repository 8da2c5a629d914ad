"""The KV-cache gRPC service (picovllm.kvcache.v1): a thin servicer over KVCacheService.

Start-up reloads the metadata store (Redis) before health turns SERVING; afterwards health
follows the store (NOT_SERVING while Redis does not answer its pings). The service is driven
by one scheduler; calls are handled one at a time on the event loop. With a token, every
call but health and reflection must present it (contracts.auth). With
`publish_prefixes`, the device pool's block hashes go to Redis for a router
(kvcache_svc.index).
"""

from __future__ import annotations

import asyncio
import logging

from contracts.rpc import announce, freeze_heap, start_server, stop_event
from contracts.service_config import KVCacheSection
from kvcache_svc import convert
from kvcache_svc.index import PrefixPublisher
from kvcache_svc.service import KVCacheService
from kvcache_svc.store import open_store
from protos.picovllm.kvcache.v1 import kvcache_pb2 as pb
from protos.picovllm.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCacheService"].full_name


class KVCacheServicer(pb_grpc.KVCacheServiceServicer):
    def __init__(self, service: KVCacheService) -> None:
        self.service = service

    async def ApplyStep(self, request: pb.ApplyStepRequest, context) -> pb.ApplyStepResponse:
        results = self.service.apply_step(request.step, convert.ops_from_pb(request.ops))
        return self.service.response(request.step, results)  # the persisted message: not converted twice

    async def GetState(self, request: pb.GetStateRequest, context) -> pb.GetStateResponse:
        return pb.GetStateResponse(state=convert.state_to_pb(self.service.get_state()))

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        i = self.service.info()
        resp = pb.GetInfoResponse(
            step=i.step,
            num_free_device_blocks=i.num_free_device_blocks,
            num_free_host_blocks=i.num_free_host_blocks,
            num_seqs=i.num_seqs,
            store=i.store,
            num_prefix_queries=i.num_prefix_queries,
            num_prefix_hits=i.num_prefix_hits,
            all_free_or_cached=i.all_free_or_cached,
        )
        if i.config is not None:
            resp.config.CopyFrom(convert.config_to_pb(i.config))
        return resp

    async def CheckInvariants(self, request: pb.CheckInvariantsRequest, context) -> pb.CheckInvariantsResponse:
        error = self.service.check_invariants()
        return pb.CheckInvariantsResponse(ok=error is None, error=error or "")


STORE_PING_INTERVAL_S = 1.0


async def _follow_store(service: KVCacheService, running) -> None:
    """Health NOT_SERVING while the metadata store does not answer, SERVING once it does."""
    healthy = True
    while True:
        await asyncio.sleep(STORE_PING_INTERVAL_S)
        try:
            await asyncio.to_thread(service.store.ping)  # a blocking client: off the event loop
            now_healthy = True
        except Exception as exc:  # noqa: BLE001 - any failure to answer
            now_healthy, why = False, exc
        if now_healthy != healthy:
            if now_healthy:
                logger.warning("metadata store answers again: serving")
            else:
                logger.warning("metadata store not answering (%s): not serving", why)
            healthy = now_healthy
            await running.set_serving(healthy)


async def serve(config: KVCacheSection, ready: asyncio.Event | None = None, token: str | None = None) -> None:
    """Run until SIGTERM/SIGINT. `token`: the internal token callers must present."""
    if config.publish_prefixes and not config.redis_url:
        raise ValueError("kvcache.publish_prefixes needs a Redis URL (the Redis the router reads)")
    service = KVCacheService(open_store(config.redis_url, config.deployment))
    running = await start_server(
        config.address,
        [(pb_grpc.add_KVCacheServiceServicer_to_server, KVCacheServicer(service), SERVICE_NAME)],
        auth_token=token,
    )
    stop = stop_event()
    while True:  # Redis may come up after us: keep trying, NOT_SERVING meanwhile
        try:
            service.load()
            break
        except Exception as exc:  # noqa: BLE001
            logger.warning("metadata store not reachable (%s); retrying", exc)
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
                return await running.server.stop(None)
            except asyncio.TimeoutError:
                pass
    freeze_heap()  # start-up is done: full collections would walk it every few dozen steps
    await running.set_serving(True)
    announce(f"kvcache service ready: gRPC {running.address} (store: {service.store.kind})")
    if ready is not None:
        ready.set()
    follow = asyncio.ensure_future(_follow_store(service, running)) if service.store.persistent else None
    publisher = None
    if config.publish_prefixes and config.redis_url:  # checked above: the URL is there
        publisher = PrefixPublisher(service, config.redis_url, config.deployment)
        publishing = asyncio.ensure_future(publisher.run())
    await stop.wait()
    if follow is not None:
        follow.cancel()
    await running.set_serving(False)
    if publisher is not None:
        publishing.cancel()
        await asyncio.to_thread(publisher.withdraw)
    await running.server.stop(grace=5)
    service.store.close()
