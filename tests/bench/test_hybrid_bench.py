"""bench/hybrid.py at a CPU size: both models run at each context, the table and the result
file come out, and the block figures are within what the contexts need."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
if not (ROOT / "bench" / "hybrid.py").is_file():
    pytest.skip("bench/ is not in this checkout", allow_module_level=True)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.timeout(300)
def test_hybrid_bench_small(tmp_path):
    from bench import hybrid
    from bench.common import CONFIGS

    assert CONFIGS["tiny-hybrid"]["layer_types"] == ["full_attention", "sliding_attention"]
    out = tmp_path / "hybrid.md"
    rows = hybrid.main(["--model", "tiny", "--contexts", "40", "72", "--batch", "2", "--output-len", "3",
                        "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert [(r["model"], r["context"]) for r in rows] == [
        ("tiny", 40),
        ("tiny-hybrid", 40),
        ("tiny", 72),
        ("tiny-hybrid", 72),
    ]
    for r in rows:
        full = -(-(r["context"] + 3) // 16)  # every block of prompt and output
        if r["model"] == "tiny":
            assert r["kv_groups"] == 1 and r["kv_blocks_per_request"] <= full
        else:  # the full group all of them, the sliding group (window 32) at most three
            assert r["kv_groups"] == 2 and r["kv_blocks_per_request"] <= full + 3
        assert r["decode_tok_s"] > 0 and r["prefill_s"] > 0
    by = {(r["model"], r["context"]): r for r in rows}
    assert by["tiny-hybrid", 72]["kv_mib_per_request"] < by["tiny", 72]["kv_mib_per_request"]
    text = out.read_text()
    assert "| 72 | tiny-hybrid |" in text and "window 32" in text
