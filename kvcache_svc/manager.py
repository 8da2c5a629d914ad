"""KVCacheManager: the mechanism behind the scheduler's block decisions.

It owns the two pools, each sequence's block table (logical -> physical, with its tier) and
the prefix cache. It answers "can / cannot" and returns ids and copy lists; it never decides
who runs or who is preempted (that is the scheduler's policy). When blocks run short an
operation returns `NoFreeBlocks` and changes nothing; an operation that does not apply (an
unknown or duplicate sequence, the wrong tier, positions outside the table) raises
BlockOpError, also under `python -O`, and changes nothing either.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from contracts import block_hash as hashing
from kvcache_svc.block_pool import BlockOpError, BlockPool, Tier


@dataclass(slots=True, frozen=True)
class NoFreeBlocks:
    """Typed 'not enough blocks': how many were needed and how many the pool could give."""

    needed: int
    available: int
    tier: Tier = Tier.DEVICE


@dataclass(slots=True)
class PrefixHit:
    num_tokens: int  # always a multiple of block_size
    block_ids: list[int]


@dataclass(slots=True)
class Allocated:
    num_cached_tokens: int  # prompt tokens served from the prefix cache (not to be computed)
    num_new_tokens: int  # tokens to compute this step (clamped to what the prompt has left)
    block_ids: list[int]  # the whole table


@dataclass(slots=True)
class Appended:
    new_block_ids: list[int]  # added at the end of the table
    copies: list[tuple[int, int]] = field(default_factory=list)  # device (src, dst) copy-on-write
    replaced: list[tuple[int, int]] = field(default_factory=list)  # (table index, new block id)


@dataclass(slots=True)
class SeqBlocks:
    tier: Tier
    block_ids: list[int]
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
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = {
            Tier.DEVICE: BlockPool(num_device_blocks, Tier.DEVICE),
            Tier.HOST: BlockPool(num_host_blocks, Tier.HOST),
        }
        self.seqs: dict[str, SeqBlocks] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of those, tokens served from the cache
        # match_prefix's last prompt: (its hashed blocks as int64 bytes, their chain hashes, extra key)
        self._recent: tuple[bytes, list[int], str | None] | None = None
        self._recent_hits: list[tuple[int, tuple[int, ...]]] = []  # its hit blocks: (id, the token tuple verified)
        self._recent_epoch = -1  # the device pool's hash_epoch when those were last known to hold

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
        return -(-num_tokens // self.block_size)

    def match_prefix(
        self, token_ids: list[int], extra_key: str | None = None, token_bytes: bytes | None = None
    ) -> PrefixHit:
        """Longest run of full cached device blocks that starts the prompt. At least the last
        prompt token is always left to compute (its logits are needed). token_bytes: the same
        tokens as int64 bytes when the caller has them (the engine's check of a prompt makes
        them), so that they are not converted again."""
        if not self.enable_prefix_caching:
            return PrefixHit(0, [])
        bs, pool = self.block_size, self.device
        num_blocks = (len(token_ids) - 1) // bs
        if token_bytes is None:
            data = array("q", token_ids[: num_blocks * bs]).tobytes()
        else:
            data = token_bytes[: num_blocks * bs * 8]
        hashes = self._recent_hashes(data, extra_key)
        known, width = len(hashes), 8 * bs
        rest = hashing.chain_bytes(data[known * width :], width, hashes[-1] if hashes else None, extra_key)
        # The last prompt's hits, for the blocks this one shares with it: a block that still
        # holds the very token tuple it was verified against needs no new tuple and compare.
        hits = self._recent_hits[
            : pool.num_still_held(hashes, self._recent_hits[: min(known, num_blocks)], self._recent_epoch)
        ]
        block_ids = [block_id for block_id, _ in hits]
        for i in range(len(hits), num_blocks):
            if i >= known:  # hashed on demand: a miss early in the prompt hashes no further
                hashes.append(next(rest))
            block_id = pool.lookup(hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            block_ids.append(block_id)
            held = pool.blocks[block_id].token_ids
            assert held is not None, "a hit was compared with the block's tokens"
            hits.append((block_id, held))
        self._recent = (data[: len(hashes) * width], hashes, extra_key)
        self._recent_hits, self._recent_epoch = hits, pool.hash_epoch
        return PrefixHit(len(block_ids) * bs, block_ids)

    def _recent_hashes(self, data: bytes, extra_key: str | None) -> list[int]:
        """The chain hashes of the leading blocks this prompt (as int64 bytes) shares with the
        last prompt looked up: requests that arrive together with one system prompt hash it
        once, not once each (two memcmp-speed comparisons per halving instead of a blake2b
        call per block)."""
        if self._recent is None or self._recent[2] != extra_key:
            return []
        prev, hashes, _ = self._recent
        width = 8 * self.block_size
        hi = min(len(data), len(prev)) // width
        if data[: hi * width] == prev[: hi * width]:
            return hashes[:hi]
        lo = 0  # the first lo blocks are equal, the first hi are not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if data[: mid * width] == prev[: mid * width]:
                lo = mid
            else:
                hi = mid
        return hashes[:lo]

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
        more tokens (clamped to the rest of the prompt). token_bytes: see match_prefix."""
        self._new_seq_id(seq_id)
        hit = self.match_prefix(token_ids, extra_key, token_bytes)
        num_new_tokens = max(1, min(num_new_tokens, len(token_ids) - hit.num_tokens))
        num_needed = self.num_blocks_for(hit.num_tokens + num_new_tokens) - len(hit.block_ids)
        # Hit blocks that sit in the LRU stop being evictable once we take them.
        pool = self.device
        if num_needed > pool.num_free_blocks - len(hit.block_ids):  # else enough even if every hit is evictable
            available = pool.num_free_blocks - sum(pool.blocks[b].ref_count == 0 for b in hit.block_ids)
            if num_needed > available:
                return NoFreeBlocks(num_needed, available)
        pool.acquire_all(hit.block_ids)
        block_ids = hit.block_ids + pool.allocate(num_needed)
        last_hash = (
            pool.blocks[hit.block_ids[-1]].block_hash if hit.block_ids else None
        )  # the chain continues from the hit
        self.seqs[seq_id] = SeqBlocks(Tier.DEVICE, block_ids, extra_key, len(hit.block_ids), last_hash)
        if self.enable_prefix_caching:
            self.num_prefix_queries += len(token_ids)
            self.num_prefix_hits += hit.num_tokens
        return Allocated(hit.num_tokens, num_new_tokens, list(block_ids))

    def append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> Appended | NoFreeBlocks:
        """Make room to write positions [num_computed, num_computed + num_new). A block that
        will be written while shared (ref > 1, e.g. after a fork) is copied first."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.tier != Tier.DEVICE:
            seq = self._seq(seq_id, Tier.DEVICE)  # raises why not
        pool, bs = self.device, self.block_size
        first_written = num_computed_tokens // bs
        blocks = seq.block_ids
        if (
            first_written == len(blocks) - 1
            and num_computed_tokens + num_new_tokens <= len(blocks) * bs
            and pool.blocks[blocks[first_written]].ref_count == 1
        ):
            return Appended([])  # the common decode: room left in an unshared last block
        if num_new_tokens < 0 or not 0 <= num_computed_tokens <= len(blocks) * bs:
            raise BlockOpError(
                f"sequence {seq_id!r}: cannot write {num_new_tokens} tokens at {num_computed_tokens} "
                f"({len(blocks)} blocks of {bs})"
            )
        shared = [i for i in range(first_written, len(seq.block_ids)) if pool.blocks[seq.block_ids[i]].ref_count > 1]
        num_grow = max(0, self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(seq.block_ids))
        num_needed = num_grow + len(shared)
        if num_needed > pool.num_free_blocks:
            return NoFreeBlocks(num_needed, pool.num_free_blocks)
        result = Appended([])
        for index in shared:
            old = seq.block_ids[index]
            (new,) = pool.allocate(1)
            if index * bs < num_computed_tokens:  # holds computed tokens: copy them over
                result.copies.append((old, new))
            pool.release(old)
            seq.block_ids[index] = new
            result.replaced.append((index, new))
        result.new_block_ids = pool.allocate(num_grow)
        seq.block_ids.extend(result.new_block_ids)
        return result

    def cache_blocks(
        self, seq_id: str, token_ids: Sequence[int], num_computed_tokens: int, token_offset: int = 0
    ) -> None:
        """Register the chain hashes of blocks that are now full and computed, so later
        requests can hit them (also after this sequence frees them). token_ids may start at
        position token_offset (a tail holding at least the blocks not hashed yet)."""
        if not self.enable_prefix_caching:
            return
        seq = self._seq(seq_id)
        if seq.tier != Tier.DEVICE:
            return
        bs, first = self.block_size, seq.num_hashed_blocks
        end = min(num_computed_tokens // bs, len(seq.block_ids))
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
            self.device.set_hash(seq.block_ids[i], h, tokens)
            seq.last_hash, seq.num_hashed_blocks = h, i + 1

    def free(self, seq_id: str) -> None:
        """Drop a sequence; its blocks go back tail first, so tails are evicted first."""
        seq = self._seq(seq_id)
        del self.seqs[seq_id]
        pool = self.pools[seq.tier]
        for block_id in reversed(seq.block_ids):
            pool.release(block_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; writes into shared blocks copy first."""
        parent = self._seq(parent_id)
        self._new_seq_id(child_id)
        pool = self.pools[parent.tier]
        for block_id in parent.block_ids:
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
        seq = self._seq(seq_id, src_tier)
        src, dst = self.pools[src_tier], self.pools[dst_tier]
        if len(seq.block_ids) > dst.num_free_blocks:
            return NoFreeBlocks(len(seq.block_ids), dst.num_free_blocks, dst_tier)
        new_ids = dst.allocate(len(seq.block_ids))
        copies = list(zip(seq.block_ids, new_ids))
        for block_id in reversed(seq.block_ids):
            src.release(block_id)
        seq.tier, seq.block_ids = dst_tier, new_ids
        # Host blocks are not in the prefix index; hashes are registered again once back.
        seq.num_hashed_blocks, seq.last_hash = 0, None
        return copies

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Every block exactly one of free / used / cached, counts add up, and no table
        points at a block that is not referenced. Raises AssertionError otherwise."""
        for tier, pool in self.pools.items():
            referenced: dict[int, int] = {}
            for seq in self.seqs.values():
                if seq.tier == tier:
                    for block_id in seq.block_ids:
                        referenced[block_id] = referenced.get(block_id, 0) + 1
            pool.check(referenced)

    def reset_prefix_cache(self) -> int:
        """Drop every cached (unreferenced) block of both pools from the prefix index, as
        vLLM's reset_prefix_cache does between benchmark runs; returns the number dropped."""
        return sum(pool.reset_prefix_cache() for pool in self.pools.values())

    def all_free_or_cached(self) -> bool:
        return not self.seqs and all(pool.num_used_blocks == 0 for pool in self.pools.values())
