"""PrefixPublisher: the KV-cache service's side of the router's prefix index.

It publishes which chain hashes the device pool holds (used or cached) to Redis, under this
replica's id (its deployment name; key layout in contracts.block_hash), with a heartbeat.
Off the step's path: a step only notes each hash that entered or left the index
(TrackedBlockPool.hash_log, a dict write per change); a task of this service takes what
gathered every FLUSH_S and writes it in one pipelined round trip on a thread, so a slow or
absent Redis never holds up a step. Whenever what Redis holds may differ from the pool (a
new or reloaded pool, a failed write, the set gone from Redis), the next write replaces
the set whole. On a clean stop the keys are deleted; after a crash they expire.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from contracts.block_hash import HEARTBEAT_S, INDEX_TTL_S, index_keys
from kvcache_svc.manager import KVCacheManager
from kvcache_svc.service import KVCacheService
from kvcache_svc.state import TrackedBlockPool

logger = logging.getLogger(__name__)

FLUSH_S = 0.05  # how often gathered changes are written
_CHUNK = 10_000  # members per SADD / SREM command


class PrefixPublisher:
    def __init__(self, service: KVCacheService, url: str, replica_id: str, client: Any = None) -> None:
        if client is None:
            import redis

            client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.service = service
        self.redis = client
        self.replica_id = replica_id
        self.blocks_key, self.alive_key = index_keys(replica_id)
        self._manager: KVCacheManager | None = None  # the manager whose device pool logs for us
        self._full = True  # the next write replaces the set whole
        self._failing = False

    def _pool(self) -> TrackedBlockPool | None:
        """The device pool to publish, logging its changes from now on."""
        manager = self.service.manager
        pool = None if manager is None else manager.device
        assert pool is None or isinstance(pool, TrackedBlockPool), "the service's pools track their changes"
        if manager is not self._manager:  # reset or reloaded: what Redis holds is another pool's
            self._manager, self._full = manager, True
            if pool is not None:
                pool.hash_log = {}
        return pool

    def take(self) -> tuple[bool, dict[int, bool]]:
        """(whole, changes): what to write now, taken on the event loop. whole: `changes` holds
        every hash of the pool and replaces the set."""
        pool = self._pool()
        full, self._full = self._full, False
        if pool is None:  # no pools (yet, or dropped): the set is emptied once
            return full, {}
        log, pool.hash_log = pool.hash_log or {}, {}
        return (True, dict.fromkeys(pool.hash_to_block, True)) if full else (False, log)

    def write(self, full: bool, changes: dict[int, bool]) -> bool:
        """One pipelined round trip (on a thread); False when the set was not in Redis (none
        held, or it was lost)."""
        pipe = self.redis.pipeline(transaction=full)
        added = [h for h, held in changes.items() if held]
        removed = [h for h, held in changes.items() if not held]
        if full:
            pipe.delete(self.blocks_key)
        for members, command in ((added, pipe.sadd), (removed, pipe.srem)):
            for i in range(0, len(members), _CHUNK):
                command(self.blocks_key, *members[i : i + _CHUNK])
        pipe.expire(self.blocks_key, int(INDEX_TTL_S))
        pipe.set(self.alive_key, json.dumps({"time": time.time()}), px=int(INDEX_TTL_S * 1000))
        return bool(pipe.execute()[-2])

    async def run(self) -> None:
        last_beat = 0.0
        while True:
            await asyncio.sleep(FLUSH_S)
            full, changes = self.take()
            now = time.monotonic()
            if not full and not changes and now - last_beat < HEARTBEAT_S:
                continue
            try:
                present = await asyncio.to_thread(self.write, full, changes)
            except Exception as exc:  # noqa: BLE001 - Redis down or slow: republish once it answers
                self._full = True
                if not self._failing:
                    logger.warning("prefix index not published (%s); retrying", exc)
                self._failing = True
                continue
            if self._failing:
                logger.warning("prefix index published again")
            self._failing, last_beat = False, now
            pool = self._pool()
            if not present and pool is not None and pool.hash_to_block:  # it expired or Redis lost it
                self._full = True

    def withdraw(self) -> None:
        """A clean stop: the router drops this replica now, not after the keys expire."""
        try:
            self.redis.delete(self.blocks_key, self.alive_key)
        except Exception as exc:  # noqa: BLE001 - they expire anyway
            logger.warning("prefix index not withdrawn (%s)", exc)
        self.redis.close()
