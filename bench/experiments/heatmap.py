"""Heatmap of tokens written per physical block per step (x: block id, y: step).

From an instrumented engine run (see memory.record_run): each step, the scheduled sequences'
positions [start, start + new) are mapped through their block tables to physical blocks.
Prefill chunks show as bursts of up to block_size tokens into fresh blocks; decodes as single
tokens trickling into each sequence's last block; freed blocks are taken again by later requests.
"""

from __future__ import annotations

import numpy as np

from bench.experiments.common import model_label


def matrix(trace) -> np.ndarray:
    m = np.zeros((len(trace.writes), trace.num_blocks), dtype=np.int32)
    for step, written in enumerate(trace.writes):
        for block, n in written.items():
            m[step, block] = n
    return m


def analyze(trace) -> dict:
    m = matrix(trace)
    touched = m > 0
    # A block "reused" = written again after a step in which it was not written: a later owner
    # (or a decode resuming after a swap). Count the distinct write runs per block.
    runs = (touched[1:] & ~touched[:-1]).sum(axis=0) + touched[0]
    return {
        "steps": int(m.shape[0]),
        "num_blocks": int(m.shape[1]),
        "block_size": trace.block_size,
        "tokens_written": int(m.sum()),
        "blocks_ever_written": int(touched.any(axis=0).sum()),
        "blocks_written_per_step_mean": float(touched.sum(axis=1).mean()) if m.size else 0.0,
        "write_runs_per_block_mean": float(runs.mean()) if m.size else 0.0,
        "tokens_per_block": m.sum(axis=0).tolist(),
        "tokens_per_step": m.sum(axis=1).tolist(),
    }


def run(
    out_dir,
    *,
    num_requests: int = 160,
    num_gpu_blocks: int = 256,
    seed: int = 0,
    device: str = "cpu",
    env: dict | None = None,
    trace=None,
) -> dict:
    """Writes heatmap.json and heatmap.png; reuses `trace` from the memory run when given."""
    from bench.experiments import plots
    from bench.experiments.memory import traced_run

    if trace is None:
        trace, _, _ = traced_run(num_requests, num_gpu_blocks, seed, device)
    result = {
        "experiment": "heatmap",
        "model": model_label(None),
        "device": device,
        "seed": seed,
        "environment": env or {},
        **analyze(trace),
    }
    plots.write_json(out_dir, "heatmap", result)
    plots.plot_heatmap(matrix(trace), result, out_dir)
    return result
