"""Helpers shared by the scheduler tests."""

from __future__ import annotations

from scheduler_svc import LLM


def assert_clean(llm: LLM) -> None:
    """Nothing left behind: the block manager's invariants hold, every block is free or
    cached, and the engine holds no request or stream."""
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.all_free_or_cached()
    assert not llm.engine.requests and not llm.engine._streams
