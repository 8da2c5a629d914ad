"""Wall time per phase of an engine step, for benchmarks: where a service-mode step spends
its time in each process, and how long each side waits for the other.

Off unless the environment variable PICOVLLM_PHASE_TIMES names a file; each process that
records then writes `<file>.<role>.json` (totals in seconds and counts per phase) every
`DUMP_EVERY` records of its `tick` phase and at exit. Off, `start` and `add` return at once: the
hot paths pay two calls per phase.

    t = phase_times.start()
    ...                                  # the phase
    phase_times.add("engine.schedule", t)
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

PATH = os.environ.get("PICOVLLM_PHASE_TIMES") or None
ENABLED = PATH is not None
DUMP_EVERY = 64

_lock = threading.Lock()
_totals: dict[str, float] = {}
_counts: dict[str, int] = {}
_role = "scheduler"
_tick = ""


def configure(role: str, tick: str) -> None:
    """Name this process's file (`role`) and the phase counted once per step (`tick`)."""
    global _role, _tick
    _role, _tick = role, tick


def start() -> float:
    """The clock for `add` (0.0 when off)."""
    return time.perf_counter() if ENABLED else 0.0


def add(name: str, since: float) -> None:
    """Record the time since `since` (a `start()` value) under `name`."""
    if not ENABLED:
        return
    seconds = time.perf_counter() - since
    with _lock:
        _totals[name] = _totals.get(name, 0.0) + seconds
        n = _counts[name] = _counts.get(name, 0) + 1
    if name == _tick and n % DUMP_EVERY == 0:
        dump()


def snapshot() -> dict[str, tuple[float, int]]:
    with _lock:
        return {k: (_totals[k], _counts[k]) for k in _totals}


def reset() -> None:
    with _lock:
        _totals.clear()
        _counts.clear()


def dump() -> None:
    if PATH is None:
        return
    data = {k: {"seconds": s, "count": n} for k, (s, n) in snapshot().items()}
    tmp = f"{PATH}.{_role}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, f"{PATH}.{_role}.json")


def load(role: str) -> dict[str, tuple[float, int]]:
    """What the process named `role` last wrote (empty if nothing)."""
    try:
        with open(f"{PATH}.{role}.json") as f:
            return {k: (v["seconds"], v["count"]) for k, v in json.load(f).items()}
    except (OSError, ValueError, TypeError):
        return {}


def table(phases: dict[str, tuple[float, int]], steps: int) -> list[str]:
    """Markdown rows: phase, total seconds, calls, milliseconds per step."""
    rows = ["| phase | seconds | calls | ms per step |", "| --- | ---: | ---: | ---: |"]
    for name, (seconds, count) in sorted(phases.items()):
        rows.append(f"| {name} | {seconds:.3f} | {count} | {1e3 * seconds / max(steps, 1):.3f} |")
    return rows


if ENABLED:
    atexit.register(dump)
