"""Prefix-cache lookups: the longest cached run of blocks that starts a prompt, per KV group.

A full-attention group needs every block of the hit; a sliding-window group only those that
hold the last `window - 1` tokens before the first position to compute (its queries see no
key further back), so its blocks further back may have been evicted and are NO_BLOCK in the
new table. The hit is the longest block-aligned prefix every group can serve. Each group's
blocks are indexed under their own key (group_key): the groups hold different layers' K/V.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from contracts import block_hash as hashing
from contracts.kv_groups import NO_BLOCK
from kvcache_svc.block_pool import BlockPool

_GROUP_MIX = 0x9E3779B97F4A7C15  # odd: group_key is a bijection for each group
_MASK64 = (1 << 64) - 1


def group_key(block_hash: int, group: int) -> int:
    """The prefix-index key of group `group`'s block whose chain hash is `block_hash`; group 0
    (the only group of a one-type model) keys by the chain hash itself, which is what the
    router looks up."""
    return block_hash if group == 0 else (block_hash + group * _GROUP_MIX) & _MASK64


def first_in_window(position: int, window: int, block_size: int) -> int:
    """The first block a query at `position` reads: the one holding position - window + 1
    (window 0: full attention, block 0)."""
    return max(0, position - window + 1) // block_size if window else 0


@dataclass(slots=True)
class PrefixHit:
    num_tokens: int  # always a multiple of block_size
    block_ids: list[int]  # the hit's table (group-minor, NO_BLOCK where a group needs none)


class PrefixMatcher:
    """Looks prompts up in the device pool's prefix index. It remembers the last prompt's
    hashes: requests that arrive together with one system prompt hash it once, not once each
    (two memcmp-speed comparisons per halving instead of a blake2b call per block)."""

    def __init__(self, block_size: int, windows: tuple[int, ...]) -> None:
        self.block_size, self.windows = block_size, windows
        self.one_full_group = windows == (0,)
        # the last prompt: (its hashed blocks as int64 bytes, their chain hashes, extra key)
        self._recent: tuple[bytes, list[int], str | None] | None = None
        self._recent_hits: list[tuple[int, tuple[int, ...]]] = []  # its hit blocks: (id, the token tuple verified)
        self._recent_epoch = -1  # the pool's hash_epoch when those were last known to hold

    def match(
        self, pool: BlockPool, token_ids: list[int], extra_key: str | None, token_bytes: bytes | None
    ) -> tuple[PrefixHit, int | None]:
        """The hit, and the chain hash of its last block (None: no hit). At least the last
        prompt token is always left to compute (its logits are needed)."""
        bs = self.block_size
        num_blocks = (len(token_ids) - 1) // bs
        if token_bytes is None:
            data = array("q", token_ids[: num_blocks * bs]).tobytes()
        else:
            data = token_bytes[: num_blocks * bs * 8]
        hashes = self._recent_hashes(data, extra_key)
        width = 8 * bs
        rest = hashing.chain_bytes(data[len(hashes) * width :], width, hashes[-1] if hashes else None, extra_key)
        if self.one_full_group:
            block_ids = self._match_full(pool, token_ids, num_blocks, hashes, rest)
        else:
            block_ids = self._match_groups(pool, token_ids, num_blocks, hashes, rest)
        self._recent = (data[: len(hashes) * width], hashes, extra_key)
        num_hit = len(block_ids) // len(self.windows)
        return PrefixHit(num_hit * bs, block_ids), hashes[num_hit - 1] if num_hit else None

    def _match_full(self, pool, token_ids, num_blocks, hashes, rest) -> list[int]:
        """One full-attention group: the leading blocks that hit, in order. The last prompt's
        hits, for the blocks this one shares with it: a block that still holds the very token
        tuple it was verified against needs no new tuple and compare."""
        bs, known = self.block_size, len(hashes)
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
        self._recent_hits, self._recent_epoch = hits, pool.hash_epoch
        return block_ids

    def _match_groups(self, pool, token_ids, num_blocks, hashes, rest) -> list[int]:
        """Several groups, or a sliding one: the longest k every group serves. Full groups
        serve any k up to their first miss; a sliding group serves k when the blocks of its
        window before position k * block_size all hit. Lowering k for one sliding group can
        widen another's need, so it is lowered until every group agrees."""
        bs, windows = self.block_size, self.windows
        found: dict[tuple[int, int], int | None] = {}

        def block(i: int, g: int) -> int | None:
            if (i, g) not in found:
                while len(hashes) <= i:
                    hashes.append(next(rest))
                key = group_key(hashes[i], g)
                found[i, g] = pool.lookup(key, tuple(token_ids[i * bs : (i + 1) * bs]))
            return found[i, g]

        full = [g for g, w in enumerate(windows) if not w]
        k = 0 if full else num_blocks
        while full and k < num_blocks and all(block(k, g) is not None for g in full):
            k += 1
        settled = False
        while not settled and k > 0:
            settled = True
            for g, w in enumerate(windows):
                kk = k
                while w and kk > 0:
                    first = first_in_window(kk * bs, w, bs)
                    miss = next((i for i in range(kk - 1, first - 1, -1) if block(i, g) is None), None)
                    if miss is None:
                        break
                    kk = miss
                if kk < k:
                    k, settled = kk, False
        ids: list[int] = []
        for i in range(k):
            for g, w in enumerate(windows):
                hit = block(i, g) if i >= first_in_window(k * bs, w, bs) else NO_BLOCK
                assert hit is not None, "every group serves the hit"
                ids.append(hit)
        return ids

    def _recent_hashes(self, data: bytes, extra_key: str | None) -> list[int]:
        """The chain hashes of the leading blocks this prompt (as int64 bytes) shares with the
        last prompt looked up."""
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
