"""The two KV pools: swaps and copy-on-write move exactly the listed blocks, whatever runs of
consecutive ids the lists hold, and leave every other block alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model_svc import kv_cache
from model_svc.kv_cache import KVCachePools, _runs

CONFIG = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=4)


def make_pools(device: str = "cpu", dtype: torch.dtype = torch.float32) -> KVCachePools:
    pools = KVCachePools(CONFIG, 4, 12, 10, torch.device(device), dtype)
    pools.device_cache.copy_(torch.randn(pools.device_cache.shape))
    pools.host_cache.copy_(torch.randn(pools.host_cache.shape))
    return pools


def device_block(pools: KVCachePools, b: int) -> torch.Tensor:  # (L, 2, bs, H, D)
    return pools.device_cache[:, :, b].cpu()


def test_runs():
    assert _runs([]) == []
    assert _runs([4, 5, 6, 1, 2, 9]) == [(0, 4, 3), (3, 1, 2), (5, 9, 1)]


@pytest.mark.parametrize("chunk", [256, 2])  # 2: the pair list is staged in several chunks
def test_swap_out_then_in_round_trips_the_listed_blocks(monkeypatch, chunk):
    monkeypatch.setattr(kv_cache, "SWAP_CHUNK_BLOCKS", chunk)
    pools = make_pools()
    before_dev = pools.device_cache.clone()
    before_host = pools.host_cache.clone()
    out = [(3, 0), (4, 1), (5, 2), (9, 7), (0, 4)]  # a run, then scattered ids
    pools.swap_out(out)
    for s, d in out:
        assert torch.equal(pools.host_cache[d], device_block(pools, s))
    untouched = [h for h in range(10) if h not in {d for _, d in out}]
    assert torch.equal(pools.host_cache[untouched], before_host[untouched])
    assert torch.equal(pools.device_cache, before_dev)  # a swap-out copies; the scheduler frees
    back = [(0, 11), (7, 6), (1, 7), (2, 8), (4, 1)]
    pools.swap_in(back)
    for h, d in back:
        assert torch.equal(device_block(pools, d), pools.host_cache[h])
    others = [b for b in range(12) if b not in {d for _, d in back}]
    assert torch.equal(pools.device_cache[:, :, others], before_dev[:, :, others])
    assert torch.equal(device_block(pools, 11), before_dev[:, :, 3])  # device 3 -> host 0 -> device 11


def test_copy_on_write_and_empty_lists():
    pools = make_pools()
    before = pools.device_cache.clone()
    pools.copy_device([(1, 5), (2, 6)])
    assert torch.equal(pools.device_cache[:, :, 5], before[:, :, 1])
    assert torch.equal(pools.device_cache[:, :, 6], before[:, :, 2])
    pools.swap_out([])
    pools.swap_in([])
    pools.copy_device([])
    assert pools.num_device_blocks == 12 and pools.num_host_blocks == 10
    k, v = pools.layer_caches[1]
    assert k.shape == (12, 4, 2, 4) and torch.equal(v, pools.device_cache[1, 1])


def test_fp8_pools_move_their_bytes():
    """An FP8 pool (kv_cache_dtype="fp8"), which torch's indexed copies do not take: swaps and
    copy-on-write move its blocks bit for bit, at one byte an element."""
    fp8 = torch.float8_e4m3fn
    pools = make_pools(dtype=fp8)
    assert KVCachePools.bytes_per_block(CONFIG, 4, fp8) * 4 == KVCachePools.bytes_per_block(CONFIG, 4, torch.float32)
    dev = pools.device_cache.view(torch.uint8)  # the pools as bytes: torch.equal takes no FP8
    before = dev.clone()
    pools.swap_out([(3, 0), (9, 5)])
    pools.swap_in([(0, 11), (5, 10)])
    pools.copy_device([(1, 6)])
    assert torch.equal(dev[:, :, 11], before[:, :, 3]) and torch.equal(dev[:, :, 10], before[:, :, 9])
    assert torch.equal(dev[:, :, 6], before[:, :, 1])
    others = [b for b in range(12) if b not in (6, 10, 11)]
    assert torch.equal(dev[:, :, others], before[:, :, others])
    assert pools.layer_caches[0][0].dtype == fp8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_swaps_on_cuda_are_ordered_with_the_stream():
    pools = make_pools("cuda")
    assert pools.host_cache.is_pinned()
    before = pools.device_cache.clone()
    pools.swap_out([(2, 3), (3, 4), (7, 0)])
    pools.device_cache[:, :, [2, 3, 7]] = 0  # the freed blocks are reused right away
    pools.swap_in([(3, 9), (4, 10), (0, 11)])
    torch.cuda.synchronize()
    assert torch.equal(pools.device_cache[:, :, [9, 10, 11]], before[:, :, [2, 3, 7]])


def test_a_repeated_destination_takes_its_last_copy():
    """A step's swap-in list may fill a block, then (the block freed and handed out again in
    the same schedule) fill it once more: the last copy is the one that holds. One indexed
    copy with a repeated index keeps an arbitrary one on CUDA, so the list is reduced first."""
    assert kv_cache.last_per_destination([(1, 5), (2, 6), (3, 5)]) == [(3, 5), (2, 6)]
    pairs = [(0, 1), (4, 2)]
    assert kv_cache.last_per_destination(pairs) is pairs
    pools = make_pools()
    pools.swap_in([(2, 7), (3, 8), (5, 7)])
    assert torch.equal(device_block(pools, 7), pools.host_cache[5].cpu())
    assert torch.equal(device_block(pools, 8), pools.host_cache[3].cpu())
