"""Focused unit tests for the KV-cache block manager (pure Python, no torch)."""

from __future__ import annotations

import pytest

from contracts import block_hash as hashing
from kvcache_svc import Allocated, Appended, KVCacheManager, NoFreeBlocks, PrefixHit, Tier, hash_block
from kvcache_svc.block_pool import BlockOpError

from .common import BS, make, refs, run_prompt, snapshot

# --------------------------------------------------------------------------- allocate


def test_allocate_without_prefix_hit():
    mgr = make()
    res = mgr.allocate("a", list(range(10)), 10)
    assert isinstance(res, Allocated)
    assert res.num_cached_tokens == 0 and res.num_new_tokens == 10
    assert len(res.block_ids) == 3 and len(set(res.block_ids)) == 3
    assert mgr.block_table("a") == res.block_ids
    assert mgr.tier("a") == Tier.DEVICE
    assert all(mgr.device.blocks[b].ref_count == 1 for b in res.block_ids)
    assert mgr.num_free_blocks() == 13
    mgr.check_invariants()


def test_allocate_chunk_and_clamp():
    mgr = make()
    res = mgr.allocate("a", list(range(10)), 5)  # chunked prefill: room for 5 tokens only
    assert res.num_new_tokens == 5 and len(res.block_ids) == 2
    res = mgr.allocate("b", list(range(100, 110)), 1000)  # clamped to the prompt
    assert res.num_new_tokens == 10 and len(res.block_ids) == 3
    mgr.check_invariants()


def test_allocate_with_prefix_hit():
    mgr = make()
    prompt = list(range(10))
    a = run_prompt(mgr, "a", prompt)
    res = mgr.allocate("b", prompt, len(prompt))
    assert res.num_cached_tokens == 8  # the two full blocks
    assert res.num_new_tokens == 2
    assert res.block_ids[:2] == a.block_ids[:2]
    assert res.block_ids[2] not in a.block_ids
    assert refs(mgr)[a.block_ids[0]] == 2 and refs(mgr)[a.block_ids[1]] == 2
    assert refs(mgr)[a.block_ids[2]] == 1 and refs(mgr)[res.block_ids[2]] == 1
    assert mgr.num_prefix_queries == 20 and mgr.num_prefix_hits == 8
    mgr.check_invariants()


def test_chain_continues_after_prefix_hit():
    """A sequence that starts from a hit registers its later blocks under the full chain."""
    mgr = make()
    base = list(range(9))
    a = run_prompt(mgr, "a", base)
    longer = base[:8] + list(range(50, 59))
    b = run_prompt(mgr, "b", longer)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    hit = mgr.match_prefix(longer + [0])
    assert hit.block_ids == b.block_ids[:4]
    chain = None
    for i in range(4):
        chain = hash_block(chain, tuple(longer[i * BS : (i + 1) * BS]), None)
        assert mgr.device.blocks[b.block_ids[i]].block_hash == chain
    mgr.check_invariants()


def test_prefix_hit_longer_prompt_and_mismatch():
    mgr = make()
    prompt = list(range(12))
    a = run_prompt(mgr, "a", prompt)
    # Same first block, different second block: hit stops at the first mismatch.
    hit = mgr.match_prefix(prompt[:4] + [99] + prompt[5:])
    assert hit.num_tokens == 4 and hit.block_ids == a.block_ids[:1]
    # Different first block, identical later blocks: the chain hash gives no hit.
    hit = mgr.match_prefix([99] + prompt[1:])
    assert hit == PrefixHit(0, [])
    # Longer prompt extending a: all three cached blocks.
    hit = mgr.match_prefix(prompt + [7, 7])
    assert hit.num_tokens == 12 and hit.block_ids == a.block_ids


def test_hit_capped_so_last_prompt_token_is_computed():
    mgr = make()
    prompt = list(range(8))  # exactly two full blocks
    a = run_prompt(mgr, "a", prompt)
    assert mgr.match_prefix(prompt).num_tokens == 4  # not 8: the last token must be computed
    assert mgr.match_prefix(prompt + [1]).num_tokens == 8
    assert mgr.match_prefix(prompt[:4]).num_tokens == 0
    assert mgr.match_prefix(prompt[:5]).num_tokens == 4
    res = mgr.allocate("b", prompt, 8)
    assert res.num_cached_tokens == 4 and res.num_new_tokens == 4
    assert res.block_ids[0] == a.block_ids[0] and res.block_ids[1] != a.block_ids[1]
    mgr.check_invariants()


def test_hit_only_on_full_blocks():
    mgr = make()
    prompt = list(range(6))
    a = run_prompt(mgr, "a", prompt)
    assert mgr.device.blocks[a.block_ids[0]].block_hash is not None
    assert mgr.device.blocks[a.block_ids[1]].block_hash is None  # partial: never hashed
    hit = mgr.match_prefix(prompt + [6, 7, 8, 9])
    assert hit.num_tokens == 4 and hit.block_ids == a.block_ids[:1]


def test_hash_collision_compares_tokens(monkeypatch):
    """Every block hashes the same: the token comparison must stop a wrong reuse."""
    monkeypatch.setattr(hashing, "chain_bytes", lambda data, width, parent, key: iter([42] * (len(data) // width)))
    mgr = make()
    a = run_prompt(mgr, "a", [1, 2, 3, 4, 5])
    assert mgr.device.hash_to_block == {42: a.block_ids[0]}
    # Different tokens, same (colliding) hash: no hit.
    assert mgr.match_prefix([5, 6, 7, 8, 9]) == PrefixHit(0, [])
    b = mgr.allocate("b", [5, 6, 7, 8, 9], 5)
    assert b.num_cached_tokens == 0
    assert a.block_ids[0] not in b.block_ids
    # b's full block collides with a's: it is not registered and frees to the free list.
    mgr.cache_blocks("b", [5, 6, 7, 8, 9], 5)
    assert mgr.device.blocks[b.block_ids[0]].block_hash is None
    mgr.free("b")
    assert b.block_ids[0] in mgr.device.free_ids and b.block_ids[0] not in mgr.device.lru
    # Positive control: the same tokens do hit.
    c = mgr.allocate("c", [1, 2, 3, 4, 9], 5)
    assert c.num_cached_tokens == 4 and c.block_ids[0] == a.block_ids[0]
    mgr.check_invariants()


def test_extra_key_separates_prefixes():
    mgr = make()
    prompt = list(range(9))
    a = run_prompt(mgr, "a", prompt, extra_key="salt-x")
    assert mgr.match_prefix(prompt, "salt-y").num_tokens == 0
    assert mgr.match_prefix(prompt).num_tokens == 0
    assert mgr.match_prefix(prompt, "salt-x").block_ids == a.block_ids[:2]
    b = run_prompt(mgr, "b", prompt, extra_key="salt-y")
    assert b.num_cached_tokens == 0 and not set(b.block_ids) & set(a.block_ids)
    assert mgr.match_prefix(prompt, "salt-y").block_ids == b.block_ids[:2]
    # A forked child keeps the parent's key: its new full blocks hash with it.
    mgr.fork("b", "b2")
    app = mgr.append_slots("b2", 9, 3)
    assert isinstance(app, Appended)
    mgr.cache_blocks("b2", prompt + [9, 9, 9], 12)
    assert mgr.match_prefix(prompt + [9, 9, 9, 0], "salt-y").num_tokens == 12
    assert mgr.match_prefix(prompt + [9, 9, 9, 0], "salt-x").num_tokens == 8
    mgr.check_invariants()


def test_chain_hashes_equal_hash_block_one_by_one():
    tokens = list(range(100, 140))
    chain, expected = 7, []
    for i in range(2, 9):
        chain = hash_block(chain, tuple(tokens[i * 4 : (i + 1) * 4]), "salt")
        expected.append(chain)
    assert list(hashing.chain_hashes(tokens, 4, 2, 9, 7, "salt")) == expected
    assert list(hashing.chain_hashes(tokens, 4, 3, 3, 7, None)) == []


def test_hash_block_is_chained_and_stable():
    # the value itself is persisted in the metadata store: it must not change between versions
    assert hash_block(None, (1, 2, 3, 4), None) == 0x2728AB4454AAA05B
    h0 = hash_block(None, (1, 2, 3, 4), None)
    assert h0 == hash_block(None, (1, 2, 3, 4), None)
    assert h0 != hash_block(None, (1, 2, 3, 5), None)
    assert h0 != hash_block(None, (1, 2, 3, 4), "k")
    assert hash_block(h0, (5, 6, 7, 8), None) != hash_block(h0 + 1, (5, 6, 7, 8), None)
    assert 0 <= h0 < 2**64


# --------------------------------------------------------------------------- NoFreeBlocks


def test_allocate_no_free_blocks_changes_nothing():
    mgr = make(num_device=4)
    prompt = list(range(9))
    run_prompt(mgr, "a", prompt)
    mgr.free("a")  # 2 cached blocks in the LRU, 2 free
    # Hit 2 LRU blocks (8 tokens), then 9 more tokens need 3 blocks; only 2 are left once
    # the hit blocks stop being evictable.
    before = snapshot(mgr)
    res = mgr.allocate("b", prompt[:8] + list(range(50, 59)), 100)
    assert isinstance(res, NoFreeBlocks)
    assert (res.needed, res.available, res.tier) == (3, 2, Tier.DEVICE)
    assert snapshot(mgr) == before
    mgr.check_invariants()
    # Exactly enough: succeeds without evicting the hit blocks.
    res = mgr.allocate("b", prompt[:8] + list(range(50, 58)), 100)
    assert isinstance(res, Allocated) and res.num_cached_tokens == 8 and len(res.block_ids) == 4
    assert mgr.device.num_evictions == 0
    mgr.check_invariants()
    before = snapshot(mgr)
    res = mgr.allocate("c", [1], 1)
    assert res == NoFreeBlocks(1, 0, Tier.DEVICE)
    assert snapshot(mgr) == before


def test_append_no_free_blocks_changes_nothing():
    mgr = make(num_device=4)
    run_prompt(mgr, "a", list(range(6)))  # 2 blocks, last partial
    mgr.fork("a", "b")
    mgr.allocate("c", list(range(100, 108)), 8)  # takes the other 2
    mgr.check_invariants()
    before = snapshot(mgr)
    res = mgr.append_slots("a", 6, 1)  # needs a copy of the shared partial block
    assert res == NoFreeBlocks(1, 0, Tier.DEVICE)
    assert snapshot(mgr) == before
    mgr.free("c")
    before = snapshot(mgr)
    res = mgr.append_slots("a", 6, 7)  # 1 copy-on-write + 2 new blocks > 2 free
    assert res == NoFreeBlocks(3, 2, Tier.DEVICE)
    assert snapshot(mgr) == before
    mgr.check_invariants()


def test_swap_no_free_blocks_changes_nothing():
    mgr = make(num_device=8, num_host=2)
    run_prompt(mgr, "a", list(range(9)))  # 3 blocks > 2 host blocks
    before = snapshot(mgr)
    res = mgr.swap_out("a")
    assert res == NoFreeBlocks(3, 2, Tier.HOST)
    assert snapshot(mgr) == before
    # Device full on swap-in.
    mgr2 = make(num_device=3, num_host=8)
    run_prompt(mgr2, "a", list(range(9)))
    assert isinstance(mgr2.swap_out("a"), list)
    mgr2.allocate("b", list(range(100, 102)), 2)
    before = snapshot(mgr2)
    res = mgr2.swap_in("a")
    assert res == NoFreeBlocks(3, 2, Tier.DEVICE)
    assert snapshot(mgr2) == before
    mgr2.check_invariants()


# --------------------------------------------------------------------------- append, fork, COW


def test_append_slots_grows_table():
    mgr = make()
    mgr.allocate("a", list(range(4)), 4)
    app = mgr.append_slots("a", 4, 1)
    assert isinstance(app, Appended) and len(app.new_block_ids) == 1
    assert app.copies == [] and app.replaced == []
    assert mgr.append_slots("a", 5, 3).new_block_ids == []  # fills the second block
    assert len(mgr.append_slots("a", 8, 9).new_block_ids) == 3  # a chunk over 3 blocks
    assert len(mgr.block_table("a")) == 5
    assert len(set(mgr.block_table("a"))) == 5
    mgr.check_invariants()


def test_fork_shares_and_cow_copies_partial_computed_block():
    mgr = make()
    a = run_prompt(mgr, "a", list(range(6)))  # block 1 holds 2 computed tokens
    mgr.fork("a", "b")
    assert mgr.block_table("b") == a.block_ids
    assert all(mgr.device.blocks[x].ref_count == 2 for x in a.block_ids)
    mgr.check_invariants()
    app = mgr.append_slots("a", 6, 1)
    assert isinstance(app, Appended)
    ((src, dst),) = app.copies
    assert src == a.block_ids[1] and dst not in a.block_ids
    assert app.replaced == [(1, dst)] and app.new_block_ids == []
    assert mgr.block_table("a") == [a.block_ids[0], dst]
    assert mgr.block_table("b") == a.block_ids
    assert refs(mgr) == {a.block_ids[0]: 2, a.block_ids[1]: 1, dst: 1}
    # b now owns its last block alone: it writes in place.
    app = mgr.append_slots("b", 6, 1)
    assert app.copies == [] and app.replaced == [] and app.new_block_ids == []
    assert mgr.block_table("a")[-1] != mgr.block_table("b")[-1]
    mgr.check_invariants()
    mgr.free("a")
    mgr.free("b")
    mgr.check_invariants()
    assert mgr.all_free_or_cached()


def test_cow_without_copy_when_shared_block_holds_no_computed_tokens():
    mgr = make()
    run_prompt(mgr, "a", list(range(8)))
    assert len(mgr.append_slots("a", 8, 4).new_block_ids) == 1  # room for 4, not computed yet
    mgr.fork("a", "b")
    app = mgr.append_slots("a", 8, 4)
    assert app.copies == []  # nothing computed in it: no copy needed
    assert len(app.replaced) == 1 and app.replaced[0][0] == 2
    assert mgr.block_table("a")[:2] == mgr.block_table("b")[:2]
    assert mgr.block_table("a")[2] != mgr.block_table("b")[2]
    mgr.check_invariants()


def test_full_shared_blocks_not_copied():
    mgr = make()
    a = run_prompt(mgr, "a", list(range(8)))
    mgr.fork("a", "b")
    app = mgr.append_slots("a", 8, 1)
    assert app.copies == [] and app.replaced == [] and len(app.new_block_ids) == 1
    assert mgr.block_table("a")[:2] == mgr.block_table("b") == a.block_ids
    mgr.check_invariants()


def test_fork_then_free_parent_keeps_child_blocks():
    mgr = make()
    a = run_prompt(mgr, "a", list(range(6)))
    mgr.fork("a", "b")
    mgr.free("a")
    assert refs(mgr) == {a.block_ids[0]: 1, a.block_ids[1]: 1}
    app = mgr.append_slots("b", 6, 1)
    assert app.copies == []  # b is now the only owner
    mgr.check_invariants()


# --------------------------------------------------------------------------- swap


def test_swap_out_and_in():
    mgr = make(num_device=8, num_host=8)
    prompt = list(range(10))
    a = run_prompt(mgr, "a", prompt)
    copies = mgr.swap_out("a")
    assert isinstance(copies, list) and len(copies) == 3
    assert [d for d, _ in copies] == a.block_ids
    host_ids = [h for _, h in copies]
    assert mgr.block_table("a") == host_ids and len(set(host_ids)) == 3
    assert mgr.tier("a") == Tier.HOST
    assert refs(mgr, Tier.DEVICE) == {}
    assert refs(mgr, Tier.HOST) == {h: 1 for h in host_ids}
    assert mgr.num_free_blocks(Tier.HOST) == 5
    # Its hashed device blocks stay in the prefix cache.
    assert mgr.match_prefix(prompt).block_ids == a.block_ids[:2]
    mgr.check_invariants()
    copies = mgr.swap_in("a")
    assert isinstance(copies, list) and [h for h, _ in copies] == host_ids
    dev_ids = [d for _, d in copies]
    assert mgr.block_table("a") == dev_ids and mgr.tier("a") == Tier.DEVICE
    assert refs(mgr, Tier.HOST) == {} and mgr.num_free_blocks(Tier.HOST) == 8
    assert refs(mgr, Tier.DEVICE) == {d: 1 for d in dev_ids}
    mgr.check_invariants()
    # Swapped back and computed on: the sequence continues normally.
    assert isinstance(mgr.append_slots("a", 10, 3), Appended)
    mgr.cache_blocks("a", prompt + [1, 2, 3], 13)
    mgr.check_invariants()
    mgr.free("a")
    assert mgr.all_free_or_cached()
    mgr.check_invariants()


def test_swap_out_forked_sequence():
    mgr = make(num_device=8, num_host=8)
    a = run_prompt(mgr, "a", list(range(6)))
    mgr.fork("a", "b")
    copies = mgr.swap_out("b")
    assert [d for d, _ in copies] == a.block_ids
    assert refs(mgr, Tier.DEVICE) == {x: 1 for x in a.block_ids}
    mgr.fork("b", "c")  # fork on the host tier shares host blocks
    assert refs(mgr, Tier.HOST) == {h: 2 for _, h in copies}
    mgr.check_invariants()
    back = mgr.swap_in("b")
    assert [h for h, _ in back] == [h for _, h in copies]
    assert refs(mgr, Tier.HOST) == {h: 1 for _, h in copies}
    mgr.check_invariants()
    with pytest.raises(BlockOpError):
        mgr.swap_in("b")  # already on the device
    with pytest.raises(BlockOpError):
        mgr.append_slots("c", 6, 1)  # swapped out: not writable
    for s in ("a", "b", "c"):
        mgr.free(s)
    assert mgr.all_free_or_cached()
    mgr.check_invariants()


def test_bad_sizes_rejected():
    with pytest.raises(ValueError):
        KVCacheManager(4, 4, 0)
    with pytest.raises(ValueError):
        KVCacheManager(-1, 4, 4)
