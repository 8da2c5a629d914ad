"""One pool of KV-cache block ids (device or host): ref counts, free list, prefix-hash index, LRU.

No torch here: a block is an id, a ref count and, once full and computed, a chained hash.
Every block is exactly one of
    free    ref 0, no hash, in `free_ids`
    used    ref > 0
    cached  ref 0, hashed, in `lru` (oldest first): reusable by a prefix hit until evicted

Operations check their arguments with real exceptions (BlockOpError), never `assert`: under
`python -O` a bad sequence of operations must still be refused before it changes anything,
not corrupt a block table. check() raises AssertionError for the same reason, explicitly.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass

# Values of BlockPool.hash_epoch, drawn from one counter: two pools' epochs never coincide.
_hash_epochs = itertools.count()


class BlockOpError(ValueError):
    """A block operation that does not apply to the current state (a bug in the caller, or
    ops replayed out of order); nothing was changed."""


def _require(condition: bool, message: str) -> None:
    """An invariant of check(): AssertionError, also under `python -O`."""
    if not condition:
        raise AssertionError(message)


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash: a hit compares tokens too


class BlockPool:
    def __init__(self, num_blocks: int, tier: Tier) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.tier = tier
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached-unreferenced, oldest first
        self.hash_to_block: dict[int, int] = {}
        self.hash_epoch = next(_hash_epochs)  # a new value whenever a hash leaves the index
        self.num_evictions = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def num_still_held(self, hashes: list[int], verified: list[tuple[int, tuple[int, ...]]], epoch: int) -> int:
        """How many leading (block id, token tuple) pairs of `verified` (an earlier lookup's
        hits) are still the cached blocks of `hashes`, with the very token tuples that lookup
        compared (identity, not a compare). epoch: hash_epoch when they were last known to
        hold; if no hash has left the index since, they all do (a burst of requests with one
        system prompt then walks none of its blocks)."""
        if epoch == self.hash_epoch:
            return len(verified)
        hash_to_block, blocks = self.hash_to_block, self.blocks
        for i, (block_hash, (block_id, token_ids)) in enumerate(zip(hashes, verified)):
            if hash_to_block.get(block_hash) != block_id or blocks[block_id].token_ids is not token_ids:
                return i
        return len(verified)

    # ----------------------------------------------------------------- mutations
    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks with ref 1: free ones first, then evict least recently used
        cached ones. The caller has checked num_free_blocks."""
        if not 0 <= num <= self.num_free_blocks:
            raise BlockOpError(f"cannot allocate {num} {self.tier.name} blocks: {self.num_free_blocks} are free")
        ids = []
        for _ in range(num):
            if self.free_ids:
                block_id = self.free_ids.popleft()
            else:
                block_id, _ = self.lru.popitem(last=False)
                self._drop_hash(self.blocks[block_id])
                self.num_evictions += 1
            self.blocks[block_id].ref_count = 1
            ids.append(block_id)
        return ids

    def acquire(self, block_id: int) -> None:
        """One more reference to an existing block (prefix hit or fork)."""
        block = self._block(block_id)
        if block.ref_count == 0:
            if block_id not in self.lru:
                raise BlockOpError(f"{self.tier.name} block {block_id} is free: it cannot be shared")
            del self.lru[block_id]  # a ref-0 block we may acquire is always a cached one
        block.ref_count += 1

    def acquire_all(self, block_ids: list[int]) -> None:
        """acquire() for each block (a prefix hit's run), in one call. A subclass that
        records the blocks it changes (kvcache_svc.state.TrackedBlockPool) overrides both."""
        blocks, lru = self.blocks, self.lru
        for block_id in block_ids:
            block = blocks[block_id]
            if block.ref_count == 0:
                del lru[block_id]
            block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self._block(block_id)
        if block.ref_count <= 0:
            raise BlockOpError(f"double free of {self.tier.name} block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self.lru[block_id] = None  # most recent at the end
            else:
                self.free_ids.append(block_id)

    def set_hash(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Register a full, computed block. False if another block already holds that hash
        (the first one stays the canonical copy; this one frees normally)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.hash_to_block:
            return False
        block.block_hash, block.token_ids = block_hash, token_ids
        self.hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (they become free); returns how many. Used blocks keep
        their hashes: they are live, and become cached as usual when released."""
        num = len(self.lru)
        for block_id in self.lru:
            self._drop_hash(self.blocks[block_id])
            self.free_ids.append(block_id)
        self.lru.clear()
        return num

    def _block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise BlockOpError(f"no {self.tier.name} block {block_id} (the pool has {self.num_blocks})")
        return self.blocks[block_id]

    def _drop_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.hash_to_block[block.block_hash]
            block.block_hash, block.token_ids = None, None
            self.hash_epoch = next(_hash_epochs)

    # ----------------------------------------------------------------- checks
    def check(self, referenced: dict[int, int]) -> None:
        """Invariant: every block exactly one of free/used/cached, and ref counts equal the
        number of table entries (`referenced`: block id -> count) pointing at each block."""
        free, cached = set(self.free_ids), set(self.lru)
        _require(len(free) == len(self.free_ids), "a block is twice in the free list")
        _require(not (free & cached), "a block is both free and cached")
        for block in self.blocks:
            refs = referenced.get(block.block_id, 0)
            _require(
                block.ref_count == refs,
                f"{self.tier.name} block {block.block_id}: ref {block.ref_count} but {refs} table entries",
            )
            is_free, is_cached, is_used = block.block_id in free, block.block_id in cached, block.ref_count > 0
            _require(
                is_free + is_cached + is_used == 1,
                f"{self.tier.name} block {block.block_id} in {is_free, is_cached, is_used}",
            )
            if is_free:
                _require(block.block_hash is None, f"free block {block.block_id} keeps a hash")
            if is_cached:
                _require(block.block_hash is not None, f"cached block {block.block_id} has no hash")
            if block.block_hash is not None:
                _require(
                    self.hash_to_block.get(block.block_hash) == block.block_id,
                    f"block {block.block_id}'s hash maps elsewhere",
                )
        _require(
            len(free) + len(cached) + sum(b.ref_count > 0 for b in self.blocks) == self.num_blocks,
            "the counts do not add up",
        )
        _require(
            len(self.hash_to_block) == sum(b.block_hash is not None for b in self.blocks),
            "the hash index and the blocks differ",
        )
