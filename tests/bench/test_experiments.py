"""The memory experiment at a small size: the numbers are sane and the figure is a PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
pytest.importorskip("matplotlib")
if not (ROOT / "bench" / "experiments").is_dir():
    pytest.skip("bench/ is not in this checkout", allow_module_level=True)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and b"IHDR" in data[8:16] and data[-8:-4] == b"IEND" and len(data) > 1000


@pytest.mark.timeout(120)
def test_memory_experiment_small(tmp_path):
    import torch

    from bench.experiments import heatmap, memory

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result, trace = memory.run(tmp_path, num_requests=24, num_gpu_blocks=64, seed=1, return_trace=True)
        heatmap.run(tmp_path, trace=trace)
    finally:
        torch.set_num_threads(threads)

    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["admitted"] == result["admitted"]
    adm = data["admitted"]
    assert adm["contiguous"] == 64 * 16 // data["kv_budget"]["max_model_len"]
    assert adm["paged_peak"] >= adm["contiguous"] >= 1
    assert adm["paged_mean_under_load"] >= adm["contiguous"]
    frag = data["fragmentation"]
    for key in ("paged_per_step", "contiguous_per_step"):
        values = [x for x in frag[key] if x is not None]  # None: nothing resident that step
        assert values and all(0.0 <= x <= 1.0 for x in values), key
    assert 0.0 <= frag["paged_mean"] < frag["contiguous_mean"] <= 1.0
    b = data["kv_bytes_per_request"]
    assert b["exact_tokens"]["mean"] <= b["paged"]["mean"] <= b["contiguous"]["mean"]
    assert b["paged"]["p95"] <= b["contiguous"]["p95"]
    assert data["workload"]["num_requests"] == 24
    hm = json.loads((tmp_path / "heatmap.json").read_text())
    # Every token of every request is written once (no preemption by recompute on this budget).
    assert hm["tokens_written"] >= sum(trace.final_tokens.values()) - len(trace.final_tokens)
    for name in ("memory.png", "heatmap.png"):
        assert _is_png(tmp_path / name), name


def test_result_plots_read_the_committed_tables(tmp_path):
    from bench import plots

    results = ROOT / "bench" / "results"
    rows = plots.table_rows((results / "kernels_h200.md").read_text(), "| B | L |")
    assert len(rows) == 15 and all(plots.number(r[6]) is not None for r in rows)  # 5 batches x 3 lengths
    for path in (plots.decode_plot(results, tmp_path), plots.throughput_plot(results, tmp_path)):
        assert _is_png(path)


@pytest.mark.timeout(300)
def test_hf_peer_runs_the_workload_with_per_request_lengths(tmp_path):
    """`bench/throughput.py --peer hf` on a tiny random model: transformers' continuous
    batching generates exactly each request's max_tokens (EOS ignored)."""
    import torch

    from bench.common import build_runner
    from bench.hf_peer import run_hf_continuous_batching
    from model_svc.loader import save_model

    _, runner = build_runner("tiny", "cpu", "float32", num_device_blocks=64)
    save_model(runner.model, tmp_path)
    prompts = [[5, 6, 7, 8], list(range(10, 40)), [9] * 17]
    lengths = [3, 11, 6]
    seconds, tokens = run_hf_continuous_batching(
        str(tmp_path), prompts, lengths, 0.6, torch.device("cpu"), torch.float32, cache_blocks=16
    )
    assert tokens == sum(lengths) and seconds > 0


@pytest.mark.timeout(300)
def test_memory_hybrid_experiment_small(tmp_path):
    from bench.experiments import memory_hybrid

    result = memory_hybrid.run(tmp_path, num_requests=6, pool_layer_blocks=512, seed=2)
    data = json.loads((tmp_path / "memory_hybrid.json").read_text())
    assert data["layers"] == {"full": 1, "sliding": 1, "window": 32}
    groups, full = data["runs"]["groups"], data["runs"]["all_full"]
    assert groups["group_windows"] == [0, 32] and full["group_windows"] == [0]
    assert groups["num_preemptions"] == full["num_preemptions"] == 0
    # Both measured: the hybrid's sliding layer holds at most its window, the full one all.
    assert 0 < data["peak_layer_blocks"]["groups"] < data["peak_layer_blocks"]["all_full"]
    assert 0 < result["peak_saving"] < 0.5  # one of two layers slides: at most half is saved
    assert _is_png(tmp_path / "memory_hybrid.png")
