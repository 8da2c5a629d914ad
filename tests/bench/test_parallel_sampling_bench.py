"""bench/parallel_sampling.py at a tiny size on the CPU with the bundled model: both modes'
rows, one copy-on-write copy per child but the last of each prompt whose shared last block is
partial, fewer peak blocks with n than with separate requests, and the same completions."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
if not (ROOT / "bench" / "parallel_sampling.py").is_file():
    pytest.skip("bench/ is not in this checkout", allow_module_level=True)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.timeout(300)
def test_parallel_sampling_bench_small(tmp_path, monkeypatch):
    from bench import parallel_sampling
    from scheduler_svc.config import BUNDLED_MODEL

    out = tmp_path / "parallel.md"
    argv = ["--num-prompts", "4", "--n", "3", "--prompt-len", "40", "--output-len", "8", "--temperature", "0"]
    monkeypatch.setattr(
        sys,
        "argv",
        ["bench/parallel_sampling.py", "--model", BUNDLED_MODEL, "--device", "cpu", *argv, "--out", str(out)],
    )
    parallel_sampling.main()
    text = out.read_text()
    assert "- command: `python bench/parallel_sampling.py" in text and "- torch:" in text
    rows = re.findall(r"^\| (.+?) \| [\d.]+ \| [\d,]+ \| ([\d,]+) \| ([\d,]+) \| [\d,]+ \| 0 \|$", text, re.M)
    assert [mode for mode, _, _ in rows] == ["4 prompts x n=3", "12 requests"]
    (_, peak_n, copies_n), (_, peak_sep, copies_sep) = rows
    prompts = parallel_sampling.make_prompts(argparse.Namespace(seed=0, prompt_len=40, num_prompts=4), 512)
    partial = sum((len(p) - 1) % 16 != 0 for p in prompts)
    assert int(copies_n) == 2 * partial and int(copies_sep) == 0
    assert int(peak_n) < int(peak_sep)
    assert "completions equal in both modes: 12 of 12" in text
