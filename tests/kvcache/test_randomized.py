"""The randomized driver (tests/kvcache/randomized_driver.py) on small pools: every path of
the KV-cache manager exercised, every computed position checked against the model's own
fingerprint throughout."""

from __future__ import annotations

import pytest

from tests.kvcache.randomized_driver import Driver

COVERED = (
    "allocate", "allocate_nofree", "append", "append_nofree", "cow_copies", "cow_no_copy", "fork", "free",
    "parallel_cow",
    "swap_out", "swap_out_nofree", "swap_in", "swap_in_nofree", "match", "hits", "evictions",
)  # fmt: skip


@pytest.mark.parametrize(("seed", "num_ops"), [(0, 100_000), (1, 20_000), (2, 20_000), (3, 20_000)])
def test_randomized_against_model(seed, num_ops):
    stats = Driver(seed).run(num_ops)
    for key in COVERED:  # the run really exercised every path
        assert stats.get(key, 0) > 0, (key, stats)


def test_randomized_without_prefix_caching():
    stats = Driver(10, prefix_caching=False).run(10_000)
    assert stats.get("hits", 0) == 0 and stats["cow_copies"] > 0 and stats["swap_in"] > 0


def test_randomized_tight_pools():
    """Pools barely larger than one sequence and block size 1 or 3: constant pressure."""
    for seed, bs in ((20, 1), (21, 3)):
        Driver(seed, num_device=14, num_host=10, block_size=bs, max_len=12, max_seqs=6, check_every=10).run(5_000)
