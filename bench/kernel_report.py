"""The markdown report of bench/attention.py: the ceilings, correctness, decode against its
baselines, the decode sweep and prefill tables of one run."""

from __future__ import annotations

import math

from pico_kernels.triton_ops import DecodeConfig, PrefillConfig


def fmt(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def cfg_str(c) -> str:
    if c is None:
        return "default launch"
    if isinstance(c, DecodeConfig):
        p = "" if c.split_p else " (P one bf16 term)"
        return f"N{c.block_n}/w{c.num_warps}/s{c.num_stages}{p}"
    p = " (P two bf16 terms)" if c.split_p else ""
    return f"{c.block_m}x{c.block_n}/w{c.num_warps}/s{c.num_stages}{p}"


def render(
    meta, ceilings, checks, decode_rows, host, sweep_rows, prefill_rows, dcfg: DecodeConfig, pcfg: PrefillConfig
) -> str:
    """The markdown of one run; dcfg and pcfg: the default decode and prefill tile configs."""
    out = [f"# Kernel benchmarks: {meta['gpu']}", ""]
    out += [
        f"- date: {meta['date']}",
        f"- GPU: {meta['gpu']} ({meta['sms']} SMs)",
        f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}",
        f"- command: `{meta['command']}`",
        f"- wall time of the run: {meta['wall_s']:.0f} s",
        "",
    ]
    assumed = " (not measured: BENCHMARKS.md values assumed)" if ceilings.get("assumed") else ""
    out += [
        f"## Ceilings (measured in this run){assumed}",
        "",
        "| ceiling | value |",
        "| --- | --- |",
        f"| device-to-device copy, 2 GiB (bytes read + written) | {ceilings['copy_tbs']:.2f} TB/s |",
        f"| bf16 matmul 8192^3 | {ceilings['matmul_tflops']:.0f} TFLOP/s |",
        f"| (context) read-only: torch sum over 2 GiB bf16 | {fmt(ceilings.get('read_tbs'), '.2f')} TB/s |",
        "",
    ]
    out += [
        "## Correctness at full size (bf16, against pico_kernels.reference)",
        "",
        "| kernel | case | rel. error (norm) | ok |",
        "| --- | --- | --- | --- |",
    ]
    out += [f"| {r['kernel']} | {r['case']} | {r['err']:.2e} | {'yes' if r['ok'] else 'NO'} |" for r in checks]
    out += [""]
    backend = next((r["sdpa_backend"] for r in decode_rows if "sdpa_backend" in r), "n/a")
    out += [
        "## Decode: Hq=32, Hkv=8, D=128, bf16, block 16, shuffled block tables",
        "",
        f"Triton config {cfg_str(dcfg)}, splits from `pick_num_splits`. Bytes = K and V of every context "
        f"token once + q + out. SDPA: contiguous (B, Hkv, L, D) K/V, enable_gqa, backend `{backend}`. "
        "Flex: compiled flex_attention reading the same paged pool through a BlockMask "
        "(KV block = one page). Ratio columns: baseline time / Triton time (> 1: Triton faster).",
        "",
        "Triton graph µs: the same call replayed from a CUDA graph (no host launch gaps; how the engine runs decode).",
        "",
        "| B | L | KV GB | splits | Triton µs | TB/s | % copy | Triton graph µs | % copy (graph) | SDPA µs | "
        "SDPA/Triton | Flex µs | Flex/Triton | err SDPA | err Flex |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in decode_rows:
        sdpa_ratio = r["sdpa_us"] / r["us"] if "sdpa_us" in r else None
        flex_ratio = r["flex_us"] / r["us"] if "flex_us" in r else None
        out.append(
            f"| {r['B']} | {r['L']} | {r['kv_gb']:.2f} | {r['splits']} | {r['us']:.1f} | {r['tbs']:.2f} | "
            f"{r['pct_copy']:.1f} | "
            f"{r['graph_us']:.1f} | {r['graph_pct']:.1f} | {fmt(r.get('sdpa_us'), '.1f')} | {fmt(sdpa_ratio, '.2f')} "
            f"| {fmt(r.get('flex_us'), '.1f')} | {fmt(flex_ratio, '.2f')} | "
            f"{fmt(r.get('sdpa_err'), '.1e')} | {fmt(r.get('flex_err'), '.1e')} |"
        )
    errors = [f"- B={r['B']} L={r['L']}: {r[k]}" for r in decode_rows for k in ("sdpa_error", "flex_error") if k in r]
    if errors:
        out += ["", "Baseline errors:"] + errors
    if host is not None:
        out += [
            "",
            f"Host cost of one eager decode call at B={host['B']}, L={host['L']}: "
            f"{host['host_us']:.1f} µs of Python and launches, against {host['graph_us']:.1f} µs of GPU "
            "time (graph replay): below the host cost the eager figure measures the host.",
        ]
    out += [""]
    if sweep_rows:
        out += [
            "## Decode sweep: tile configs and split counts",
            "",
            "| B | L | config (tokens/warps/stages) | splits | µs | % copy |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in sweep_rows:
            if "error" in r:
                out.append(f"| {r['B']} | {r['L']} | {cfg_str(r['config'])} | {r['splits']} | {r['error']} | |")
            else:
                out.append(
                    f"| {r['B']} | {r['L']} | {cfg_str(r['config'])} | {r['splits']} | {r['us']:.1f} | "
                    f"{r['pct_copy']:.1f} |"
                )
        out += [""]
    out += [
        "## Prefill over a paged prefix: 4k-token prompt, Hq=32, Hkv=8, D=128, bf16, block 16",
        "",
        "First row of each case: the default launch (`paged_prefill_attention`: on sm_90 the Gluon "
        f"warp-specialised kernel, `pico_kernels.gluon_prefill`, elsewhere the Triton kernel's {cfg_str(pcfg)}); "
        "the other rows are Triton configs. FLOP = sum over query positions of "
        "attended keys x 4 x D x Hq. SDPA: contiguous K/V with heads repeated, bottom-right causal mask "
        "(is_causal when nothing is cached).",
        "",
        "| cached | new | GFLOP | config (MxN/warps/stages) | ms | TFLOP/s | % matmul | SDPA ms | SDPA "
        "TFLOP/s | SDPA / kernel | err vs default |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in prefill_rows:
        if "error" in r:
            out.append(f"| {r['cached']} | {r['q_len']} | | {cfg_str(r['config'])} | {r['error']} | | | | | | |")
        else:
            out.append(
                f"| {r['cached']} | {r['q_len']} | {r['gflop']:.1f} | {cfg_str(r['config'])} | {r['ms']:.3f} | "
                f"{r['tflops']:.0f} | "
                f"{r['pct_mm']:.0f} | {r['sdpa_ms']:.3f} | {r['sdpa_tflops']:.0f} | {r['sdpa_ms'] / r['ms']:.2f} | "
                f"{r['err_vs_default']:.1e} |"
            )
    return "\n".join(out) + "\n"
