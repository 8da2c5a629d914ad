"""The router's side of the prefix index: which replica holds how much of a prompt.

Two sources, merged per replica by taking the longer run:
    Redis   the hashes each replica's KV-cache service published (kvcache_svc.index; key
            layout in contracts.block_hash): one pipelined round trip per request, one
            SMISMEMBER per replica, no call to any replica.
    recent  the hashes of prompts this router sent to each replica in the last RECENT_S
            seconds: the replica computes and publishes a prompt's blocks only after its
            prefill, and a second request of the same tenant often arrives before that.
Chained hashes mean that a replica holding block i's hash held the whole prefix up to i
when it published, so a prefix hit is the run of leading hashes held. Either source can be
stale (an entry for a block since evicted): the cost is one request routed to a replica
that must compute that prefix after all, never a wrong answer (the replica verifies tokens).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from contracts.block_hash import index_keys

RECENT_S = 10.0  # how long a routed prompt's blocks count as held by its replica
RECENT_MAX = 200_000  # hashes remembered per replica, at most


def leading(flags: list[Any]) -> int:
    """How many of `flags` are true before the first false one."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)


class RecentRoutes:
    """Hashes of prompts recently routed, per replica (its address), expiring after RECENT_S."""

    def __init__(self, ttl_s: float = RECENT_S, max_entries: int = RECENT_MAX) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._held: dict[str, OrderedDict[int, float]] = {}

    def add(self, replica: str, hashes: list[int], now: float | None = None) -> None:
        held = self._held.setdefault(replica, OrderedDict())
        expires = (time.monotonic() if now is None else now) + self.ttl_s
        for h in hashes:
            held[h] = expires
            held.move_to_end(h)
        while len(held) > self.max_entries:
            held.popitem(last=False)

    def hits(self, replica: str, hashes: list[int], now: float | None = None) -> int:
        held = self._held.get(replica)
        if not held:
            return 0
        now = time.monotonic() if now is None else now
        while held and next(iter(held.values())) <= now:  # oldest first: drop what expired
            held.popitem(last=False)
        return leading([held.get(h, 0.0) > now for h in hashes])

    def forget(self, replica: str) -> None:
        self._held.pop(replica, None)


class PrefixIndex:
    """The published index in Redis (redis.asyncio: never blocks the router's event loop)."""

    def __init__(self, url: str, client: Any = None) -> None:
        if client is None:
            import redis.asyncio

            client = redis.asyncio.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        self.redis = client

    async def alive(self, replica_ids: list[str]) -> dict[str, bool]:
        """Whose heartbeat is current. Raises when Redis does not answer."""
        pipe = self.redis.pipeline(transaction=False)
        for replica_id in replica_ids:
            pipe.exists(index_keys(replica_id)[1])
        return {rid: bool(n) for rid, n in zip(replica_ids, await pipe.execute())}

    async def hits(self, replica_ids: list[str], hashes: list[int]) -> dict[str, int]:
        """Leading blocks of `hashes` each replica published. Raises when Redis does not answer."""
        if not hashes or not replica_ids:
            return dict.fromkeys(replica_ids, 0)
        pipe = self.redis.pipeline(transaction=False)
        for replica_id in replica_ids:
            pipe.smismember(index_keys(replica_id)[0], hashes)
        return {rid: leading(flags) for rid, flags in zip(replica_ids, await pipe.execute())}

    async def close(self) -> None:
        await self.redis.aclose()
