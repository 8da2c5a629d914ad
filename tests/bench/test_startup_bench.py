"""bench/startup.py on the CPU: each start a fresh process, its phases timed and tabled."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.timeout(300)
def test_a_start_is_timed_phase_by_phase(tmp_path):
    from bench.serve import prepare_model
    from bench.startup import PHASES, one_start, table

    model_dir, tmp = prepare_model("tiny")
    try:
        run = one_start(model_dir, str(tmp_path / "triton"), profile=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    spans = run["spans"]
    assert {key for key, _ in PHASES} <= set(spans) | {"build_pools", "capture_graphs", "compile_kernels"}
    assert spans["import"] > 0 and spans["load_model"] > 0 and spans["first_token"] > 0
    assert sum(spans.values()) <= run["total"] + 1e-6  # the phases lie inside the start
    assert "LLM" in run["profile"] or "llm.py" in run["profile"]
    rows = table([("warm", run)]).splitlines()
    assert len(rows) == 2 + len(PHASES) + 2 and rows[-2].startswith("| **total")
