"""The router's replicas: their health, load and identity, and the routing policy.

Each replica is asked GetLoad every `poll_interval_s` (and GetModelInfo once, for its block
size): an answer makes it up; one that has not answered for `down_after_s` (or whose
Generate could not be reached) is taken out until it answers again. A replica that
publishes a prefix index (GetLoad names its replica id) is routed to only while its
heartbeat in Redis is current; while Redis does not answer, every replica that is up is
routed to by load alone.

The policy (`choose`), given each candidate's prefix hit in blocks:
    prefix       the longest hit, unless its replica has more than `max_imbalance` requests
                 (waiting + running) beyond the least loaded one: then the least loaded;
                 ties go round the replicas in turn; a replica whose KV pool is full is
                 passed over while another is not
    round_robin  each replica in turn (the baseline)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

import grpc

from contracts.rpc import CHANNEL_OPTIONS
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from router_svc.index import PrefixIndex, RecentRoutes

logger = logging.getLogger(__name__)

KV_FULL = 0.98  # a replica whose device pool is this full takes no prefix-routed request


@dataclass(slots=True)
class Replica:
    address: str
    stub: pb_grpc.SchedulerServiceStub
    channel: grpc.aio.Channel
    up: bool = False
    last_answer: float = float("-inf")  # time.monotonic() of its last GetLoad answer
    replica_id: str = ""  # its prefix index's name ("" = it publishes none)
    block_size: int = 0  # 0 until GetModelInfo answered
    alive: bool = False  # its prefix-index heartbeat is current
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0  # requests this router has on it now
    why: str = ""  # why it is down

    @property
    def load(self) -> int:
        """Requests on it: what it said, or what this router sent it since, if more."""
        return max(self.in_flight, self.num_waiting + self.num_running)


def choose(candidates: Sequence[Replica], hits: dict[str, int], policy: str, max_imbalance: int, turn: int) -> Replica:
    """The replica for one request. hits: address -> leading prefix blocks held; turn: a
    counter that rotates ties (and round_robin)."""
    if policy == "round_robin":
        return candidates[turn % len(candidates)]
    roomy = [r for r in candidates if r.kv_usage < KV_FULL] or list(candidates)
    least = min(r.load for r in roomy)
    idle = [r for r in roomy if r.load == least]
    best = max(roomy, key=lambda r: (hits.get(r.address, 0), -r.load, -r.kv_usage))
    if hits.get(best.address, 0) == 0 or best.load - least > max_imbalance:
        return idle[turn % len(idle)]
    return best


@dataclass(slots=True)
class ReplicaSet:
    replicas: list[Replica]
    poll_interval_s: float
    down_after_s: float
    metadata: tuple[tuple[str, str], ...] = ()
    index: PrefixIndex | None = None
    on_change: Callable[[bool], Awaitable[None]] | None = None  # awaited when "any routable" flips
    index_ok: bool = False  # Redis answered the last heartbeat read
    recent: RecentRoutes = field(default_factory=RecentRoutes)  # forgotten for a replica that goes down
    _turn: itertools.count = field(default_factory=itertools.count)
    _routable: bool = False

    @classmethod
    def connect(cls, addresses: Sequence[str], poll_interval_s: float, down_after_s: float, **kwargs) -> ReplicaSet:
        replicas = []
        for address in addresses:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            replicas.append(Replica(address, pb_grpc.SchedulerServiceStub(channel), channel))
        return cls(replicas, poll_interval_s, down_after_s, **kwargs)

    def routable(self, exclude: Collection[str] = ()) -> list[Replica]:
        """The replicas a request may go to now, but those in `exclude` (addresses)."""
        up = [r for r in self.replicas if r.up and r.block_size and r.address not in exclude]
        if not self.index_ok:
            return up
        return [r for r in up if not r.replica_id or r.alive]

    def next_turn(self) -> int:
        return next(self._turn)

    def take_out(self, replica: Replica, why: str) -> None:
        """A replica whose Generate could not be reached: out until its next answer."""
        if replica.up:
            logger.warning("replica %s taken out: %s", replica.address, why)
        replica.up, replica.why = False, why
        self.recent.forget(replica.address)  # what it held may be gone with it

    async def poll(self) -> None:
        """One round: every replica's load, then the heartbeats."""
        await asyncio.gather(*(self._poll_one(r) for r in self.replicas))
        if self.index is not None:
            ids = [r.replica_id for r in self.replicas if r.replica_id]
            try:
                alive = await self.index.alive(ids) if ids else {}
                self.index_ok = True
            except Exception as exc:  # noqa: BLE001 - Redis down: route by load alone
                if self.index_ok:
                    logger.warning("prefix index unreachable (%s): routing by load alone", exc)
                self.index_ok, alive = False, {}
            for r in self.replicas:
                r.alive = alive.get(r.replica_id, False)
        routable = bool(self.routable())
        if routable != self._routable:
            self._routable = routable
            if self.on_change is not None:
                await self.on_change(routable)

    async def _poll_one(self, r: Replica) -> None:
        timeout = max(0.2, min(1.0, 2 * self.poll_interval_s))
        now = time.monotonic()
        try:
            load = await r.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout, metadata=self.metadata)
            if not r.block_size:
                info = await r.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)
                r.block_size = info.block_size
        except grpc.RpcError as err:
            r.why = f"{err.code().name}: {err.details()}"
            if r.up and now - r.last_answer >= self.down_after_s:
                logger.warning("replica %s is down: %s", r.address, r.why)
                r.up = False
                self.recent.forget(r.address)
            return
        if not r.up:
            logger.warning("replica %s is up (replica id %r)", r.address, load.replica_id)
        r.up, r.last_answer, r.why = True, now, ""
        r.replica_id, r.num_waiting, r.num_running, r.kv_usage = (
            load.replica_id,
            load.num_waiting,
            load.num_running,
            load.kv_usage,
        )

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll()
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    async def close(self) -> None:
        for r in self.replicas:
            await r.channel.close()
