"""The KV-cache manager refuses operations that do not apply with real exceptions, so that
under `python -O` (asserts stripped) a bad sequence of operations still changes nothing
instead of corrupting a block table. The checks here use no `assert` of their own: they run
in this process and again in a `python -O` child."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcache_svc import KVCacheManager, Tier
from kvcache_svc.block_pool import BlockOpError

from .common import make, run_prompt, snapshot

REPO = Path(__file__).resolve().parents[2]


def _expect(exc_type: type[BaseException], op: Callable[[], object], what: str) -> None:
    try:
        op()
    except exc_type:
        return
    raise RuntimeError(f"{what}: not refused")


def _busy() -> KVCacheManager:
    mgr = make(num_device=16, num_host=8)
    run_prompt(mgr, "a", list(range(10)))
    run_prompt(mgr, "b", list(range(100, 109)))
    mgr.free("b")  # cached blocks in the LRU
    run_prompt(mgr, "c", list(range(200, 206)))
    mgr.swap_out("c")
    return mgr


# Each: (what, the op on a busy manager). None of them may change anything.
BAD_OPS: list[tuple[str, Callable[[KVCacheManager], object]]] = [
    ("allocate an id that has blocks", lambda m: m.allocate("a", [1, 2, 3], 3)),
    ("append to a swapped-out sequence", lambda m: m.append_slots("c", 6, 1)),
    ("append at a negative position", lambda m: m.append_slots("a", -8, 1)),
    ("append past the end of the table", lambda m: m.append_slots("a", 64, 1)),
    ("append a negative count", lambda m: m.append_slots("a", 4, -3)),
    ("append to an unknown sequence", lambda m: m.append_slots("nobody", 0, 1)),
    ("swap in a sequence on the device", lambda m: m.swap_in("a")),
    ("swap out a sequence on the host", lambda m: m.swap_out("c")),
    ("fork onto an id that has blocks", lambda m: m.fork("a", "c")),
    ("fork an unknown sequence", lambda m: m.fork("nobody", "x")),
    ("free an unknown sequence", lambda m: m.free("nobody")),
    ("hash tokens that do not cover the blocks", lambda m: m.cache_blocks("a", [1, 2], 12, token_offset=8)),
    ("release a free block", lambda m: m.device.release(m.device.free_ids[0])),
    ("release a block that does not exist", lambda m: m.device.release(999)),
    ("share a free block", lambda m: m.device.acquire(m.device.free_ids[0])),
    ("allocate more blocks than are free", lambda m: m.device.allocate(m.device.num_free_blocks + 1)),
]


def check_bad_ops_change_nothing() -> None:
    for what, op in BAD_OPS:
        mgr = _busy()
        before = snapshot(mgr)
        _expect(BlockOpError, functools.partial(op, mgr), what)
        if snapshot(mgr) != before:
            raise RuntimeError(f"{what}: refused, but the state changed")
        mgr.check_invariants()


def check_invariant_check_still_raises() -> None:
    mgr = _busy()
    mgr.device.blocks[mgr.seqs["a"].block_ids[0]].ref_count += 1
    _expect(AssertionError, mgr.check_invariants, "a corrupted ref count")
    mgr = _busy()
    mgr.seqs["a"].block_ids[1] = mgr.device.free_ids[0]
    _expect(AssertionError, mgr.check_invariants, "a table pointing at a free block")


def check_valid_ops_still_work() -> None:
    mgr = _busy()
    mgr.append_slots("a", 10, 3)
    mgr.swap_in("c")
    mgr.fork("a", "a2")
    if mgr.tier("c") != Tier.DEVICE:
        raise RuntimeError("swap_in left the sequence on the host")
    for seq_id in ("a", "a2", "c"):
        mgr.free(seq_id)
    if not mgr.all_free_or_cached():
        raise RuntimeError("blocks still in use after every sequence was freed")
    mgr.check_invariants()


CHECKS = [check_bad_ops_change_nothing, check_invariant_check_still_raises, check_valid_ops_still_work]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_in_process(check):
    check()


def test_under_python_O():
    code = (
        "import tests.kvcache.test_manager_optimized as t\n"
        "try:\n    assert False\nexcept AssertionError:\n    raise SystemExit('asserts are not stripped')\n"
        "for check in t.CHECKS:\n    check()\nprint('ok', len(t.BAD_OPS))\n"
    )
    proc = subprocess.run([sys.executable, "-O", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", str(len(BAD_OPS))]
