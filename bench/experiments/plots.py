"""JSON and PNG output of the experiments (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PAGED, CONTIG = "#1f77b4", "#d62728"


def _clean(x):
    """NaN/inf (no data, e.g. a step with nothing allocated) become null: strict JSON."""
    if isinstance(x, float):
        return x if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(out_dir, name: str, result: dict) -> Path:
    result = _clean(result)
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    return path


def _save(fig, out_dir, name: str) -> Path:
    path = Path(out_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_memory(r: dict, out_dir) -> Path:
    budget, adm, frag = r["kv_budget"], r["admitted"], r["fragmentation"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1, 2.2, 1.2]})
    fig.suptitle(
        f"Paged vs contiguous KV cache - {r['model']}, budget {budget['blocks']} blocks x {budget['block_size']} = "
        f"{budget['tokens']} tokens, max_model_len {budget['max_model_len']}, {r['workload']['num_requests']} requests"
    )

    ax = axes[0]
    labels = ["paged\n(peak)", "paged\n(mean, queue\nnon-empty)", "contiguous"]
    values = [adm["paged_peak"], adm["paged_mean_under_load"], adm["contiguous"]]
    bars = ax.bar(labels, values, color=[PAGED, "#6baed6", CONTIG])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("concurrent requests admitted")
    ax.set_title("Requests resident at once")
    ax.set_ylim(0, max(values) * 1.15 + 1)

    ax = axes[1]
    steps = np.arange(len(frag["paged_per_step"]))
    nan = lambda xs: [np.nan if x is None else x for x in xs]  # noqa: E731
    ax.plot(
        steps, nan(frag["contiguous_per_step"]), color=CONTIG, label=f"contiguous (mean {frag['contiguous_mean']:.1%})"
    )
    ax.plot(steps, nan(frag["paged_per_step"]), color=PAGED, label=f"paged (mean {frag['paged_mean']:.1%})")
    ax.set_ylim(0, 1)
    ax.set_xlabel("engine step")
    ax.set_ylabel("1 - used slots / allocated slots")
    ax.set_title("Fragmentation over time (same live requests)")
    ax2 = ax.twinx()
    ax2.plot(steps, r["per_step"]["running"], color="gray", lw=0.8, alpha=0.6, label="resident requests (paged)")
    ax2.set_ylabel("resident requests", color="gray")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8)

    ax = axes[2]
    b = r["kv_bytes_per_request"]
    kinds = [
        ("exact_tokens", "exact tokens", "#999999"),
        ("paged", "paged", PAGED),
        ("contiguous", "contiguous", CONTIG),
    ]
    x = np.arange(2)
    for i, (key, label, color) in enumerate(kinds):
        vals = [b[key]["mean"] / 1024, b[key]["p95"] / 1024]
        bars = ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=label, color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(x, ["mean", "p95"])
    ax.set_ylabel("KV KiB per request")
    ax.set_title("KV bytes per request")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out_dir, "memory")


def plot_memory_hybrid(r: dict, out_dir) -> Path:
    layers, runs = r["layers"], r["runs"]
    fig, ax = plt.subplots(figsize=(10, 4.6))
    fig.suptitle(
        f"KV of a hybrid model - {r['model']}: {layers['full']} full + {layers['sliding']} sliding layers "
        f"(window {layers['window']}), {r['block_size']}-token blocks, {r['workload']['num_requests']} requests"
    )
    peak = r["peak_layer_blocks"]
    labels = {"all_full": ("every layer full attention", CONTIG), "groups": ("KV-cache groups", PAGED)}
    for name, (label, color) in labels.items():
        series = runs[name]["layer_blocks"]
        ax.plot(np.arange(len(series)), series, color=color, label=f"{label} (peak {peak[name]})")
    ax.set_xlabel("engine step")
    ax.set_ylabel("layer-blocks held (measured)")
    ax.set_title(f"Peak saving {r['peak_saving']:.1%}")
    ax2 = ax.twinx()
    running = runs["groups"]["running"]
    ax2.plot(np.arange(len(running)), running, color="gray", lw=0.8, alpha=0.6, label="resident requests (groups)")
    ax2.set_ylabel("resident requests", color="gray")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    fig.tight_layout()
    return _save(fig, out_dir, "memory_hybrid")


def plot_heatmap(m: np.ndarray, r: dict, out_dir) -> Path:
    from matplotlib.colors import LogNorm

    # At least one pixel row per step, so single-token decode writes are not dropped.
    fig, ax = plt.subplots(figsize=(11, max(7.0, 1.15 * m.shape[0] / 100)), dpi=100)
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    im = ax.imshow(
        np.ma.masked_equal(m, 0),
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        cmap=cmap,
        norm=LogNorm(vmin=1, vmax=max(2, r["block_size"])),
    )
    cb = fig.colorbar(im, ax=ax, fraction=0.04)
    cb.set_label("tokens written into the block in the step (log; white = none)")
    ticks = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= max(2, r["block_size"])]
    cb.set_ticks(ticks, labels=[str(t) for t in ticks])
    ax.set_xlabel("physical block id")
    ax.set_ylabel("engine step")
    ax.set_title(
        f"Tokens written per physical block per step - {r['model']}, {r['num_blocks']} blocks of {r['block_size']}, "
        f"{r['tokens_written']} tokens in {r['steps']} steps"
    )
    fig.tight_layout()
    return _save(fig, out_dir, "heatmap")


def plot_load(r: dict, out_dir) -> Path:
    pts = r["points"]
    rate = [p["rate_rps"] for p in pts]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.3))
    fig.suptitle(
        f"Throughput vs latency, Poisson arrivals - {r['model']} on {r['device']}, {r['num_requests']} requests per "
        "rate "
        f"(saturated capacity {r['capacity_rps']:.1f} req/s)"
    )
    for ax, key, title in (
        (axes[0], "e2e", "End-to-end latency"),
        (axes[1], "ttft", "Time to first token"),
        (axes[2], "itl", "Inter-token latency"),
    ):
        ax.plot(rate, [p[key]["mean"] * 1e3 for p in pts], "o-", label="mean")
        ax.plot(rate, [p[key]["p99"] * 1e3 for p in pts], "s--", label="p99")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[3]
    ax.plot(rate, [p["achieved_rps"] for p in pts], "o-", label="completed req/s")
    ax.plot(rate, rate, ":", color="gray", label="offered = completed")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("completed requests / s")
    ax.set_title("Throughput")
    ax3 = ax.twinx()
    ax3.plot(rate, [p["output_tok_s"] for p in pts], "^-", color="#2ca02c", label="output tok/s")
    ax3.set_ylabel("output tokens / s", color="#2ca02c")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, out_dir, "load")


def plot_steps(r: dict, out_dir) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.3), gridspec_kw={"width_ratios": [1.2, 2, 1]})
    fig.suptitle(
        f"Per-step profile - {r['model']} on {r['device']}, {r['num_requests']} requests, "
        f"max_num_batched_tokens {r['max_num_batched_tokens']}, {r['steps']} steps"
    )
    ax = axes[0]
    bt = r["per_step"]["batched_tokens"]
    ax.hist(bt, bins=min(50, max(5, len(set(bt)))), color=PAGED)
    ax.set_yscale("log")
    ax.set_xlabel("tokens batched in the step")
    ax.set_ylabel("steps (log)")
    ax.set_title(f"Batched tokens per step (mean {np.mean(bt):.0f})")
    phases = [("schedule", "#1f77b4"), ("model", "#ff7f0e"), ("output", "#2ca02c"), ("other", "#7f7f7f")]
    ax = axes[1]
    steps = np.arange(len(bt))
    ax.stackplot(
        steps,
        *[np.asarray(r["per_step"][f"{p}_ms"]) for p, _ in phases],
        labels=[p for p, _ in phases],
        colors=[c for _, c in phases],
    )
    ax.set_xlabel("engine step")
    ax.set_ylabel("ms")
    ax.set_title("Step time by phase")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    means = [r["breakdown_ms"][p]["mean"] for p, _ in phases]
    total = sum(means)
    bars = ax.bar([p for p, _ in phases], means, color=[c for _, c in phases])
    ax.bar_label(bars, labels=[f"{m:.2f} ms\n{m / total:.0%}" for m in means], fontsize=8)
    ax.set_ylabel("mean ms per step")
    ax.set_ylim(0, max(means) * 1.3)
    ax.set_title(f"Mean step {total:.2f} ms")
    fig.tight_layout()
    return _save(fig, out_dir, "steps")
