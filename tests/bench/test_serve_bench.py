"""bench/serve.py's pieces that decide its figures: the seeded workload, what the client
records add up to (the throughput window, TTFT, time per token between messages, tokens per
message), the null model's tokens, and the py-spy sorting."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
if not (ROOT / "bench" / "serve.py").is_file():
    pytest.skip("bench/ is not in this checkout", allow_module_level=True)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def test_workload_is_seeded_and_in_range():
    from bench.serve import make_jobs

    jobs = make_jobs(16, 100, 1024, 1024, 151936, seed=0, temperature=0.6)
    assert [j.prompt for j in jobs] == [
        j.prompt for j in make_jobs(16, 100, 1024, 1024, 151936, seed=0, temperature=0.6)
    ]
    assert all(100 <= len(j.prompt) <= 1024 and 100 <= j.max_tokens <= 1024 and max(j.prompt) <= 10000 for j in jobs)
    small = make_jobs(8, 16, 128, 8, 512, seed=1, temperature=0.0)  # outputs shorter than min_len: up to the maximum
    assert all(j.max_tokens <= 8 and max(j.prompt) < 512 for j in small)


def test_summary_of_client_records():
    from bench.serve_clients import Record, summarize

    a = Record(0, start=10.0, arrivals=[10.5, 10.6, 11.0], counts=[1, 1, 4], completion_tokens=6, finish_reason=2)
    b = Record(1, start=10.2, arrivals=[10.4, 12.0], counts=[2, 2], completion_tokens=4, finish_reason=2)
    s = summarize([a, b])
    assert (s["tokens"], s["seconds"], s["requests"]) == (10, 2.0, 2)
    assert s["tok_s"] == 5.0 and s["tokens_per_message"] == 2.0 and s["max_tokens_per_message"] == 4
    assert s["ttft_p50"] == pytest.approx(0.2) and s["usage_mismatch"] == 0 and not s["errors"]
    # a message of k tokens after a gap g counts k times g / k: five 0.1 s (a), two 0.8 s (b)
    assert s["itl_p50"] == pytest.approx(0.1) and s["itl_p99"] == pytest.approx(0.8)


def test_null_model_answers_every_sampled_sequence_never_with_eos():
    from bench.null_model import NullRunner
    from contracts.step import SeqStep, StepInput
    from scheduler_svc.config import BUNDLED_MODEL

    runner = NullRunner(BUNDLED_MODEL, step_ms=0.0)
    out = runner.step(
        StepInput([SeqStep("a", [5, 6], 0, True), SeqStep("b", [7], 3, False), SeqStep("c", [8], 9, True)])
    )
    assert [t.seq_id for t in out.sampled] == ["a", "c"]
    assert all(
        3 <= t.token_id < runner.config.vocab_size and t.token_id not in runner.config.eos_token_ids
        for t in out.sampled
    )
    assert (
        runner.step(StepInput([SeqStep("a", [5, 6], 0, True)])).sampled == out.sampled[:1]
    )  # a function of sequence and position


def test_spy_breakdown_sorts_stacks_most_specific_first():
    from bench.spy_breakdown import classify

    assert classify("EngineCore.run;LLMEngine._process;Detokenizers.step;IncrementalDetokenizer.step_batch").startswith(
        "engine: detokenization"
    )
    assert classify("BaseEventLoop._run_once;Handle._run").startswith("loop: gRPC aio")
    assert classify("BaseEventLoop._run_once;Handle._run;SchedulerServicer.Generate;chunk_to_pb").startswith(
        "loop: protobuf"
    )
    assert classify("wait").startswith("loop: per-output wait")
