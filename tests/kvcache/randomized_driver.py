"""Randomized end-to-end test of the KV-cache block manager against an independent model.

The driver plays scheduler and model service at once: it allocates prompts (in chunks),
decodes, forks, frees, swaps out and in, and looks up prefixes in random order on small
pools, so that NoFreeBlocks, eviction, copy-on-write and swapping happen all the time. One
op plays parallel sampling as the scheduler does it: fork k children of a sequence, free
the parent, and let each child write its next position (the k - 1 first copy a shared
partial block, the last one keeps it).

The model keeps its own copy of every sequence (tokens, computed count, tier, block table)
and of what every physical block holds. A slot's content is a fingerprint of what its KV
depends on: the cache salt and every token up to and including that position. Whenever
tokens are "computed" the model writes their fingerprints into the blocks named by the
table; copy lists (copy-on-write, swap out, swap in) are applied to the model's blocks the
way the model service would apply them; newly handed out blocks are wiped first. The key
property, checked throughout: through the manager's table, every computed position of every
sequence holds exactly its own fingerprint. That catches a wrong copy-on-write, a wrong swap
list, a wrong prefix hit, a block handed out while still in use, and a write into a shared
or cached block.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque

from kvcache_svc import Allocated, Appended, KVCacheManager, NoFreeBlocks, Tier, hash_block
from tests.kvcache.common import snapshot
from tests.kvcache.fingerprints import Fingerprints, MSeq

DEV, HOST = Tier.DEVICE, Tier.HOST


class Driver:
    def __init__(
        self,
        seed: int,
        num_device: int = 64,
        num_host: int = 32,
        block_size: int = 4,
        alphabet: int = 3,
        max_len: int = 40,
        max_seqs: int = 16,
        prefix_caching: bool = True,
        check_every: int = 40,
    ) -> None:
        self.rng = random.Random(seed)
        self.bs, self.alphabet, self.max_len, self.max_seqs = block_size, alphabet, max_len, max_seqs
        self.n = {DEV: num_device, HOST: num_host}
        self.prefix_caching = prefix_caching
        self.check_every = check_every
        self.mgr = KVCacheManager(num_device, num_host, block_size, enable_prefix_caching=prefix_caching)
        self.fp = Fingerprints()
        self.content = {t: [[None] * block_size for _ in range(self.n[t])] for t in (DEV, HOST)}
        self.mref: dict[Tier, dict[int, int]] = {DEV: {}, HOST: {}}  # block -> table entries
        self.mlru: OrderedDict[int, None] = OrderedDict()  # cached unreferenced device blocks, oldest first
        self.evictions = 0
        self.seqs: dict[str, MSeq] = {}
        self.next_id = 0
        self.recent: deque[tuple[list[int], str | None]] = deque(maxlen=12)  # freed, for re-admission
        self.bases = [[self.rng.randrange(alphabet) for _ in range(28)] for _ in range(6)]
        self.stats: dict[str, int] = {}

    # ------------------------------------------------------------------ helpers
    def count(self, key: str, k: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + k

    def nblocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.bs)

    def inc(self, tier: Tier, block: int) -> None:
        self.mref[tier][block] = self.mref[tier].get(block, 0) + 1

    def dec(self, tier: Tier, block: int) -> None:
        r = self.mref[tier][block] - 1
        if r:
            self.mref[tier][block] = r
        else:
            del self.mref[tier][block]
            if tier == DEV and self.mgr.device.blocks[block].block_hash is not None:
                self.mlru[block] = None  # kept for later hits, most recent last

    def take_fresh(self, tier: Tier, blocks: list[int]) -> None:
        """Blocks just handed out: nobody may hold them; their old contents are garbage.
        Device blocks come from the free list first, then from the least recently freed
        cached blocks."""
        assert len(set(blocks)) == len(blocks), f"block handed out twice: {blocks}"
        if tier == DEV:
            num_free_list = self.n[DEV] - len(self.mref[DEV]) - len(self.mlru)
            evicted = list(self.mlru)[: max(0, len(blocks) - num_free_list)]
            assert set(evicted) <= set(blocks), (
                f"evicted {sorted(set(blocks) & set(self.mlru))}, expected oldest {evicted}"
            )
            for b in evicted:
                del self.mlru[b]
            assert not set(blocks) & set(self.mlru), "evicted a cached block while free ones were left"
            self.evictions += len(evicted)
        for b in blocks:
            assert 0 <= b < self.n[tier]
            assert b not in self.mref[tier], f"{tier.name} block {b} handed out while in use"
            self.content[tier][b] = [None] * self.bs

    def gen_prompt(self) -> tuple[list[int], str | None]:
        rng = self.rng
        if self.recent and rng.random() < 0.25:  # a preempted (recomputed) request comes back
            tokens, salt = rng.choice(self.recent)
            return list(tokens), salt
        base = rng.choice(self.bases)
        prompt = base[: rng.randint(0, len(base))] + [rng.randrange(self.alphabet) for _ in range(rng.randint(0, 6))]
        if not prompt:
            prompt = [rng.randrange(self.alphabet)]
        salt = rng.choice((None, None, None, None, None, "s1", "s2"))
        return prompt, salt

    def pick(self, tier: Tier | None = None) -> MSeq | None:
        ids = [sid for sid, s in self.seqs.items() if tier is None or s.tier == tier]
        return self.seqs[self.rng.choice(ids)] if ids else None

    def sid_of(self, seq: MSeq) -> str:
        return next(sid for sid, s in self.seqs.items() if s is seq)

    def hashed_by_content(self) -> dict[tuple, int]:
        out = {}
        for b in self.mgr.device.hash_to_block.values():
            out[tuple(self.content[DEV][b])] = b
        return out

    def check_hit(self, prompt: list[int], salt: str | None, hit) -> None:
        bs, k = self.bs, len(hit.block_ids)
        assert hit.num_tokens == k * bs
        if not self.prefix_caching:
            assert k == 0
            return
        assert k <= (len(prompt) - 1) // bs, "the last prompt token must be left to compute"
        fps = self.fp.of(salt, prompt)
        for i, b in enumerate(hit.block_ids):
            assert self.content[DEV][b] == fps[i * bs : (i + 1) * bs], f"prefix hit on block {b} with other contents"
            assert self.mgr.device.blocks[b].block_hash is not None
        if k < (len(prompt) - 1) // bs:
            # Longest: no registered block holds the next block's contents.
            assert tuple(fps[k * bs : (k + 1) * bs]) not in self.hashed_by_content(), "prefix hit stopped early"
        if k:
            self.count("hits")

    def compute(self, seq: MSeq, num: int) -> None:
        """The forward pass writes positions [computed, computed + num) into the table's blocks."""
        bs, blocks, content = self.bs, self.mgr.device.blocks, self.content[DEV]
        assert seq.tier == DEV
        for p in range(seq.computed, seq.computed + num):
            b = seq.table[p // bs]
            assert self.mref[DEV][b] == 1, f"write into block {b} shared by {self.mref[DEV][b]} tables"
            assert blocks[b].block_hash is None, f"write into cached block {b}"
            content[b][p % bs] = seq.fps[p]
        seq.computed += num

    def maybe_cache(self, sid: str, seq: MSeq, p: float = 0.85) -> None:
        if self.rng.random() < p:
            self.mgr.cache_blocks(sid, seq.tokens, seq.computed)

    def expect_no_change(self, before, result, needed: int, available: int, tier: Tier) -> None:
        assert result == NoFreeBlocks(needed, available, tier), (result, needed, available, tier)
        assert snapshot(self.mgr) == before, "NoFreeBlocks changed the state"

    # ------------------------------------------------------------------ operations
    def op_allocate(self) -> None:
        if len(self.seqs) >= self.max_seqs:
            return self.op_free()
        prompt, salt = self.gen_prompt()
        sid = f"s{self.next_id}"
        self.next_id += 1
        chunk = self.rng.choice((len(prompt), len(prompt), self.rng.randint(1, len(prompt) + 2)))
        hit = self.mgr.match_prefix(prompt, salt)
        self.check_hit(prompt, salt, hit)
        k = len(hit.block_ids)
        num_new = max(1, min(chunk, len(prompt) - hit.num_tokens))
        needed = self.nblocks(hit.num_tokens + num_new) - k
        available = self.n[DEV] - len(self.mref[DEV]) - len({b for b in hit.block_ids if b not in self.mref[DEV]})
        before = snapshot(self.mgr) if needed > available else None
        res = self.mgr.allocate(sid, list(prompt), chunk, salt)
        if before is not None:
            self.expect_no_change(before, res, needed, available, DEV)
            self.count("allocate_nofree")
            return
        assert isinstance(res, Allocated), res
        assert res.num_cached_tokens == hit.num_tokens and res.num_new_tokens == num_new
        assert res.block_ids[:k] == hit.block_ids and len(res.block_ids) == k + needed
        fresh = list(res.block_ids[k:])
        assert not set(fresh) & set(hit.block_ids)
        for b in hit.block_ids:  # referenced again: out of the LRU
            self.mlru.pop(b, None)
            self.inc(DEV, b)
        self.take_fresh(DEV, fresh)
        for b in fresh:
            self.inc(DEV, b)
        seq = MSeq(list(prompt), self.fp.of(salt, prompt), salt, self.next_id, DEV, list(res.block_ids), hit.num_tokens)
        self.seqs[sid] = seq
        self.compute(seq, num_new)
        self.maybe_cache(sid, seq)
        self.count("allocate")

    def op_step(self) -> None:
        seq = self.pick(DEV)
        if seq is None:
            return self.op_allocate()
        self.step(seq)

    def step(self, seq: MSeq) -> Appended | None:
        """One step of `seq`: a decode token, or a chunk of what it has left to compute. The
        manager's answer, or None where nothing was written (NoFreeBlocks, or freed at max_len)."""
        sid = self.sid_of(seq)
        if seq.computed == len(seq.tokens):
            if len(seq.tokens) >= self.max_len:
                self.free(sid)
                return None
            token = self.rng.randrange(self.alphabet)  # "sampled" from the last forward pass
            seq.tokens.append(token)
            seq.fps.append(self.fp.next(seq.fps[-1], token))
            num = 1
        else:  # the rest of a chunked prompt (or of a recomputed sequence)
            num = self.rng.randint(1, min(8, len(seq.tokens) - seq.computed))
        bs, table = self.bs, seq.table
        shared = [i for i in range(seq.computed // bs, len(table)) if self.mref[DEV][table[i]] > 1]
        grow = max(0, self.nblocks(seq.computed + num) - len(table))
        needed, available = grow + len(shared), self.n[DEV] - len(self.mref[DEV])
        before = snapshot(self.mgr) if needed > available else None
        res = self.mgr.append_slots(sid, seq.computed, num)
        if before is not None:
            self.expect_no_change(before, res, needed, available, DEV)
            self.count("append_nofree")
            return None
        assert isinstance(res, Appended), res
        assert [i for i, _ in res.replaced] == shared
        assert res.copies == [(table[i], new) for i, new in res.replaced if i * bs < seq.computed]
        assert len(res.new_block_ids) == grow
        self.take_fresh(DEV, [new for _, new in res.replaced] + res.new_block_ids)
        for src, dst in res.copies:  # the model service copies before the forward pass
            self.content[DEV][dst] = list(self.content[DEV][src])
        for i, new in res.replaced:
            self.dec(DEV, table[i])
            table[i] = new
            self.inc(DEV, new)
        for b in res.new_block_ids:
            table.append(b)
            self.inc(DEV, b)
        assert self.mgr.block_table(sid) == table
        if self.rng.random() < 0.1:
            # The step was abandoned after its slots were reserved: the table now reaches past
            # the computed tokens (a fork then shares blocks that hold nothing computed yet).
            self.count("reserved_only")
        else:
            self.compute(seq, num)
            self.maybe_cache(sid, seq)
        self.count("append")
        self.count("cow_copies", len(res.copies))
        self.count("cow_no_copy", len(res.replaced) - len(res.copies))
        return res

    def op_cache(self) -> None:
        seq = self.pick(self.rng.choice((DEV, None)))
        if seq is not None:
            self.mgr.cache_blocks(self.sid_of(seq), seq.tokens, seq.computed)  # host: a no-op

    def op_fork(self) -> None:
        parent = self.pick()
        if parent is None or len(self.seqs) >= self.max_seqs:
            return
        self.fork(parent)

    def fork(self, parent: MSeq) -> MSeq:
        sid = f"s{self.next_id}"
        self.next_id += 1
        self.mgr.fork(self.sid_of(parent), sid)
        child = MSeq(
            list(parent.tokens),
            list(parent.fps),
            parent.salt,
            parent.family,
            parent.tier,
            list(parent.table),
            parent.computed,
        )
        self.seqs[sid] = child
        for b in child.table:
            self.inc(child.tier, b)
        assert self.mgr.block_table(sid) == child.table and self.mgr.tier(sid) == child.tier
        self.count("fork")
        return child

    def op_parallel(self) -> None:
        """n > 1 sampling: k children of a device sequence take its place, then each writes
        position `computed`. Of the h tables holding that block once the parent is gone, a
        child copies (or, where nothing there is computed, replaces) it while another still
        holds it: min(k, h - 1) of them do, so with no outside holder k - 1, once each."""
        parent, k = self.pick(DEV), self.rng.randint(2, 4)
        if parent is None or len(self.seqs) + k > self.max_seqs or len(parent.tokens) >= self.max_len:
            return
        kids = [self.fork(parent) for _ in range(k)]
        self.free(self.sid_of(parent))
        w = parent.computed // self.bs  # the block every child writes first
        holders = self.mref[DEV].get(parent.table[w], 0) if w < len(parent.table) else 0
        written = []
        for kid in kids:
            res = self.step(kid)
            if res is None:  # short of blocks: the rest of the children wait (nothing to count)
                return
            written.append([i for i, _ in res.replaced if i == w])
            assert res.copies == [] or parent.computed % self.bs, "a block with nothing computed is never copied"
        assert sum(map(len, written)) == min(k, max(0, holders - 1)), (written, holders)
        assert all(len(x) <= 1 for x in written), "a child copied the shared block twice"
        self.count("parallel_cow", sum(map(len, written)))

    def op_free(self) -> None:
        seq = self.pick()
        if seq is not None:
            self.free(self.sid_of(seq))

    def free(self, sid: str) -> None:
        seq = self.seqs.pop(sid)
        self.mgr.free(sid)
        for b in reversed(seq.table):  # tail first: the tail is evicted first
            self.dec(seq.tier, b)
        self.recent.append((seq.tokens, seq.salt))
        self.count("free")

    def op_swap(self, src: Tier) -> None:
        seq = self.pick(src)
        if seq is None:
            return
        sid, dst = self.sid_of(seq), HOST if src == DEV else DEV
        needed, available = len(seq.table), self.n[dst] - len(self.mref[dst])
        before = snapshot(self.mgr) if needed > available else None
        copies = self.mgr.swap_out(sid) if src == DEV else self.mgr.swap_in(sid)
        name = "swap_out" if src == DEV else "swap_in"
        if before is not None:
            self.expect_no_change(before, copies, needed, available, dst)
            self.count(name + "_nofree")
            return
        assert isinstance(copies, list) and len(copies) == len(seq.table)
        assert [s for s, _ in copies] == seq.table, "the copy list must map every block, in order"
        new = [d for _, d in copies]
        self.take_fresh(dst, new)
        for s, d in copies:
            self.content[dst][d] = list(self.content[src][s])
        for b in reversed(seq.table):
            self.dec(src, b)
        for b in new:
            self.inc(dst, b)
        seq.table, seq.tier = new, dst
        assert self.mgr.tier(sid) == dst and self.mgr.block_table(sid) == new
        if dst == DEV:
            self.maybe_cache(sid, seq, 0.5)
        self.count(name)

    def op_match(self) -> None:
        seq = self.pick()
        if seq is not None and self.rng.random() < 0.5:
            prompt = seq.tokens + [self.rng.randrange(self.alphabet) for _ in range(self.rng.randint(0, 5))]
            salt = seq.salt
        else:
            prompt, salt = self.gen_prompt()
        self.check_hit(prompt, salt, self.mgr.match_prefix(prompt, salt))
        self.count("match")

    # ------------------------------------------------------------------ checks
    def full_check(self) -> None:
        mgr, bs = self.mgr, self.bs
        mgr.check_invariants()
        assert set(mgr.seqs) == set(self.seqs)
        holders: dict[Tier, dict[int, list[tuple[MSeq, int]]]] = {DEV: {}, HOST: {}}
        for sid, seq in self.seqs.items():
            assert mgr.tier(sid) == seq.tier
            assert mgr.block_table(sid) == seq.table
            assert self.nblocks(seq.computed) <= len(seq.table) <= self.nblocks(len(seq.tokens)), "table size"
            content = self.content[seq.tier]
            for p in range(seq.computed):
                assert content[seq.table[p // bs]][p % bs] == seq.fps[p], f"{sid} position {p}: wrong KV contents"
            for i, b in enumerate(seq.table):
                holders[seq.tier].setdefault(b, []).append((seq, i))
        for tier, pool in mgr.pools.items():
            mref = self.mref[tier]
            for block in pool.blocks:
                assert block.ref_count == mref.get(block.block_id, 0), f"{tier.name} block {block.block_id} ref"
            assert pool.num_used_blocks == len(mref)
            assert pool.num_free_blocks == self.n[tier] - len(mref)
            assert len(pool.free_ids) + len(pool.lru) + len(mref) == self.n[tier]
            # Sharing: a block not full and computed in every holder is only shared in a family.
            for b, hs in holders[tier].items():
                if len(hs) > 1 and any((i + 1) * bs > s.computed for s, i in hs):
                    assert len({s.family for s, _ in hs}) == 1, f"{tier.name} block {b} shared outside a fork"
        assert not any(b.block_hash is not None for b in mgr.host.blocks), "host blocks are never hashed"
        assert list(mgr.device.lru) == list(self.mlru), "LRU order"
        assert mgr.device.num_evictions == self.evictions
        # Every registered block holds what its hash says: recompute the chain from contents.
        for h, b in mgr.device.hash_to_block.items():
            content = self.content[DEV][b]
            assert None not in content, f"cached block {b} is not fully computed"
            salt, tokens = self.fp.prefix(content[-1])
            assert len(tokens) % bs == 0 and content == self.fp.of(salt, tokens)[-bs:]
            chain = None
            for i in range(0, len(tokens), bs):
                chain = hash_block(chain, tuple(tokens[i : i + bs]), salt)
            assert chain == h == mgr.device.blocks[b].block_hash, f"block {b} hash does not match its contents"
            assert mgr.device.blocks[b].token_ids == tuple(tokens[-bs:])

    # ------------------------------------------------------------------ driver
    def run(self, num_ops: int) -> dict[str, int]:
        ops = (
            (self.op_allocate, 18),
            (self.op_step, 40),
            (self.op_cache, 4),
            (self.op_fork, 5),
            (self.op_parallel, 3),
            (self.op_free, 10),
            (lambda: self.op_swap(DEV), 8),
            (lambda: self.op_swap(HOST), 10),
            (self.op_match, 5),
        )
        funcs = [f for f, _ in ops]
        weights = [w for _, w in ops]
        choices = self.rng.choices(funcs, weights, k=num_ops)
        for n, op in enumerate(choices, 1):
            op()
            if n % 4 == 0:
                self.mgr.check_invariants()
            if n % self.check_every == 0:
                self.full_check()
        self.full_check()
        for sid in list(self.seqs):
            self.free(sid)
            if self.rng.random() < 0.2:
                self.mgr.check_invariants()
        self.full_check()
        assert self.mgr.all_free_or_cached()
        assert not self.mref[DEV] and not self.mref[HOST]
        assert self.mgr.host.num_free_blocks == self.n[HOST] and len(self.mgr.host.free_ids) == self.n[HOST]
        self.stats["evictions"] = self.mgr.device.num_evictions
        return self.stats
