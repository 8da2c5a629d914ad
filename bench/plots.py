"""Plots of the committed GPU results, read from bench/results/*.md (no GPU needed):

decode_h200.png      decode attention, % of the copy bandwidth per (B, L) cell: Triton
                     (in a CUDA graph where the eager time measures the host), SDPA, Flex
throughput_h200.png  headline throughput by engine version against the roofline and target
prefix_h200.png      prefix caching on vs off: throughput and TTFT p50 ratios of every run
                     by engine version, against the targets

python bench/plots.py [--results bench/results] [--out docs/bench]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# (label, tok/s) per engine version, as bench/NOTES.md's end-to-end table records them
HISTORY = [
    ("v1 kernels\n+ graphs", 7293),
    ("v2 sampler\nno history", 8715),
    ("v3 fused\nelementwise", 14876),
    ("v6 sync", 15414),
    ("v6 overlapped\n(repeats had\nprompts cached)", 22615),
    ("v9 gemv, fused\nsampler, cold\ncache each run", 24001),
    ("v10 two steps\nin flight", 24035),
    ("v10 service\nmode (3 procs)", 23961),
    ("v11 sampler\nby column\nranges", 24710),
    ("v11 service\nmode (3 procs)", 25687),
    ("v12 one-copy\ngraph inputs", 24800),
    ("v12 service\nmode (3 procs)", 26006),
    ("v13 prefill\ngraphs", 24439),
    ("v16 split-K\no, down", 24854),
    ("v17 q/k norm\nby head groups", 25409),
    ("v18 cascade\nstore fused\n(path unchanged)", 24984),
    ("v19 deferred\nnorms (path\nmostly as v18)", 25062),
    ("v20 sampling\nin the graphs", 25051),
    ("v20 service\nmode (3 procs)", 26068),
]

# (label, [(throughput on/off, TTFT p50 off/on) per run]) of bench/prefix.py, as bench/NOTES.md
# and the result files record them
PREFIX_HISTORY = [
    ("v11 sampler\nby column\nranges", [(2.32, 3.01), (2.73, 5.04)]),
    ("v12 one-copy\ngraph\ninputs", [(2.58, 3.50), (2.27, 3.37), (2.66, 4.71)]),
    ("v13 prefill\ngraphs", [(2.75, 5.52), (2.77, 6.04), (2.76, 5.91)]),
    ("v14 short-run\nprefill\ntiles", [(2.73, 5.87), (2.72, 5.38), (2.81, 7.21), (2.80, 7.42)]),
    ("v15 gate|up\n+ SiLU in\none kernel", [(2.86, 7.18), (2.83, 5.72)]),
    ("v16 split-K\n(medians\nof five)", [(2.93, 7.03), (2.93, 9.66)]),
    ("v17 q/k norm\nhead groups\n(medians)", [(2.82, 7.27)]),
    ("v18 store in\ncascade, GQA\nprefill (medians)", [(2.90, 7.21), (2.90, 8.34), (2.80, 6.92)]),
    ("v19 deferred\nnorms\n(medians)", [(3.01, 8.27), (2.57, 6.63), (2.73, 5.70)]),
    ("v20 sampling\nin the graphs\n(medians)", [(3.04, 8.35), (3.08, 9.48)]),
]


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with header_start."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def number(cell: str) -> float | None:
    m = re.match(r"[-\d.,]+", cell.replace(",", ""))
    try:
        return float(m.group(0)) if m else None
    except ValueError:
        return None


def decode_plot(results: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = (results / "kernels_h200.md").read_text()
    rows = table_rows(text, "| B | L |")
    cells = []
    for r in rows:
        b, length, pct, pct_graph = int(r[0]), int(r[1]), number(r[6]), number(r[8])
        triton_us, sdpa_us, flex_us = number(r[4]), number(r[9]), number(r[11])
        triton = max(pct or 0, pct_graph or 0)
        scale = (pct or 0) / 100 * triton_us if triton_us else None  # bytes / copy rate, in us
        sdpa = 100 * scale / sdpa_us if scale and sdpa_us else None
        flex = 100 * scale / flex_us if scale and flex_us else None
        cells.append((b, length, triton, sdpa, flex))
    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"B={b}\nL={length // 1024}k" for b, length, *_ in cells]
    x = range(len(cells))
    width = 0.28
    ax.bar([i - width for i in x], [c[2] for c in cells], width, label="Triton (paged)")
    ax.bar(list(x), [c[3] or 0 for c in cells], width, label="torch SDPA (contiguous K/V)")
    ax.bar([i + width for i in x], [c[4] or 0 for c in cells], width, label="FlexAttention (paged)")
    ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
    ax.text(-0.6, 91.5, "90 % target (B >= 32, L >= 8k)", fontsize=8, color="grey")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("% of device-to-device copy bandwidth")
    ax.set_title(
        "Paged decode attention on the H200 (Hq=32, Hkv=8, D=128, bf16)\n"
        "Triton: the better of eager and CUDA-graph timing (eager measures the host at small B); SDPA, Flex: eager",
        fontsize=9,
    )
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.tight_layout()
    path = out / "decode_h200.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_plot(results: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    text = (results / "throughput_h200.md").read_text()
    roof = number(table_rows(text, "| mode |")[0][4])
    fig, ax = plt.subplots(figsize=(max(10.0, 1.15 * len(HISTORY)), 4.4))  # room for each bar's label
    ax.bar([label for label, _ in HISTORY], [v for _, v in HISTORY], color="tab:blue")
    for i, (_, v) in enumerate(HISTORY):
        ax.text(i, v + 300, f"{v:,}", ha="center", fontsize=8)
    ax.axhline(roof, color="black", linewidth=1)
    ax.text(-0.4, roof + 400, f"roofline {roof:,.0f} tok/s (measured copy bandwidth)", fontsize=8)
    ax.axhline(24000, color="tab:red", linestyle="--", linewidth=1)
    ax.text(-0.4, 24400, "target 24,000 tok/s", fontsize=8, color="tab:red")
    ax.set_ylim(0, roof * 1.1)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Headline workload (256 requests, Qwen3-0.6B shape, bf16) on the H200")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path = out / "throughput_h200.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def prefix_plot(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for ax, k, target, title in (
        (axes[0], 0, 3.0, "throughput, caching on / off"),
        (axes[1], 1, 5.0, "TTFT p50, caching off / on"),
    ):
        for i, (_, runs) in enumerate(PREFIX_HISTORY):
            values = [r[k] for r in runs]
            ax.scatter([i] * len(values), values, color="tab:blue", zorder=3)
            ax.text(i + 0.08, max(values), f"{max(values):.2f}x", fontsize=8, va="bottom")
        ax.axhline(target, color="tab:red", linestyle="--", linewidth=1)
        ax.text(-0.45, target * 1.015, f"target {target:.0f}x", fontsize=8, color="tab:red", ha="left", va="bottom")
        ax.set_xticks(range(len(PREFIX_HISTORY)), [label for label, _ in PREFIX_HISTORY], fontsize=7)
        ax.set_xlim(-0.5, len(PREFIX_HISTORY) - 0.3)
        highest = max(r[k] for _, runs in PREFIX_HISTORY for r in runs)
        ax.set_ylim(0, max(target * 1.35, highest * 1.12))
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("ratio (each dot one run)")
    fig.suptitle("Prefix caching on the H200: 1,024-token shared prefix, 64 requests x 32 + 128 tokens", fontsize=10)
    fig.tight_layout()
    path = out / "prefix_h200.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--out", default="docs/bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in (decode_plot(Path(args.results), out), throughput_plot(Path(args.results), out), prefix_plot(out)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
