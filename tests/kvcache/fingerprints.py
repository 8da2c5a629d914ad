"""The randomized driver's independent model of KV contents (tests/kvcache/test_randomized.py):
a fingerprint per (salt, token prefix), its own copy of each sequence, and a snapshot of the
manager's whole state (to check that an operation refused with NoFreeBlocks changed nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_svc import KVCacheManager, Tier


def snapshot(mgr: KVCacheManager):
    pools = {}
    for tier, pool in mgr.pools.items():
        pools[tier] = (
            [(b.ref_count, b.block_hash, b.token_ids) for b in pool.blocks],
            list(pool.free_ids),
            list(pool.lru),
            dict(pool.hash_to_block),
            pool.num_evictions,
        )
    seqs = {
        sid: (s.tier, list(s.block_ids), s.extra_key, s.num_hashed_blocks, s.last_hash) for sid, s in mgr.seqs.items()
    }
    return pools, seqs, mgr.num_prefix_queries, mgr.num_prefix_hits


class Fingerprints:
    """Interned ids for (salt, token prefix): id(p) = intern(id(p - 1), token p)."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.parent: list[int] = []
        self.token: list[int | None] = []
        self.salt: dict[int, str | None] = {}

    def root(self, salt: str | None) -> int:
        key = ("root", salt)
        fid = self.ids.get(key)
        if fid is None:
            fid = self.ids[key] = len(self.token)
            self.parent.append(-1)
            self.token.append(None)
            self.salt[fid] = salt
        return fid

    def next(self, prev: int, token: int) -> int:
        key = (prev, token)
        fid = self.ids.get(key)
        if fid is None:
            fid = self.ids[key] = len(self.token)
            self.parent.append(prev)
            self.token.append(token)
        return fid

    def of(self, salt: str | None, tokens: list[int]) -> list[int]:
        out, prev = [], self.root(salt)
        for t in tokens:
            prev = self.next(prev, t)
            out.append(prev)
        return out

    def prefix(self, fid: int) -> tuple[str | None, list[int]]:
        """(salt, tokens) whose last fingerprint is fid."""
        tokens = []
        while self.token[fid] is not None:
            tokens.append(self.token[fid])
            fid = self.parent[fid]
        return self.salt[fid], tokens[::-1]


@dataclass
class MSeq:
    tokens: list[int]
    fps: list[int]
    salt: str | None
    family: int
    tier: Tier
    table: list[int]
    computed: int = 0
