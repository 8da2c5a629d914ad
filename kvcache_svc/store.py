"""The KV-cache metadata store: in memory (nothing to persist), or Redis.

With Redis every step's changes (the blocks and tables it touched, the prefix counters, the
step number and the step's answer) go out in one pipelined MULTI/EXEC before the step is
answered, so whatever the scheduler was told survives a crash of this service.

Layout, under `picovllm:{deployment}:kv:`
    meta            hash: version, config (JSON), step, order, prefix counters, evictions
    result          the last step's ApplyStepResponse, serialized
    seqs            hash: seq id -> [tier, block_ids, extra_key, num_hashed_blocks, last_hash]
    blocks:{tier}   hash: block id -> [ref_count, hash, token_ids]  (blocks that are not free)
    free:{tier}     sorted set: free block ids, scored in queue order
    lru:{tier}      sorted set: cached-unreferenced block ids, least recently used first

The free list and the LRU only ever grow at the tail, so a block that a step released is
given the next value of a persistent counter (`order`): sorting by score restores both
queues exactly. redis-py is imported only when a Redis URL is given.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

from kvcache_svc.block_pool import Tier
from kvcache_svc.manager import KVCacheManager
from kvcache_svc.ops import PoolConfig
from kvcache_svc.state import BlockRecord, KVState, PoolSnapshot, SeqSnapshot, TrackedBlockPool

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"


class MemoryStore:
    """Keeps nothing beyond the manager itself: a restart starts empty."""

    kind = "memory"
    persistent = False  # write_full/write_step are no-ops

    def load(self) -> tuple[KVState, bytes | None] | None:
        return None

    def write_full(self, state: KVState, result: bytes | None) -> None:
        pass

    def write_step(self, manager: KVCacheManager, step: int, dirty_seqs: set[str], result: bytes) -> None:
        pass

    def ping(self) -> None:
        pass

    def close(self) -> None:
        pass


class RedisStore:
    kind = "redis"
    persistent = True

    def __init__(self, url: str, deployment: str = "default", client: Any = None) -> None:
        if client is None:
            import redis  # only needed when a Redis URL is configured

            client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.redis = client
        self.prefix = f"picovllm:{deployment}:kv:"
        self.order = 0  # next free/LRU queue score

    def _key(self, name: str) -> str:
        return self.prefix + name

    def ping(self) -> None:
        """Raises when Redis does not answer (within the client's socket timeout)."""
        self.redis.ping()

    def _keys(self) -> list[str]:
        names = ["meta", "result", "seqs"] + [f"{k}:{int(t)}" for k in ("blocks", "free", "lru") for t in Tier]
        return [self._key(n) for n in names]

    # ----------------------------------------------------------------- load
    def load(self) -> tuple[KVState, bytes | None] | None:
        """The stored state, or None when there is none (or it is of another format)."""
        meta = {k.decode(): v.decode() for k, v in self.redis.hgetall(self._key("meta")).items()}
        if not meta:
            return None
        if meta.get("version") != FORMAT_VERSION:
            logger.warning("ignoring KV metadata of format %r (expected %s)", meta.get("version"), FORMAT_VERSION)
            return None
        self.order = int(meta.get("order", 0))
        step = int(meta.get("step", 0))
        if "config" not in meta:
            return KVState(None, step), None
        config = PoolConfig(**json.loads(meta["config"]))
        pools = {
            t: self._load_pool(t, n, int(meta.get(f"evictions:{int(t)}", 0)))
            for t, n in ((Tier.DEVICE, config.num_device_blocks), (Tier.HOST, config.num_host_blocks))
        }
        seqs = [_seq_from_json(k.decode(), v) for k, v in self.redis.hgetall(self._key("seqs")).items()]
        state = KVState(
            config,
            step,
            pools[Tier.DEVICE],
            pools[Tier.HOST],
            seqs,
            int(meta.get("num_prefix_queries", 0)),
            int(meta.get("num_prefix_hits", 0)),
        )
        return state, self.redis.get(self._key("result"))

    def _load_pool(self, tier: Tier, num_blocks: int, num_evictions: int) -> PoolSnapshot:
        t = int(tier)
        blocks = []
        for k, v in self.redis.hgetall(self._key(f"blocks:{t}")).items():
            ref, block_hash, tokens = json.loads(v)
            blocks.append(BlockRecord(int(k), ref, block_hash, tuple(tokens) if tokens is not None else None))
        free = [int(b) for b in self.redis.zrange(self._key(f"free:{t}"), 0, -1)]
        lru = [int(b) for b in self.redis.zrange(self._key(f"lru:{t}"), 0, -1)]
        return PoolSnapshot(num_blocks, blocks, free, lru, num_evictions)

    # ----------------------------------------------------------------- write
    def write_full(self, state: KVState, result: bytes | None) -> None:
        """Replace everything (after a reset or a reload that had to start over)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(*self._keys())
        meta: dict[str, Any] = {
            "version": FORMAT_VERSION,
            "step": state.step,
            "num_prefix_queries": state.num_prefix_queries,
            "num_prefix_hits": state.num_prefix_hits,
        }
        if state.config is not None and state.device is not None and state.host is not None:
            meta["config"] = json.dumps(_config_dict(state.config))
            for tier, snap in ((Tier.DEVICE, state.device), (Tier.HOST, state.host)):
                self._write_pool_full(pipe, tier, snap)
                meta[f"evictions:{int(tier)}"] = snap.num_evictions
            if state.seqs:
                pipe.hset(self._key("seqs"), mapping={s.seq_id: _seq_to_json(s) for s in state.seqs})
        meta["order"] = self.order
        pipe.hset(self._key("meta"), mapping=meta)
        if result is not None:
            pipe.set(self._key("result"), result)
        pipe.execute()

    def _write_pool_full(self, pipe: Any, tier: Tier, snap: PoolSnapshot) -> None:
        t = int(tier)
        if snap.blocks:
            pipe.hset(
                self._key(f"blocks:{t}"),
                mapping={b.block_id: _block_json(b.ref_count, b.block_hash, b.token_ids) for b in snap.blocks},
            )
        for name, ids in (("free", snap.free_ids), ("lru", snap.lru_ids)):
            if ids:
                pipe.zadd(self._key(f"{name}:{t}"), dict(zip(ids, itertools.count(self.order))))
                self.order += len(ids)

    def write_step(self, manager: KVCacheManager, step: int, dirty_seqs: set[str], result: bytes) -> None:
        """One MULTI/EXEC with the blocks and tables this step touched."""
        pipe = self.redis.pipeline(transaction=True)
        meta: dict[str, Any] = {
            "step": step,
            "num_prefix_queries": manager.num_prefix_queries,
            "num_prefix_hits": manager.num_prefix_hits,
        }
        for tier, pool in manager.pools.items():
            assert isinstance(pool, TrackedBlockPool), "the service's pools track their changes"
            if pool.dirty:
                self._write_dirty_blocks(pipe, tier, pool)
                meta[f"evictions:{int(tier)}"] = pool.num_evictions
        gone = [s for s in dirty_seqs if s not in manager.seqs]
        live = {
            s: _seq_to_json(SeqSnapshot(s, q.tier, q.block_ids, q.extra_key, q.num_hashed_blocks, q.last_hash))
            for s in dirty_seqs
            if (q := manager.seqs.get(s)) is not None
        }
        if gone:
            pipe.hdel(self._key("seqs"), *gone)
        if live:
            pipe.hset(self._key("seqs"), mapping=live)
        meta["order"] = self.order
        pipe.hset(self._key("meta"), mapping=meta)
        pipe.set(self._key("result"), result)
        pipe.execute()

    def _write_dirty_blocks(self, pipe: Any, tier: Tier, pool: TrackedBlockPool) -> None:
        t = int(tier)
        blocks = pool.blocks
        used = {
            b: _block_json(blocks[b].ref_count, blocks[b].block_hash, blocks[b].token_ids)
            for b in pool.dirty
            if blocks[b].ref_count > 0 or blocks[b].block_hash is not None
        }
        free_ids = [b for b in pool.dirty if b not in used]
        num_cached = sum(1 for b in used if blocks[b].ref_count == 0)
        # Every touched block that is free (cached) now was released this step: it sits at
        # the tail of its queue, in release order.
        free_tail = list(itertools.islice(reversed(pool.free_ids), len(free_ids)))[::-1]
        lru_tail = list(itertools.islice(reversed(pool.lru), num_cached))[::-1]
        assert set(free_tail) == set(free_ids) and len(lru_tail) == num_cached, (
            "a released block is not at its queue's tail"
        )
        dirty = list(pool.dirty)
        pipe.zrem(self._key(f"free:{t}"), *dirty)
        pipe.zrem(self._key(f"lru:{t}"), *dirty)
        if free_ids:
            pipe.hdel(self._key(f"blocks:{t}"), *free_ids)
        if used:
            pipe.hset(self._key(f"blocks:{t}"), mapping=used)
        for name, tail in (("free", free_tail), ("lru", lru_tail)):
            if tail:
                pipe.zadd(self._key(f"{name}:{t}"), dict(zip(tail, itertools.count(self.order))))
                self.order += len(tail)

    def clear(self) -> None:
        self.redis.delete(*self._keys())

    def close(self) -> None:
        self.redis.close()


def clear_dirty(manager: KVCacheManager) -> None:
    for pool in manager.pools.values():
        if isinstance(pool, TrackedBlockPool):
            pool.dirty.clear()


def _config_dict(c: PoolConfig) -> dict[str, Any]:
    return {
        "num_device_blocks": c.num_device_blocks,
        "num_host_blocks": c.num_host_blocks,
        "block_size": c.block_size,
        "enable_prefix_caching": c.enable_prefix_caching,
        "epoch": c.epoch,
        "group_windows": list(c.group_windows),
    }


def _block_json(ref: int, block_hash: int | None, tokens: tuple[int, ...] | None) -> str:
    return json.dumps([ref, block_hash, list(tokens) if tokens is not None else None])


def _seq_to_json(s: SeqSnapshot) -> str:
    return json.dumps([int(s.tier), s.block_ids, s.extra_key, s.num_hashed_blocks, s.last_hash])


def _seq_from_json(seq_id: str, raw: bytes) -> SeqSnapshot:
    tier, block_ids, extra_key, num_hashed, last_hash = json.loads(raw)
    return SeqSnapshot(seq_id, Tier(tier), block_ids, extra_key, num_hashed, last_hash)


def open_store(redis_url: str | None, deployment: str = "default") -> MemoryStore | RedisStore:
    return RedisStore(redis_url, deployment) if redis_url else MemoryStore()
