"""Memory on a hybrid model: the KV a long-context workload holds with KV-cache groups vs the
same model with every layer full attention, both measured.

Two real engine runs (CPU) of one workload whose sequences run several windows long: bench.
common's "tiny-hybrid" (every other layer sliding-window attention, window 32 tokens) and
"tiny" (the same shape, every layer full), 16-token blocks, each with a device pool of the
same bytes and large enough that nothing is preempted, so each holds exactly what its
sequences need. The KV tables are read as every step runs, after its schedule (bench.
experiments.memory.record_run): a sliding group releases its out-of-window blocks when the
next step is scheduled, before that schedule admits anyone.
Figures are layer-blocks (one block of one layer's K/V): a block of a KV group holds
`group_size` layers, so the blocks in use x the group size count the same unit for both.
"""

from __future__ import annotations

from bench.experiments.common import make_workload, mean
from bench.experiments.memory import record_run

MODELS = {"groups": "tiny-hybrid", "all_full": "tiny"}
MAX_MODEL_LEN = 512


def measure(model: str, pool_layer_blocks: int, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """One run: layer-blocks in use after every step, and the model's KV groups."""
    from bench.common import make_llm

    probe, _ = make_llm(model, "cpu", num_gpu_blocks=1, max_model_len=16)
    groups = probe.engine.model.kv_groups
    llm, _ = make_llm(
        model,
        "cpu",
        num_gpu_blocks=pool_layer_blocks // groups.group_size,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=256,
    )
    trace = record_run(llm.engine, prompts, output_lens)
    llm.engine.kv.check_invariants()
    return {
        "model": model,
        "group_windows": list(groups.windows),
        "group_size": groups.group_size,
        "layer_blocks": [b * groups.group_size for b in trace.step_blocks],
        "running": trace.running,
        "num_preemptions": trace.num_preemptions,
    }


def run(out_dir, *, num_requests: int = 48, pool_layer_blocks: int = 4096, seed: int = 0, env: dict | None = None):
    """The experiment; writes memory_hybrid.json and memory_hybrid.png."""
    from bench.common import CONFIGS
    from bench.experiments import plots

    hybrid = CONFIGS[MODELS["groups"]]
    # Long context against the window: prompts around 4 windows, outputs around 3.
    prompts, output_lens = make_workload(
        num_requests, MAX_MODEL_LEN, hybrid["vocab_size"], seed, prompt_median=128, output_median=96
    )
    runs = {name: measure(model, pool_layer_blocks, prompts, output_lens) for name, model in MODELS.items()}
    peak = {name: max(r["layer_blocks"], default=0) for name, r in runs.items()}
    sliding = hybrid["layer_types"].count("sliding_attention")
    result = {
        "experiment": "memory_hybrid",
        "model": f"{MODELS['groups']} vs {MODELS['all_full']} (random weights; {hybrid['num_hidden_layers']} layers)",
        "seed": seed,
        "environment": env or {},
        "workload": {
            "num_requests": num_requests,
            "prompt_len_mean": mean([len(p) for p in prompts]),
            "output_len_mean": mean(output_lens),
        },
        "layers": {
            "full": hybrid["num_hidden_layers"] - sliding,
            "sliding": sliding,
            "window": hybrid["sliding_window"],
        },
        "block_size": 16,
        "pool_layer_blocks": pool_layer_blocks,
        "peak_layer_blocks": peak,
        # The first step prefills every prompt at once: each group holds all its blocks then.
        "peak_after_first_step": {name: max(r["layer_blocks"][1:], default=0) for name, r in runs.items()},
        "mean_layer_blocks": {name: mean(r["layer_blocks"]) for name, r in runs.items()},
        "peak_saving": 1.0 - peak["groups"] / peak["all_full"] if peak["all_full"] else 0.0,
        "runs": runs,
    }
    plots.write_json(out_dir, "memory_hybrid", result)
    plots.plot_memory_hybrid(result, out_dir)
    return result
