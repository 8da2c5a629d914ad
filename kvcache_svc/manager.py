"""KVCacheManager: the mechanism behind the scheduler's block decisions.

It owns the two pools, each sequence's block table (logical -> physical, with its tier) and
the prefix cache. It answers "can / cannot" and returns ids and copy lists; it never decides
who runs or who is preempted (that is the scheduler's policy). When blocks run short an
operation returns `NoFreeBlocks` and changes nothing; an operation that does not apply (an
unknown or duplicate sequence, the wrong tier, positions outside the table) raises
BlockOpError, also under `python -O`, and changes nothing either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from contracts import block_hash as hashing
from contracts.kv_groups import NO_BLOCK
from kvcache_svc.block_pool import BlockOpError, BlockPool, Tier
from kvcache_svc.prefix import PrefixHit, PrefixMatcher, first_in_window, group_key


@dataclass(slots=True, frozen=True)
class NoFreeBlocks:
    """Typed 'not enough blocks': how many were needed and how many the pool could give."""

    needed: int
    available: int
    tier: Tier = Tier.DEVICE


@dataclass(slots=True)
class Allocated:
    num_cached_tokens: int  # prompt tokens served from the prefix cache (not to be computed)
    num_new_tokens: int  # tokens to compute this step (clamped to what the prompt has left)
    block_ids: list[int]  # the whole table (group-minor)


@dataclass(slots=True)
class Appended:
    new_block_ids: list[int]  # added at the end of the table
    copies: list[tuple[int, int]] = field(default_factory=list)  # device (src, dst) copy-on-write
    replaced: list[tuple[int, int]] = field(default_factory=list)  # (table index, new block id)


@dataclass(slots=True)
class SeqBlocks:
    tier: Tier
    block_ids: list[int]  # group-minor (contracts.kv_groups); NO_BLOCK: out of a window
    extra_key: str | None = None
    num_hashed_blocks: int = 0  # leading full blocks whose chain hash is known
    last_hash: int | None = None  # chain hash of block num_hashed_blocks - 1


class KVCacheManager:
    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        group_windows: tuple[int, ...] = (0,),
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not group_windows or any(w < 0 for w in group_windows):
            raise ValueError(f"group_windows must be one window >= 0 per KV group, got {group_windows}")
        self.block_size = block_size
        self.windows = tuple(group_windows)  # per KV group: its sliding window (0: full)
        self.num_groups = len(self.windows)
        self.matcher = PrefixMatcher(block_size, self.windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = {
            Tier.DEVICE: BlockPool(num_device_blocks, Tier.DEVICE),
            Tier.HOST: BlockPool(num_host_blocks, Tier.HOST),
        }
        self.seqs: dict[str, SeqBlocks] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of those, tokens served from the cache

    # ----------------------------------------------------------------- queries
    @property
    def device(self) -> BlockPool:
        return self.pools[Tier.DEVICE]

    @property
    def host(self) -> BlockPool:
        return self.pools[Tier.HOST]

    def num_free_blocks(self, tier: Tier = Tier.DEVICE) -> int:
        return self.pools[tier].num_free_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self.seqs[seq_id].block_ids

    def tier(self, seq_id: str) -> Tier:
        return self.seqs[seq_id].tier

    def _seq(self, seq_id: str, tier: Tier | None = None) -> SeqBlocks:
        """The sequence, on `tier` if given; BlockOpError otherwise."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise BlockOpError(f"no sequence {seq_id!r}")
        if tier is not None and seq.tier != tier:
            raise BlockOpError(f"sequence {seq_id!r} is on {seq.tier.name}, not {tier.name}")
        return seq

    def _new_seq_id(self, seq_id: str) -> None:
        if seq_id in self.seqs:
            raise BlockOpError(f"sequence {seq_id!r} already has blocks")

    def num_blocks_for(self, num_tokens: int) -> int:
        """Logical blocks (table entries per group) that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_to_hold(self, num_tokens: int) -> int:
        """Device blocks a sequence of `num_tokens` tokens holds to compute its last one: every
        block for a full group, those of the window for a sliding group."""
        bs, last = self.block_size, num_tokens - 1
        return sum(last // bs + 1 - first_in_window(last, w, bs) for w in self.windows)

    def num_live_blocks(self, seq_id: str) -> int:
        """Blocks a sequence's tables hold (what a swap moves)."""
        block_ids = self._seq(seq_id).block_ids
        return len(block_ids) - block_ids.count(NO_BLOCK)

    def blocks_to_resume(self, seq_id: str, num_tokens: int) -> int:
        """Device blocks a swapped-out sequence takes to come back and grow to `num_tokens`."""
        grow = max(0, self.num_blocks_for(num_tokens) - len(self._seq(seq_id).block_ids) // self.num_groups)
        return self.num_live_blocks(seq_id) + grow * self.num_groups

    def max_tokens(self, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose blocks fit in the device pool."""
        lo, hi = 0, limit  # blocks_to_hold grows with the length: the last length that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.blocks_to_hold(mid) <= self.device.num_blocks else (lo, mid - 1)
        return lo

    def match_prefix(
        self, token_ids: list[int], extra_key: str | None = None, token_bytes: bytes | None = None
    ) -> PrefixHit:
        """Longest cached prefix of the prompt that every group can serve (kvcache_svc.prefix).
        token_bytes: the same tokens as int64 bytes when the caller has them (the engine's
        check of a prompt makes them), so that they are not converted again."""
        return self._match(token_ids, extra_key, token_bytes)[0]

    def _match(
        self, token_ids: list[int], extra_key: str | None, token_bytes: bytes | None
    ) -> tuple[PrefixHit, int | None]:
        if not self.enable_prefix_caching:
            return PrefixHit(0, []), None
        return self.matcher.match(self.device, token_ids, extra_key, token_bytes)

    # ----------------------------------------------------------------- operations
    def allocate(
        self,
        seq_id: str,
        token_ids: list[int],
        num_new_tokens: int,
        extra_key: str | None = None,
        token_bytes: bytes | None = None,
    ) -> Allocated | NoFreeBlocks:
        """New sequence: take its longest cached prefix, then blocks for `num_new_tokens`
        more tokens (clamped to the rest of the prompt) in every group. token_bytes: see
        match_prefix."""
        self._new_seq_id(seq_id)
        hit, last_hash = self._match(token_ids, extra_key, token_bytes)
        num_new_tokens = max(1, min(num_new_tokens, len(token_ids) - hit.num_tokens))
        num_hit_blocks = hit.num_tokens // self.block_size
        num_needed = (self.num_blocks_for(hit.num_tokens + num_new_tokens) - num_hit_blocks) * self.num_groups
        taken = hit.block_ids if self.num_groups == 1 and not self.windows[0] else [b for b in hit.block_ids if b >= 0]
        # Hit blocks that sit in the LRU stop being evictable once we take them.
        pool = self.device
        if num_needed > pool.num_free_blocks - len(taken):  # else enough even if every hit is evictable
            available = pool.num_free_blocks - sum(pool.blocks[b].ref_count == 0 for b in taken)
            if num_needed > available:
                return NoFreeBlocks(num_needed, available)
        pool.acquire_all(taken)
        block_ids = hit.block_ids + pool.allocate(num_needed)
        self.seqs[seq_id] = SeqBlocks(Tier.DEVICE, block_ids, extra_key, num_hit_blocks, last_hash)
        if self.enable_prefix_caching:
            self.num_prefix_queries += len(token_ids)
            self.num_prefix_hits += hit.num_tokens
        return Allocated(hit.num_tokens, num_new_tokens, list(block_ids))

    def append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> Appended | NoFreeBlocks:
        """Make room to write positions [num_computed, num_computed + num_new) in every group.
        A block that will be written while shared (ref > 1, e.g. after a fork) is copied
        first; a sliding group's blocks that no query of the step reads any more are released."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.tier != Tier.DEVICE:
            seq = self._seq(seq_id, Tier.DEVICE)  # raises why not
        pool, bs, num_groups = self.device, self.block_size, self.num_groups
        first_written = num_computed_tokens // bs
        blocks = seq.block_ids
        num_logical = len(blocks) // num_groups
        if num_groups == 1 and not self.windows[0]:
            if (
                first_written == num_logical - 1
                and num_computed_tokens + num_new_tokens <= num_logical * bs
                and pool.blocks[blocks[first_written]].ref_count == 1
            ):
                return Appended([])  # the common decode: room left in an unshared last block
            releasable: list[int] = []
        else:
            releasable = self._out_of_window(blocks, num_computed_tokens)
        if num_new_tokens < 0 or not 0 <= num_computed_tokens <= num_logical * bs:
            raise BlockOpError(
                f"sequence {seq_id!r}: cannot write {num_new_tokens} tokens at {num_computed_tokens} "
                f"({num_logical} blocks of {bs})"
            )
        shared = [i for i in range(first_written * num_groups, len(blocks)) if pool.blocks[blocks[i]].ref_count > 1]
        num_grow = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - num_logical) * num_groups
        num_needed = num_grow + len(shared)
        if num_needed > pool.num_free_blocks:
            available = pool.num_free_blocks + sum(pool.blocks[blocks[i]].ref_count == 1 for i in releasable)
            if num_needed > available:
                return NoFreeBlocks(num_needed, available)
        result = Appended([])
        for index in releasable:
            pool.release(blocks[index])
            blocks[index] = NO_BLOCK
        for index in shared:
            old = blocks[index]
            (new,) = pool.allocate(1)
            if index // num_groups * bs < num_computed_tokens:  # holds computed tokens: copy them over
                result.copies.append((old, new))
            pool.release(old)
            blocks[index] = new
            result.replaced.append((index, new))
        result.new_block_ids = pool.allocate(num_grow)
        blocks.extend(result.new_block_ids)
        return result

    def _out_of_window(self, blocks: list[int], position: int) -> list[int]:
        """Table indexes of the sliding groups' live blocks wholly before the window of a
        query at `position`. A group's live blocks are one run up to the table's end, so the
        walk back from the window's edge stops at the first released entry."""
        bs, num_groups, indexes = self.block_size, self.num_groups, []
        for g, w in enumerate(self.windows):
            i = first_in_window(position, w, bs) - 1
            while w and i >= 0 and blocks[i * num_groups + g] != NO_BLOCK:
                indexes.append(i * num_groups + g)
                i -= 1
        return indexes

    def cache_blocks(
        self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int, token_offset: int = 0
    ) -> None:
        """Register the chain hashes of blocks that are now full and computed, so later
        requests can hit them (also after this sequence frees them). token_ids may start at
        position token_offset (a tail holding at least the blocks not hashed yet). A sliding
        group's block released before it was hashed stays unregistered."""
        if not self.enable_prefix_caching:
            return
        seq = self._seq(seq_id)
        if seq.tier != Tier.DEVICE:
            return
        bs, first, num_groups = self.block_size, seq.num_hashed_blocks, self.num_groups
        end = min(num_computed_tokens // bs, len(seq.block_ids) // num_groups)
        if end <= first:
            return
        if not 0 <= token_offset <= first * bs or token_offset + len(token_ids) < end * bs:
            raise BlockOpError(
                f"sequence {seq_id!r}: tokens from {token_offset} ({len(token_ids)} of them) do not cover "
                f"blocks {first} to {end - 1}"
            )
        tail = token_ids[first * bs - token_offset : end * bs - token_offset]
        hashes = hashing.chain_hashes(tail, bs, 0, end - first, seq.last_hash, seq.extra_key)
        for i, h in enumerate(hashes, first):
            tokens = tuple(tail[(i - first) * bs : (i - first + 1) * bs])
            for g in range(num_groups):
                block_id = seq.block_ids[i * num_groups + g]
                if block_id != NO_BLOCK:
                    self.device.set_hash(block_id, group_key(h, g), tokens)
            seq.last_hash, seq.num_hashed_blocks = h, i + 1

    def free(self, seq_id: str) -> None:
        """Drop a sequence; its blocks go back tail first, so tails are evicted first."""
        seq = self._seq(seq_id)
        del self.seqs[seq_id]
        pool = self.pools[seq.tier]
        for block_id in reversed(seq.block_ids):
            if block_id != NO_BLOCK:
                pool.release(block_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; writes into shared blocks copy first."""
        parent = self._seq(parent_id)
        self._new_seq_id(child_id)
        pool = self.pools[parent.tier]
        for block_id in parent.block_ids:
            if block_id != NO_BLOCK:
                pool.acquire(block_id)
        self.seqs[child_id] = SeqBlocks(
            parent.tier, list(parent.block_ids), parent.extra_key, parent.num_hashed_blocks, parent.last_hash
        )

    def swap_out(self, seq_id: str) -> list[tuple[int, int]] | NoFreeBlocks:
        """Move a sequence's blocks to the host pool; returns (device, host) copies."""
        return self._move(seq_id, Tier.DEVICE, Tier.HOST)

    def swap_in(self, seq_id: str) -> list[tuple[int, int]] | NoFreeBlocks:
        """Bring a swapped sequence back; returns (host, device) copies."""
        return self._move(seq_id, Tier.HOST, Tier.DEVICE)

    def _move(self, seq_id: str, src_tier: Tier, dst_tier: Tier) -> list[tuple[int, int]] | NoFreeBlocks:
        """Every live block of every group moves; released entries stay NO_BLOCK."""
        seq = self._seq(seq_id, src_tier)
        src, dst = self.pools[src_tier], self.pools[dst_tier]
        live = [b for b in seq.block_ids if b != NO_BLOCK]
        if len(live) > dst.num_free_blocks:
            return NoFreeBlocks(len(live), dst.num_free_blocks, dst_tier)
        moved = iter(dst.allocate(len(live)))
        new_ids = [NO_BLOCK if b == NO_BLOCK else next(moved) for b in seq.block_ids]
        copies = [(old, new) for old, new in zip(seq.block_ids, new_ids) if old != NO_BLOCK]
        for block_id in reversed(live):
            src.release(block_id)
        seq.tier, seq.block_ids = dst_tier, new_ids
        # Host blocks are not in the prefix index; hashes are registered again once back.
        seq.num_hashed_blocks, seq.last_hash = 0, None
        return copies

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Every block exactly one of free / used / cached, counts add up, no table points at
        a block that is not referenced, every table holds whole logical blocks and a sliding
        group's live entries are one run to the table's end. AssertionError otherwise."""
        for tier, pool in self.pools.items():
            referenced: dict[int, int] = {}
            for seq in self.seqs.values():
                if seq.tier == tier:
                    for block_id in seq.block_ids:
                        if block_id != NO_BLOCK:
                            referenced[block_id] = referenced.get(block_id, 0) + 1
            pool.check(referenced)
        for seq_id, seq in self.seqs.items():
            if len(seq.block_ids) % self.num_groups:
                raise AssertionError(f"{seq_id}: {len(seq.block_ids)} entries for {self.num_groups} groups")
            for g, w in enumerate(self.windows):
                column = seq.block_ids[g :: self.num_groups]
                live = len(column) - column.count(NO_BLOCK)
                if column[len(column) - live :].count(NO_BLOCK) or (not w and live != len(column)):
                    raise AssertionError(f"{seq_id}: group {g}'s live blocks are not one run to the end: {column}")

    def reset_prefix_cache(self) -> int:
        """Drop every cached (unreferenced) block of both pools from the prefix index, as
        vLLM's reset_prefix_cache does between benchmark runs; returns the number dropped."""
        return sum(pool.reset_prefix_cache() for pool in self.pools.values())

    def all_free_or_cached(self) -> bool:
        return not self.seqs and all(pool.num_used_blocks == 0 for pool in self.pools.values())
