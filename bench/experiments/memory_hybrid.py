"""Memory on a hybrid model: the KV a long-context workload holds with KV-cache groups vs
with every layer treated as full attention.

One real engine run (CPU) on a random-weight hybrid model (bench.common's "tiny-hybrid":
every other layer sliding-window attention, window 32 tokens, 16-token blocks) of a workload
whose sequences run several windows long; the KV tables and computed-token counts are read
after every step (bench.experiments.memory.record_run). Figures are layer-blocks (one block
of one layer's K/V), so both columns count the same unit:

- all-full (measured): what the engine holds today, every layer every block of its sequence:
  the blocks in the tables x the layers;
- groups (analytical, the same trace): the full layers the same; a sliding layer only the
  blocks holding a key the sequence's next query still sees (positions >= n - window + 1
  for n computed tokens), as a sliding group that releases out-of-window blocks would
  (docs/KV_GROUPS.md). The workload's prompts are random, so no block is shared and the
  released blocks subtract per sequence.
"""

from __future__ import annotations

from bench.experiments.common import make_workload, mean
from bench.experiments.memory import record_run

MODEL = "tiny-hybrid"
MAX_MODEL_LEN = 512


def released_blocks(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks of a sequence with num_computed tokens that no later query's window
    reaches (the next query sits at position num_computed)."""
    return max(0, num_computed - window + 1) // block_size


def analyze(trace, layer_windows: tuple[int, ...]) -> dict:
    num_layers = len(layer_windows)
    sliding = [w for w in layer_windows if w > 0]
    window = sliding[0] if sliding else 0
    all_full, groups = [], []
    for blocks, lens in zip(trace.allocated_blocks, trace.live_tokens):
        full = blocks * num_layers
        freed = sum(released_blocks(n, window, trace.block_size) for n in lens) if window else 0
        all_full.append(full)
        groups.append(full - len(sliding) * freed)
    peak_full, peak_groups = max(all_full, default=0), max(groups, default=0)
    return {
        "layers": {"full": num_layers - len(sliding), "sliding": len(sliding), "window": window},
        "block_size": trace.block_size,
        "peak_layer_blocks": {"all_full": peak_full, "groups": peak_groups},
        "mean_layer_blocks": {"all_full": mean(all_full), "groups": mean(groups)},
        "peak_saving": 1.0 - peak_groups / peak_full if peak_full else 0.0,
        "per_step": {"all_full": all_full, "groups": groups, "running": trace.running},
        "num_preemptions": trace.num_preemptions,
    }


def run(out_dir, *, num_requests: int = 48, num_gpu_blocks: int = 512, seed: int = 0, env: dict | None = None):
    """The experiment; writes memory_hybrid.json and memory_hybrid.png."""
    from bench.common import make_llm
    from bench.experiments import plots

    llm, _ = make_llm(MODEL, "cpu", num_gpu_blocks=num_gpu_blocks, max_model_len=MAX_MODEL_LEN, max_num_seqs=256)
    engine = llm.engine
    config = engine.model_config
    # Long context against the window: prompts around 4 windows, outputs around 3.
    prompts, output_lens = make_workload(
        num_requests, MAX_MODEL_LEN, config.vocab_size, seed, prompt_median=128, output_median=96
    )
    trace = record_run(engine, prompts, output_lens)
    result = {
        "experiment": "memory_hybrid",
        "model": f"{MODEL} (random weights; {config.num_hidden_layers} layers)",
        "seed": seed,
        "environment": env or {},
        "workload": {
            "num_requests": num_requests,
            "prompt_len_mean": mean([len(p) for p in prompts]),
            "output_len_mean": mean(output_lens),
        },
        **analyze(trace, config.layer_windows),
    }
    plots.write_json(out_dir, "memory_hybrid", result)
    plots.plot_memory_hybrid(result, out_dir)
    return result
