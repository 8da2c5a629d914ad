"""Randomized test of the KV-cache manager with KV groups (full and sliding-window) against an
independent model of what every block holds.

The driver plays scheduler and model service: it allocates prompts in chunks, decodes,
forks (parallel sampling: k children of a sequence, the parent freed, each child writing
its next position), frees, swaps out and in and looks prefixes up, on small pools. A slot's
content is (group, fingerprint of the salt and every token up to that position); the model
writes it where the manager's table points when tokens are computed and applies the copy
lists as the model service would. Checked throughout:

- every position a group's next query reads (a full group: all computed ones; a sliding
  group: the last window - 1 of them) holds its own fingerprint through that group's table;
- a sliding group's table holds no block wholly before the window of the last position it
  was asked to write from, and every block after it (what releases the memory);
- a prefix hit is exactly the longest one every group can serve, found from the contents of
  the hashed blocks, not from their hashes;
- no write goes into a shared or hashed block; NoFreeBlocks changes nothing; the invariants
  hold; at the end every block is free or cached.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from contracts.kv_groups import NO_BLOCK
from kvcache_svc import Allocated, Appended, KVCacheManager, NoFreeBlocks, Tier
from kvcache_svc.prefix import first_in_window
from tests.kvcache.common import snapshot
from tests.kvcache.fingerprints import Fingerprints

DEV, HOST = Tier.DEVICE, Tier.HOST


@dataclass
class Seq:
    tokens: list[int]
    fps: list[int]
    salt: str | None
    tier: Tier
    computed: int = 0
    window_from: int = 0  # the position the manager last released windows for


class GroupDriver:
    def __init__(self, seed: int, windows: tuple[int, ...], num_device: int = 48, num_host: int = 40) -> None:
        self.rng = random.Random(seed)
        self.windows, self.groups, self.bs = windows, len(windows), 3
        self.n = {DEV: num_device, HOST: num_host}
        self.mgr = KVCacheManager(num_device, num_host, self.bs, group_windows=windows)
        self.fp = Fingerprints()
        self.content: dict[Tier, list[list]] = {t: [[None] * self.bs for _ in range(self.n[t])] for t in (DEV, HOST)}
        self.seqs: dict[str, Seq] = {}
        self.next_id = 0
        self.bases = [[self.rng.randrange(3) for _ in range(30)] for _ in range(4)]
        self.stats: dict[str, int] = {}

    def count(self, key: str, k: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + k

    def table(self, sid: str) -> list[int]:
        return self.mgr.block_table(sid)

    def entry(self, sid: str, i: int, g: int) -> int:
        return self.table(sid)[i * self.groups + g]

    # ------------------------------------------------------------------ model side
    def compute(self, sid: str, num: int) -> None:
        seq, bs, pool = self.seqs[sid], self.bs, self.mgr.device
        for p in range(seq.computed, seq.computed + num):
            for g in range(self.groups):
                b = self.entry(sid, p // bs, g)
                assert b != NO_BLOCK, f"{sid}: position {p} of group {g} has no block"
                assert pool.blocks[b].ref_count == 1, f"write into block {b}, shared"
                assert pool.blocks[b].block_hash is None, f"write into cached block {b}"
                self.content[DEV][b][p % bs] = (g, seq.fps[p])
        seq.computed += num
        if self.rng.random() < 0.85:
            self.mgr.cache_blocks(sid, seq.tokens, seq.computed)

    def apply_copies(self, copies: list[tuple[int, int]], src: Tier, dst: Tier) -> None:
        for s, d in copies:
            self.content[dst][d] = list(self.content[src][s])

    # ------------------------------------------------------------------ operations
    def prompt(self) -> tuple[list[int], str | None]:
        base = self.rng.choice(self.bases)
        tokens = base[: self.rng.randint(0, len(base))] + [self.rng.randrange(3) for _ in range(self.rng.randint(1, 5))]
        return tokens, self.rng.choice((None, None, None, "s1"))

    def op_allocate(self) -> None:
        if len(self.seqs) >= 10:
            return self.op_free()
        tokens, salt = self.prompt()
        sid = f"s{self.next_id}"
        self.next_id += 1
        self.check_hit(tokens, salt)
        before = snapshot(self.mgr)
        res = self.mgr.allocate(sid, list(tokens), self.rng.randint(1, len(tokens) + 2), salt)
        if isinstance(res, NoFreeBlocks):
            assert snapshot(self.mgr) == before, "NoFreeBlocks changed the state"
            return self.count("allocate_nofree")
        assert isinstance(res, Allocated)
        self.seqs[sid] = Seq(list(tokens), self.fp.of(salt, tokens), salt, DEV, res.num_cached_tokens)
        self.seqs[sid].window_from = res.num_cached_tokens
        self.count("hit_blocks", res.num_cached_tokens // self.bs)
        self.compute(sid, res.num_new_tokens)
        self.count("allocate")

    def step(self, sid: str) -> Appended | None:
        seq = self.seqs[sid]
        if seq.computed == len(seq.tokens):
            if len(seq.tokens) >= 45:
                self.free(sid)
                return None
            token = self.rng.randrange(3)
            seq.tokens.append(token)
            seq.fps.append(self.fp.next(seq.fps[-1], token))
            num = 1
        else:
            num = self.rng.randint(1, min(7, len(seq.tokens) - seq.computed))
        before = snapshot(self.mgr)
        res = self.mgr.append_slots(sid, seq.computed, num)
        if isinstance(res, NoFreeBlocks):
            assert snapshot(self.mgr) == before, "NoFreeBlocks changed the state"
            self.count("append_nofree")
            return None
        self.apply_copies(res.copies, DEV, DEV)
        seq.window_from = seq.computed
        self.compute(sid, num)
        self.count("cow_copies", len(res.copies))
        self.count("append")
        return res

    def op_step(self) -> None:
        ids = [s for s, q in self.seqs.items() if q.tier == DEV]
        if not ids:
            return self.op_allocate()
        self.step(self.rng.choice(ids))

    def op_parallel(self) -> None:
        ids = [s for s, q in self.seqs.items() if q.tier == DEV]
        k = self.rng.randint(2, 4)
        if not ids or len(self.seqs) + k > 10:
            return
        parent = self.rng.choice(ids)
        kids = []
        for _ in range(k):
            kid = f"s{self.next_id}"
            self.next_id += 1
            self.mgr.fork(parent, kid)
            p = self.seqs[parent]
            self.seqs[kid] = Seq(list(p.tokens), list(p.fps), p.salt, p.tier, p.computed, p.window_from)
            kids.append(kid)
        self.free(parent)
        for kid in kids:
            if kid in self.seqs and self.step(kid) is None:
                break
        self.count("parallel")

    def op_free(self) -> None:
        if self.seqs:
            self.free(self.rng.choice(list(self.seqs)))

    def free(self, sid: str) -> None:
        del self.seqs[sid]
        self.mgr.free(sid)
        self.count("free")

    def op_swap(self, src: Tier) -> None:
        ids = [s for s, q in self.seqs.items() if q.tier == src]
        if not ids:
            return
        sid = self.rng.choice(ids)
        dst = HOST if src == DEV else DEV
        old = list(self.table(sid))
        before = snapshot(self.mgr)
        copies = self.mgr.swap_out(sid) if src == DEV else self.mgr.swap_in(sid)
        if isinstance(copies, NoFreeBlocks):
            assert snapshot(self.mgr) == before, "NoFreeBlocks changed the state"
            return self.count("swap_nofree")
        assert [s for s, _ in copies] == [b for b in old if b != NO_BLOCK], "every live block moves, in order"
        assert [b == NO_BLOCK for b in self.table(sid)] == [b == NO_BLOCK for b in old], "released entries stay"
        self.apply_copies(copies, src, dst)
        self.seqs[sid].tier = dst
        self.count("swap")

    def op_match(self) -> None:
        self.check_hit(*self.prompt())

    # ------------------------------------------------------------------ checks
    def check_hit(self, tokens: list[int], salt: str | None) -> None:
        """The manager's hit equals the longest one the hashed blocks' contents allow."""
        hit = self.mgr.match_prefix(tokens, salt)
        bs, fps = self.bs, self.fp.of(salt, tokens)
        held = {tuple(self.content[DEV][b]) for b in self.mgr.device.hash_to_block.values()}

        def has(i: int, g: int) -> bool:
            return tuple((g, f) for f in fps[i * bs : (i + 1) * bs]) in held

        def serves(k: int) -> bool:
            return all(has(i, g) for g, w in enumerate(self.windows) for i in range(first_in_window(k * bs, w, bs), k))

        best = max(k for k in range((len(tokens) - 1) // bs + 1) if serves(k))
        assert hit.num_tokens == best * bs, (hit.num_tokens, best * bs, tokens)
        for i in range(best):
            for g, w in enumerate(self.windows):
                b = hit.block_ids[i * self.groups + g]
                if i < first_in_window(best * bs, w, bs):
                    assert b == NO_BLOCK, "a sliding group takes only its window's blocks"
                else:
                    assert self.content[DEV][b] == [(g, f) for f in fps[i * bs : (i + 1) * bs]]
        self.count("match_hits", best > 0)

    def full_check(self) -> None:
        self.mgr.check_invariants()
        assert set(self.mgr.seqs) == set(self.seqs)
        bs = self.bs
        for sid, seq in self.seqs.items():
            content = self.content[seq.tier]
            for g, w in enumerate(self.windows):
                released = first_in_window(seq.window_from, w, bs)
                column = self.table(sid)[g :: self.groups]
                assert all(b == NO_BLOCK for b in column[:released]), f"{sid}: group {g} keeps out-of-window blocks"
                assert NO_BLOCK not in column[released:], f"{sid}: group {g} lost a block of its window"
                for p in range(max(first_in_window(seq.computed, w, bs) * bs, released * bs), seq.computed):
                    b = column[p // bs]
                    assert content[b][p % bs] == (g, seq.fps[p]), f"{sid} group {g} position {p}: wrong KV"

    def run(self, num_ops: int) -> dict[str, int]:
        ops = (
            [self.op_allocate] * 4
            + [self.op_step] * 10
            + [self.op_parallel, self.op_free, self.op_match]
            + [
                lambda: self.op_swap(DEV),
                lambda: self.op_swap(HOST),
                lambda: self.op_swap(HOST),
            ]
        )
        for n in range(1, num_ops + 1):
            self.rng.choice(ops)()
            if n % 10 == 0:
                self.full_check()
        for sid in list(self.seqs):
            self.free(sid)
        self.full_check()
        assert self.mgr.all_free_or_cached()
        return self.stats


@pytest.mark.parametrize(
    ("windows", "seed"),
    [((0, 5), 0), ((5,), 1), ((0, 0, 4), 2), ((4, 0, 7), 3), ((1, 0), 4)],
    ids=["full+sliding", "all-sliding", "2full+sliding", "mixed-windows", "window-1"],
)
def test_randomized_groups_against_model(windows, seed):
    stats = GroupDriver(seed, windows, num_device=16 * len(windows)).run(6_000)
    for key in ("allocate", "allocate_nofree", "append", "append_nofree", "cow_copies", "parallel", "swap"):
        assert stats.get(key, 0) > 0, (key, stats)
    assert stats.get("hit_blocks", 0) > 0 and stats.get("match_hits", 0) > 0, stats
