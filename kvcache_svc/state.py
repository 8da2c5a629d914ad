"""The KV-cache state as plain data (export / import), and a block pool that remembers which
blocks a step touched (so the metadata store writes only those).

The free list and the LRU are queues whose order decides which block the next allocation
gets, so they are exported in order: importing an export gives a manager that answers every
later operation exactly as the original would.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvcache_svc.block_pool import Block, BlockPool, Tier
from kvcache_svc.manager import KVCacheManager, SeqBlocks
from kvcache_svc.ops import PoolConfig


@dataclass(slots=True)
class BlockRecord:
    """A block that is not free: referenced, or cached with a hash."""

    block_id: int
    ref_count: int
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class PoolSnapshot:
    num_blocks: int
    blocks: list[BlockRecord] = field(default_factory=list)
    free_ids: list[int] = field(default_factory=list)  # allocation order
    lru_ids: list[int] = field(default_factory=list)  # least recently used first
    num_evictions: int = 0


@dataclass(slots=True)
class SeqSnapshot:
    seq_id: str
    tier: Tier
    block_ids: list[int]
    extra_key: str | None = None
    num_hashed_blocks: int = 0
    last_hash: int | None = None


@dataclass(slots=True)
class KVState:
    config: PoolConfig | None  # None: never reset (no pools yet)
    step: int = 0
    device: PoolSnapshot | None = None
    host: PoolSnapshot | None = None
    seqs: list[SeqSnapshot] = field(default_factory=list)
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0


class TrackedBlockPool(BlockPool):
    """A BlockPool that adds every block id it changes to `dirty`, and, while `hash_log` is a
    dict (the prefix index is published: kvcache_svc.index), every hash that enters (True) or
    leaves (False) its index, the last change of each hash winning."""

    def __init__(self, num_blocks: int, tier: Tier) -> None:
        super().__init__(num_blocks, tier)
        self.dirty: set[int] = set()
        self.hash_log: dict[int, bool] | None = None

    def allocate(self, num: int) -> list[int]:
        ids = super().allocate(num)
        self.dirty.update(ids)
        return ids

    def acquire(self, block_id: int) -> None:
        super().acquire(block_id)
        self.dirty.add(block_id)

    def acquire_all(self, block_ids: list[int]) -> None:
        super().acquire_all(block_ids)
        self.dirty.update(block_ids)

    def release(self, block_id: int) -> None:
        super().release(block_id)
        self.dirty.add(block_id)

    def set_hash(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        changed = super().set_hash(block_id, block_hash, token_ids)
        self.dirty.add(block_id)
        if changed and self.hash_log is not None:
            self.hash_log[block_hash] = True
        return changed

    def _drop_hash(self, block: Block) -> None:
        if self.hash_log is not None and block.block_hash is not None:
            self.hash_log[block.block_hash] = False
        super()._drop_hash(block)


def new_manager(config: PoolConfig, tracked: bool = False) -> KVCacheManager:
    manager = config.new_manager()
    if tracked:
        manager.pools = {tier: TrackedBlockPool(pool.num_blocks, tier) for tier, pool in manager.pools.items()}
    return manager


# ----------------------------------------------------------------- export
def export_pool(pool: BlockPool) -> PoolSnapshot:
    records = [
        BlockRecord(b.block_id, b.ref_count, b.block_hash, b.token_ids)
        for b in pool.blocks
        if b.ref_count > 0 or b.block_hash is not None
    ]
    return PoolSnapshot(pool.num_blocks, records, list(pool.free_ids), list(pool.lru), pool.num_evictions)


def export_seq(seq_id: str, seq: SeqBlocks) -> SeqSnapshot:
    return SeqSnapshot(seq_id, seq.tier, list(seq.block_ids), seq.extra_key, seq.num_hashed_blocks, seq.last_hash)


def export_state(manager: KVCacheManager | None, config: PoolConfig | None, step: int) -> KVState:
    if manager is None or config is None:
        return KVState(None, step)
    return KVState(
        config,
        step,
        export_pool(manager.device),
        export_pool(manager.host),
        [export_seq(seq_id, seq) for seq_id, seq in manager.seqs.items()],
        manager.num_prefix_queries,
        manager.num_prefix_hits,
    )


# ----------------------------------------------------------------- import
def import_pool(pool: BlockPool, snap: PoolSnapshot) -> None:
    if snap.num_blocks != pool.num_blocks:
        raise ValueError(f"{pool.tier.name} pool has {pool.num_blocks} blocks, the snapshot {snap.num_blocks}")
    for rec in snap.blocks:
        block = pool.blocks[rec.block_id]
        block.ref_count = rec.ref_count
        if rec.block_hash is not None:
            block.block_hash, block.token_ids = rec.block_hash, tuple(rec.token_ids or ())
            pool.hash_to_block[rec.block_hash] = rec.block_id
    pool.free_ids = deque(snap.free_ids)
    pool.lru = OrderedDict.fromkeys(snap.lru_ids)
    pool.num_evictions = snap.num_evictions


def import_state(state: KVState, tracked: bool = False) -> KVCacheManager:
    """A manager equal to the exported one; raises ValueError when the state is not
    consistent (the pools' invariant must hold)."""
    if state.config is None or state.device is None or state.host is None:
        raise ValueError("the state has no pools")
    manager = new_manager(state.config, tracked)
    import_pool(manager.device, state.device)
    import_pool(manager.host, state.host)
    for s in state.seqs:
        manager.seqs[s.seq_id] = SeqBlocks(s.tier, list(s.block_ids), s.extra_key, s.num_hashed_blocks, s.last_hash)
    manager.num_prefix_queries, manager.num_prefix_hits = state.num_prefix_queries, state.num_prefix_hits
    try:
        manager.check_invariants()
    except (AssertionError, KeyError, IndexError) as exc:
        raise ValueError(f"inconsistent KV-cache state: {exc}") from None
    return manager
