"""The randomized driver's independent model of KV contents (tests/kvcache/randomized_driver.py):
a fingerprint per (salt, token prefix) and its own copy of each sequence."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_svc import Tier


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
