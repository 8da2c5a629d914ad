"""Kernel benchmarks on the GPU: BENCHMARKS.md sections 1 (decode) and 2 (prefill).

    python bench/attention.py [--quick] [--out bench/results/kernels_h200.md]

One run measures the two ceilings itself (device-to-device copy bandwidth, bf16 matmul rate),
checks every Triton kernel against its torch reference at full size, times paged decode
against torch SDPA (contiguous KV) and FlexAttention (paged block mask over the same cache),
times prefill over a paged prefix, sweeps a few tile configs, and writes the tables as markdown
(date, GPU, versions, the exact command) to --out.

Timing: triton.testing.do_bench, median, after its warm-up; it rewrites a 256 MB buffer
before every timed call, so each call starts with a cold L2 (no input is read from cache).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.kernel_baselines import contiguous_kv, flex_paged_decode_fn, sdpa_decode_fn  # noqa: E402
from bench.kernel_report import render  # noqa: E402
from bench.kernel_setup import (  # noqa: E402
    DEVICE,
    DTYPE,
    HKV,
    HQ,
    KV_LIMIT_BYTES,
    PAGE,
    SCALE,
    D,
    bench_ms,
    device_num_sms,
    measure_ceilings,
    paged_cache,
    rel_err,
    run_section,
)
from pico_kernels.reference import (  # noqa: E402
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kvcache_ref,
)
from pico_kernels.triton_decode import default_decode_config  # noqa: E402
from pico_kernels.triton_ops import (  # noqa: E402
    TRITON_OPS,
    DecodeConfig,
    PrefillConfig,
    decode_with_config,
    pick_num_splits,
    prefill_with_config,
)
from pico_kernels.triton_prefill import default_prefill_config  # noqa: E402

PROMPT, CACHED = 4096, 3072  # prefill: a 4k-token prompt, with 0 and with 3k tokens cached
BATCHES = [1, 8, 32, 128, 256]
LENGTHS = [1024, 8192, 32768]
DECODE_VARIANTS = [
    DecodeConfig(64, 4, 5),
    DecodeConfig(64, 4, 5, split_p=False),
    DecodeConfig(64, 4, 3),
    DecodeConfig(32, 4, 7),
    DecodeConfig(64, 8, 5),
]
PREFILL_VARIANTS = [
    PrefillConfig(128, 128, 8, 3),
    PrefillConfig(128, 128, 8, 3, split_p=True),
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 64, 8, 5),
    PrefillConfig(64, 128, 8, 3),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 64, 4, 5),
]


# ------------------------------------------------------------------------------ sections


def check_correctness(gen) -> list[dict]:
    rows = []
    # store_kvcache: 4096 tokens scattered over a 1024-block pool, some skipped
    k_cache = torch.randn((1024, PAGE, HKV, D), dtype=DTYPE, device=DEVICE, generator=gen)
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(1024 * PAGE, device=DEVICE, generator=gen)[:4096]
    slots[::9] = -1
    key = torch.randn((4096, HKV, D), dtype=DTYPE, device=DEVICE, generator=gen)
    value = torch.randn_like(key)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slots)
    TRITON_OPS.store_kvcache(key, value, k_cache, v_cache, slots)
    exact = torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    rows.append(
        {
            "kernel": "store_kvcache",
            "case": "N=4096 tokens, 1/9 skipped",
            "err": 0.0 if exact else float("nan"),
            "ok": exact,
        }
    )

    # decode: ragged batch up to 8k, shuffled blocks
    lens = [8192, 1, 5000, 17, 8000, 3333, 1024, 777]
    blocks_per_seq = -(-max(lens) // PAGE)
    num_blocks = len(lens) * blocks_per_seq
    k_cache = torch.randn((num_blocks, PAGE, HKV, D), dtype=DTYPE, device=DEVICE, generator=gen)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=DEVICE, generator=gen).view(len(lens), -1).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn((len(lens), HQ, D), dtype=DTYPE, device=DEVICE, generator=gen)
    out = TRITON_OPS.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, SCALE)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, SCALE)
    err = rel_err(out, ref)
    rows.append(
        {
            "kernel": "paged_decode_attention",
            "case": f"B=8 ragged {min(lens)}..{max(lens)}",
            "err": err,
            "ok": err < 1e-2,
        }
    )

    # prefill: 4k prompt, 0 and 3k cached
    for cached in (0, CACHED):
        q_len = PROMPT - cached
        k_cache, v_cache, block_tables, seq_lens = paged_cache(1, PROMPT, gen)
        q = torch.randn((q_len, HQ, D), dtype=DTYPE, device=DEVICE, generator=gen)
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
        out = TRITON_OPS.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, SCALE)
        ref = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu, seq_lens, SCALE)
        err = rel_err(out, ref)
        rows.append(
            {
                "kernel": "paged_prefill_attention",
                "case": f"{PROMPT}-token prompt, {cached} cached",
                "err": err,
                "ok": err < 1e-2,
            }
        )
    torch.cuda.empty_cache()
    return rows


def decode_table(
    cells, copy_tbs: float, rep: int, gen, with_flex: bool, flex_budget_s: float, rows: list[dict], on_row=lambda: None
) -> list[dict]:
    """Appends one row per (B, L) cell to rows, calling on_row after each."""
    flex_spent = 0.0
    for batch, seq_len in tqdm(cells, desc="decode cells", file=sys.stdout):
        kv_bytes = 2 * batch * seq_len * HKV * D * 2
        k_cache, v_cache, block_tables, seq_lens = paged_cache(batch, seq_len, gen)
        q = torch.randn((batch, HQ, D), dtype=DTYPE, device=DEVICE, generator=gen)
        moved = kv_bytes + 2 * q.numel() * 2
        triton_fn = partial(TRITON_OPS.paged_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, SCALE)
        out = triton_fn()
        t_ms = bench_ms(triton_fn, rep)
        graph_ms = bench_ms(graph_of(triton_fn), rep)
        row = {
            "B": batch,
            "L": seq_len,
            "kv_gb": kv_bytes / 1e9,
            "us": t_ms * 1e3,
            "tbs": moved / t_ms / 1e9,
            "graph_us": graph_ms * 1e3,
            "graph_pct": 100 * moved / graph_ms / 1e9 / copy_tbs,
            "splits": pick_num_splits(
                batch, HKV, block_tables.shape[1] * PAGE, device_num_sms(), default_decode_config(DTYPE, D).block_n
            ),
        }
        row["pct_copy"] = 100 * row["tbs"] / copy_tbs

        if with_flex and flex_spent < flex_budget_s:
            start = time.perf_counter()
            try:
                flex_fn = flex_paged_decode_fn(q, k_cache, v_cache, block_tables, seq_lens, SCALE)
                row["flex_err"] = rel_err(flex_fn(), out)
                row["flex_us"] = bench_ms(flex_fn, rep) * 1e3
                del flex_fn
            except Exception as exc:  # report and carry on: one failing baseline must not end the run
                row["flex_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                print(f"flex failed at B={batch} L={seq_len}: {row['flex_error']}")
            flex_spent += time.perf_counter() - start

        k_contig = contiguous_kv(k_cache, block_tables, seq_len)
        v_contig = contiguous_kv(v_cache, block_tables, seq_len)
        del k_cache, v_cache
        try:
            sdpa_fn, backend = sdpa_decode_fn(q, k_contig, v_contig, SCALE)
            row["sdpa_err"] = rel_err(sdpa_fn(), out)
            row["sdpa_us"] = bench_ms(sdpa_fn, rep) * 1e3
            row["sdpa_backend"] = backend
        except Exception as exc:
            row["sdpa_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            print(f"sdpa failed at B={batch} L={seq_len}: {row['sdpa_error']}")
        del k_contig, v_contig, q, out
        torch.cuda.empty_cache()
        rows.append(row)
        on_row()
        tqdm.write(
            f"  B={batch:4d} L={seq_len:6d}: {row['us']:9.1f} us {row['tbs']:5.2f} TB/s "
            f"{row['pct_copy']:5.1f}% copy  sdpa {row.get('sdpa_us', float('nan')):9.1f} us  "
            f"flex {row.get('flex_us', float('nan')):9.1f} us",
            file=sys.stdout,
        )
    return rows


def graph_of(fn):
    """fn captured in a CUDA graph (as the engine runs decode); returns its replay. Timing the
    replay leaves out the host's launch overhead and the gaps it causes between kernels."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def decode_host_us(batch: int, seq_len: int, gen, calls: int = 300) -> dict:
    """Host time per eager decode call (no sync between calls), against its GPU time."""
    k_cache, v_cache, block_tables, seq_lens = paged_cache(batch, seq_len, gen)
    q = torch.randn((batch, HQ, D), dtype=DTYPE, device=DEVICE, generator=gen)
    fn = lambda: TRITON_OPS.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, SCALE)  # noqa: E731
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return {"B": batch, "L": seq_len, "host_us": host_us, "graph_us": bench_ms(graph_of(fn), 50) * 1e3}


def decode_sweep(cells, copy_tbs: float, rep: int, gen) -> list[dict]:
    """Tile configs and split counts (x0.5, x1, x2 of pick_num_splits) on a few cells."""
    rows = []
    num_sms = device_num_sms()
    for batch, seq_len in tqdm(cells, desc="decode sweep", file=sys.stdout):
        k_cache, v_cache, block_tables, seq_lens = paged_cache(batch, seq_len, gen)
        q = torch.randn((batch, HQ, D), dtype=DTYPE, device=DEVICE, generator=gen)
        moved = 2 * batch * seq_len * HKV * D * 2 + 2 * q.numel() * 2
        for config in DECODE_VARIANTS:
            base = pick_num_splits(batch, HKV, seq_len, num_sms, config.block_n)
            for factor in (0.5, 1, 2):
                splits = max(1, int(base * factor))
                if factor != 1 and splits == base:
                    continue
                try:
                    fn = partial(decode_with_config, q, k_cache, v_cache, block_tables, seq_lens, SCALE, config, splits)
                    fn()
                    t_ms = bench_ms(fn, rep)
                    rows.append(
                        {
                            "B": batch,
                            "L": seq_len,
                            "config": config,
                            "splits": splits,
                            "us": t_ms * 1e3,
                            "pct_copy": 100 * moved / t_ms / 1e9 / copy_tbs,
                        }
                    )
                except Exception as exc:
                    rows.append(
                        {
                            "B": batch,
                            "L": seq_len,
                            "config": config,
                            "splits": splits,
                            "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}",
                        }
                    )
        del k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def causal_flops(q_len: int, seq_len: int) -> float:
    """Sum over query positions of the keys each attends to, times 4 * D * Hq."""
    cached = seq_len - q_len
    attended = q_len * cached + q_len * (q_len + 1) // 2
    return 4.0 * attended * D * HQ


def prefill_table(configs, rep: int, gen, matmul_tflops: float) -> list[dict]:
    from torch.nn.attention.bias import causal_lower_right

    rows = []
    for cached in (0, CACHED):
        seq_len, q_len = PROMPT, PROMPT - cached
        k_cache, v_cache, block_tables, seq_lens = paged_cache(1, seq_len, gen)
        q = torch.randn((q_len, HQ, D), dtype=DTYPE, device=DEVICE, generator=gen)
        cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
        flops = causal_flops(q_len, seq_len)
        ref = TRITON_OPS.paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, SCALE)
        # SDPA on contiguous K/V (heads repeated for GQA), bottom-right-aligned causal mask
        k_contig = contiguous_kv(k_cache, block_tables, seq_len).repeat_interleave(HQ // HKV, dim=1)
        v_contig = contiguous_kv(v_cache, block_tables, seq_len).repeat_interleave(HQ // HKV, dim=1)
        q4 = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, Lq, D)
        if cached == 0:
            sdpa_fn = partial(F.scaled_dot_product_attention, q4, k_contig, v_contig, is_causal=True, scale=SCALE)
        else:
            bias = causal_lower_right(q_len, seq_len)
            sdpa_fn = partial(F.scaled_dot_product_attention, q4, k_contig, v_contig, attn_mask=bias, scale=SCALE)
        sdpa_ms = bench_ms(sdpa_fn, rep)
        sdpa_err = rel_err(sdpa_fn()[0].transpose(0, 1), ref)
        for config in configs:  # None: the default launch, what paged_prefill_attention runs
            fn = partial(prefill_with_config, q, k_cache, v_cache, block_tables, cu, seq_lens, SCALE, config)
            try:
                err = rel_err(fn(), ref) if config is not None else 0.0
                t_ms = bench_ms(fn, rep)
                rows.append(
                    {
                        "cached": cached,
                        "q_len": q_len,
                        "config": config,
                        "ms": t_ms,
                        "tflops": flops / t_ms / 1e9,
                        "pct_mm": 100 * flops / t_ms / 1e9 / matmul_tflops,
                        "sdpa_ms": sdpa_ms,
                        "sdpa_tflops": flops / sdpa_ms / 1e9,
                        "err_vs_default": err,
                        "sdpa_err": sdpa_err,
                        "gflop": flops / 1e9,
                    }
                )
            except Exception as exc:
                rows.append(
                    {
                        "cached": cached,
                        "q_len": q_len,
                        "config": config,
                        "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}",
                    }
                )
        del k_cache, v_cache, k_contig, v_contig
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells, shorter timing, no sweeps")
    parser.add_argument("--out", default="bench/results/kernels_h200.md", help="markdown output path")
    parser.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline")
    parser.add_argument("--flex-budget-s", type=float, default=120.0, help="stop timing Flex after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rep = 40 if args.quick else 100
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join(["python", "bench/attention.py", *sys.argv[1:]]),
    }

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = {
        "ceilings": {"copy_tbs": float("nan"), "matmul_tflops": float("nan")},
        "checks": [],
        "decode": [],
        "host": None,
        "sweep": [],
        "prefill": [],
    }

    def save() -> str:
        """Rewrite the report after every section, so a run cut short still leaves one."""
        meta["wall_s"] = time.perf_counter() - started
        text = render(
            meta,
            results["ceilings"],
            results["checks"],
            results["decode"],
            results["host"],
            results["sweep"],
            results["prefill"],
            default_decode_config(DTYPE, D),
            default_prefill_config(DTYPE, D),
        )
        out_path.write_text(text)
        return text

    ceilings = run_section("ceilings", measure_ceilings, rep, default=None)
    results["ceilings"] = ceilings or {"copy_tbs": 4.3, "matmul_tflops": 790.0, "assumed": True}
    ceilings = results["ceilings"]
    print(f"copy {ceilings['copy_tbs']:.2f} TB/s, matmul {ceilings['matmul_tflops']:.0f} TFLOP/s")
    results["checks"] = run_section("correctness", check_correctness, gen, default=[])
    for r in results["checks"]:
        print(f"  {r['kernel']:26s} {r['case']:28s} rel err {r['err']:.2e} {'ok' if r['ok'] else 'FAILED'}")
    save()

    batches = [1, 32, 256] if args.quick else BATCHES
    lengths = [1024, 8192] if args.quick else LENGTHS
    cells = [(b, n) for n in lengths for b in batches if 2 * b * n * HKV * D * 2 <= KV_LIMIT_BYTES]
    run_section(
        "decode table",
        decode_table,
        cells,
        ceilings["copy_tbs"],
        rep,
        gen,
        not args.no_flex,
        args.flex_budget_s,
        results["decode"],
        save,
    )
    results["host"] = run_section("decode host cost, B=1 L=1k", decode_host_us, 1, 1024, gen)
    save()
    sweep_cells = [] if args.quick else [(1, 32768), (8, 32768), (32, 8192), (256, 1024), (1, 1024)]
    results["sweep"] = run_section(
        "decode sweep", decode_sweep, sweep_cells, ceilings["copy_tbs"], rep, gen, default=[]
    )
    save()
    default_config = default_prefill_config(DTYPE, D)
    configs = [None, default_config] + ([] if args.quick else [c for c in PREFILL_VARIANTS if c != default_config])
    results["prefill"] = run_section("prefill", prefill_table, configs, rep, gen, ceilings["matmul_tflops"], default=[])
    report = save()
    checks = results["checks"]
    print()
    print(report)
    print(f"written to {args.out}")
    return 0 if checks and all(r["ok"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
