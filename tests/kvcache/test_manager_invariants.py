"""The KV-cache manager's invariant check: every corruption of the pools it must catch."""

from __future__ import annotations

import pytest

from kvcache_svc import KVCacheManager
from kvcache_svc.block_pool import BlockOpError

from .common import make, run_prompt


def _busy_manager() -> KVCacheManager:
    mgr = make(num_device=16, num_host=8)
    run_prompt(mgr, "a", list(range(10)))
    run_prompt(mgr, "b", list(range(100, 109)))
    mgr.free("b")  # leaves cached blocks in the LRU
    run_prompt(mgr, "c", list(range(200, 206)))
    mgr.fork("c", "d")
    mgr.swap_out("d")
    mgr.check_invariants()
    return mgr


def _corrupt_table_points_at_free_block(mgr):
    mgr.seqs["a"].block_ids[2] = mgr.device.free_ids[0]


def _corrupt_table_points_at_cached_block(mgr):
    mgr.seqs["a"].block_ids[2] = next(iter(mgr.device.lru))


def _corrupt_ref_count_up(mgr):
    mgr.device.blocks[mgr.seqs["a"].block_ids[0]].ref_count += 1


def _corrupt_ref_count_down(mgr):
    mgr.device.blocks[mgr.seqs["c"].block_ids[0]].ref_count -= 1  # shared with nobody now: 1 -> 0


def _corrupt_host_ref(mgr):
    mgr.host.blocks[mgr.seqs["d"].block_ids[0]].ref_count = 2


def _corrupt_leak(mgr):
    del mgr.seqs["a"]  # dropped without releasing its blocks


def _corrupt_free_and_cached(mgr):
    mgr.device.free_ids.append(next(iter(mgr.device.lru)))


def _corrupt_free_twice(mgr):
    mgr.device.free_ids.append(mgr.device.free_ids[0])


def _corrupt_cached_without_hash(mgr):
    block = mgr.device.blocks[next(iter(mgr.device.lru))]
    del mgr.device.hash_to_block[block.block_hash]
    block.block_hash = None


def _corrupt_free_with_hash(mgr):
    mgr.device.blocks[mgr.device.free_ids[0]].block_hash = 12345


def _corrupt_stale_hash_index(mgr):
    mgr.device.hash_to_block[777] = mgr.device.free_ids[0]


def _corrupt_lost_block(mgr):
    mgr.device.free_ids.popleft()  # neither free, cached nor used


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_table_points_at_free_block,
        _corrupt_table_points_at_cached_block,
        _corrupt_ref_count_up,
        _corrupt_ref_count_down,
        _corrupt_host_ref,
        _corrupt_leak,
        _corrupt_free_and_cached,
        _corrupt_free_twice,
        _corrupt_cached_without_hash,
        _corrupt_free_with_hash,
        _corrupt_stale_hash_index,
        _corrupt_lost_block,
    ],
)
def test_check_invariants_catches_corruption(corrupt):
    mgr = _busy_manager()
    corrupt(mgr)
    with pytest.raises(AssertionError):
        mgr.check_invariants()


def test_release_twice_is_caught():
    mgr = make()
    res = mgr.allocate("a", [1, 2, 3], 3)
    mgr.free("a")
    with pytest.raises(BlockOpError):
        mgr.device.release(res.block_ids[0])


def test_all_free_or_cached():
    mgr = make()
    assert mgr.all_free_or_cached()
    run_prompt(mgr, "a", list(range(9)))
    assert not mgr.all_free_or_cached()
    mgr.swap_out("a")
    assert not mgr.all_free_or_cached()
    mgr.free("a")
    assert mgr.all_free_or_cached()
    assert mgr.device.num_used_blocks == 0 and mgr.host.num_used_blocks == 0
    mgr.check_invariants()
