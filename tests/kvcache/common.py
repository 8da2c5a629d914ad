"""Helpers shared by the KV-cache manager tests."""

from __future__ import annotations

from kvcache_svc import Allocated, KVCacheManager, Tier

BS = 4


def make(num_device: int = 16, num_host: int = 8, block_size: int = BS, **kw) -> KVCacheManager:
    return KVCacheManager(num_device, num_host, block_size, **kw)


def snapshot(mgr: KVCacheManager):
    """Everything observable about the manager's state, as plain comparable values."""
    pools = {}
    for tier, pool in mgr.pools.items():
        pools[tier] = (
            [(b.block_id, b.ref_count, b.block_hash, b.token_ids) for b in pool.blocks],
            list(pool.free_ids),
            list(pool.lru),
            dict(pool.hash_to_block),
            pool.num_evictions,
        )
    seqs = {
        sid: (s.tier, list(s.block_ids), s.extra_key, s.num_hashed_blocks, s.last_hash) for sid, s in mgr.seqs.items()
    }
    return pools, seqs, mgr.num_prefix_queries, mgr.num_prefix_hits


def run_prompt(mgr: KVCacheManager, seq_id: str, tokens: list[int], extra_key: str | None = None) -> Allocated:
    """Allocate a whole prompt, 'compute' it and register its full blocks."""
    res = mgr.allocate(seq_id, tokens, len(tokens), extra_key)
    assert isinstance(res, Allocated), res
    mgr.cache_blocks(seq_id, tokens, len(tokens))
    mgr.check_invariants()
    # A snapshot of the table: later operations on the sequence must not show through.
    return Allocated(res.num_cached_tokens, res.num_new_tokens, list(res.block_ids))


def refs(mgr: KVCacheManager, tier: Tier = Tier.DEVICE) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in mgr.pools[tier].blocks if b.ref_count}
