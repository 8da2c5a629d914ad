"""bench/throughput.py's user-path row and bench/detok.py at a small size on the CPU: the
user path runs `LLM(model=dir)` with defaults in a fresh process over a directory of random
weights with the real Qwen2 tokenizer, on the same workload as the in-memory row; the
detokenization bench runs each tokenizer to the workload's lengths."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.timeout(600)
def test_user_path_generates_the_workload_through_llm_defaults():
    from bench.throughput import make_workload
    from bench.throughput_user_path import user_path_row, user_path_run

    seconds, num_out, steps, preemptions = user_path_run("tiny", 3, 120)
    _, params = make_workload(3, 120, 120)
    assert num_out == sum(p.max_tokens for p in params) and seconds > 0
    assert steps >= max(p.max_tokens for p in params) and preemptions == 0
    row = user_path_row((seconds, num_out, steps, preemptions), 2 * num_out / seconds)
    assert row.startswith("| user path: LLM(model=dir), defaults") and f"| {num_out} |" in row and "| 50.0% |" in row
    skipped = user_path_run("tiny", 3, 120, tokenizer="none")
    assert skipped[1] == num_out
    assert "skip_tokenizer_init=True" in user_path_row(skipped, float("nan"), "none")
    byte_level = user_path_run("tiny", 3, 120, tokenizer="bytes")
    assert byte_level[1] == num_out
    assert "byte-level" in user_path_row(byte_level, float("nan"), "bytes")


@pytest.mark.timeout(300)
def test_detok_bench_runs_every_tokenizer_to_the_workloads_lengths():
    from bench.detok import TOKENIZERS, run
    from bench.throughput import make_workload

    results = run(list(TOKENIZERS), 4, 110, repeats=1)
    _, params = make_workload(4, 110, 110)
    assert set(results) == set(TOKENIZERS)
    assert all(n == sum(p.max_tokens for p in params) and s > 0 for n, s in results.values())


def test_byte_level_tokenizer_has_256_ids_and_drops_the_rest(tmp_path):
    from bench.detok import byte_level_tokenizer

    tok = byte_level_tokenizer(tmp_path)
    assert tok.backend.get_vocab_size() == 256
    assert tok.decode(tok.encode("héllo")) == "héllo" and tok.decode([300, 151000]) == ""
