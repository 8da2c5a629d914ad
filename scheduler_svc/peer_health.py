"""The scheduler's watch on its peers, so that its health says what it can do and no request
waits without end on a peer that does not answer.

`PeerMonitor` asks the model and KV-cache services' grpc.health.v1 about once a second, each
probe with a short deadline: a peer that is frozen (SIGSTOP), partitioned away or blocked on
its own store does not refuse a call, it never answers one, and the engine's own calls may
then wait for their whole RPC timeout. A peer counts as unreachable from the first probe it
fails (or the first time the engine reports a step it could not run) until one succeeds
again. The scheduler's health is NOT_SERVING once that has lasted `down_after_s`, and its
requests end with UNAVAILABLE once it has lasted the dependency timeout (scheduler_svc.server).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from contracts import health
from contracts.rpc import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 1.0
_CHECK = f"/{health.SERVICE_NAME}/Check"


class PeerMonitor:
    """`peers`: name -> address. `engine_unavailable`: why the engine's last step could not
    reach a peer (None when it could). `on_change(down)`: awaited when `down` (unreachable
    for at least `down_after_s`) flips. Times are time.monotonic()."""

    def __init__(
        self,
        peers: dict[str, str],
        down_after_s: float,
        engine_unavailable: Callable[[], str | None] = lambda: None,
        on_change: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.peers = peers
        self.down_after_s = down_after_s
        self.engine_unavailable = engine_unavailable
        self.on_change = on_change
        self.failing_since: float | None = None  # start of the current stretch of failed probes
        self.why: str | None = None  # the last failure, for logs (it names internal addresses)
        self.down = False
        self._channels = {
            name: grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for name, address in peers.items()
        }

    def unreachable_for(self, now: float | None = None) -> float:
        """Seconds a peer has been unreachable without a break (0 when all answer)."""
        since = self.failing_since
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since

    async def probe(self) -> str | None:
        """Why a peer is unreachable now, or None when every one answers SERVING."""
        answers = await asyncio.gather(*(self._probe_one(name, channel) for name, channel in self._channels.items()))
        return next((why for why in answers if why is not None), None) or self.engine_unavailable()

    async def _probe_one(self, name: str, channel: grpc.aio.Channel) -> str | None:
        check = channel.unary_unary(
            _CHECK,
            request_serializer=health.HealthCheckRequest.SerializeToString,
            response_deserializer=health.HealthCheckResponse.FromString,
        )
        try:
            answer = await check(health.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as err:
            return f"{name} service at {self.peers[name]}: {err.code().name}"
        if answer.status != health.SERVING:
            return f"{name} service at {self.peers[name]}: not serving"
        return None

    async def record(self, why: str | None, started: float) -> None:
        """Take one probe's outcome (`started`: when it began)."""
        if why is None:
            if self.failing_since is not None:
                logger.warning("peers answer again after %.1f s", time.monotonic() - self.failing_since)
            self.failing_since, self.why = None, None
        else:
            if self.failing_since is None:
                logger.warning("peer unreachable: %s", why)
                self.failing_since = started
            self.why = why
        down = self.unreachable_for() >= self.down_after_s
        if down != self.down:
            self.down = down
            if down:
                logger.warning("not serving: %s", why)
            if self.on_change is not None:
                await self.on_change(down)

    async def run(self) -> None:
        """Probe until cancelled."""
        try:
            while True:
                started = time.monotonic()
                await self.record(await self.probe(), started)
                await asyncio.sleep(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - started)))
        finally:
            for channel in self._channels.values():
                await channel.close()
