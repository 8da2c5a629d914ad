"""bench/prefix.py at a small size on the CPU: each mode's repeats are separate runs, each
with its own prefix (the cached runs find exactly their prefix, the uncached ones nothing),
and the result file carries the runs and the ratios of their medians."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
if not (ROOT / "bench" / "prefix.py").is_file():
    pytest.skip("bench/ is not in this checkout", allow_module_level=True)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.timeout(120)
def test_prefix_bench_small(tmp_path, monkeypatch):
    from bench import prefix

    out = tmp_path / "prefix.md"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench/prefix.py",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--prefix-len",
            "64",
            "--num-requests",
            "4",
            "--output-len",
            "6",
            "--repeats",
            "3",
            "--out",
            str(out),
        ],
    )
    prefix.main()
    text = out.read_text()
    rows = re.findall(r"^\| (on|off) \| (\d) \| [\d.]+ \| [\d,]+ \| [\d.]+ \| [\d.]+ \| (\d+) \|$", text, re.M)
    assert [(mode, run) for mode, run, _ in rows] == [(m, str(i)) for m in ("on", "off") for i in (1, 2, 3)]
    # 4 requests, each finding the 64-token prefix the run's first request left (and only it)
    assert [int(hits) for _, _, hits in rows] == [4 * 64] * 3 + [0] * 3
    assert re.search(r"medians of 3 runs each: throughput on [\d,]+, off [\d,]+ tok/s", text)
    assert re.search(r"throughput on/off: [\d.]+x \(target >= 3x\); TTFT p50 off/on: [\d.]+x", text)
