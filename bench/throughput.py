"""End-to-end offline throughput on nano-vllm's benchmark workload (its bench.py: random prompts
and output lengths). Results of the H200 runs: bench/results/throughput_h200*.md, docs/bench/.

    python bench/throughput.py                       # Qwen3-0.6B architecture, random bf16 weights, on the GPU
    python bench/throughput.py --model tiny --device cpu --num-seqs 16 --max-len 128   # a quick try on the CPU
    python bench/throughput.py --model path/to/hf-dir

The first row is the path users take (`--no-user-path` leaves it out): in a fresh process,
`LLM(model=dir)` with every default over the model's directory (a named config: random
weights written with the real Qwen2 tokenizer beside them), so every output token is
detokenized; one tiny warm-up generate, one timed generate of the workload (nano-vllm's
protocol). The second is the in-memory model without a tokenizer, as the bench always timed it.

Prints output tokens, seconds, tok/s, the bandwidth roofline computed for this very workload
from the measured copy bandwidth (each decode step reads the weights once plus all live K/V;
prefill at the measured matmul rate), and the fraction of it reached.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RunCounters,
    add_overlap_flag,
    copy_bandwidth,
    device_sync,
    environment,
    make_llm,
    matmul_flops,
    write_result,
)
from bench.throughput_user_path import user_path_row, user_path_run  # noqa: E402
from contracts import phase_times  # noqa: E402
from scheduler_svc.cli_args import HelpFormatter  # noqa: E402

MODEL_PHASES_BEFORE: dict[str, tuple[float, int]] = {}  # the model service's phase totals when the timed call began


def make_workload(num_seqs: int, max_input_len: int, max_output_len: int, seed: int = 0):
    """Exactly nano-vllm's bench.py: random token ids in [0, 10000]."""
    from scheduler_svc import SamplingParams

    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, max_output_len))
        for _ in range(num_seqs)
    ]
    return prompts, params


def roofline_tok_s(
    config,
    prompt_lens: list[int],
    output_lens: list[int],
    bandwidth: float,
    flops: float,
    dtype_bytes: int = 2,
    kv_dtype_bytes: int = 2,  # 1: an FP8 KV cache
) -> float:
    """Best possible tok/s for this workload: every sequence resident at once, each decode
    step reads the weights once plus the K/V of every live sequence, prefill compute-bound."""
    h, L = config.hidden_size, config.num_hidden_layers
    q, kv = config.q_size, config.kv_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    weight_bytes = (L * per_layer + config.vocab_size * h) * dtype_bytes
    kv_bytes_per_token = L * 2 * kv * kv_dtype_bytes
    prefill_flops = sum(2 * (L * per_layer + config.vocab_size * h) * n + 2 * L * q * n * n for n in prompt_lens)
    seconds = prefill_flops / flops
    max_out = max(output_lens)
    # Decode step t produces token t + 1 (token 1 comes from prefill) for sequences with out > t.
    for t in range(1, max_out):
        live_ctx = sum(p + t for p, o in zip(prompt_lens, output_lens) if o > t)
        if live_ctx:
            seconds += (weight_bytes + live_ctx * kv_bytes_per_token) / bandwidth
    return sum(output_lens) / seconds


def run_embedded(args):
    """The engine in this process, as `LLM` builds it, from the bench's flags. Returns (llm, runner)."""
    return make_llm(
        args.model,
        args.device,
        args.dtype,
        num_gpu_blocks=args.num_gpu_blocks,
        enforce_eager=args.enforce_eager,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.overlap,
    )


def run_service(args, runner_config_path: str, model=None):
    """The same workload through the KV-cache and model services (separate processes, gRPC on
    loopback) with the engine in this process, as the scheduler service runs it. A named
    config gets its random weights written to a directory first, so the model service
    loads exactly the weights embedded mode used."""
    from bench.service_overhead import Services
    from model_svc.loader import save_model
    from scheduler_svc.llm import LLM
    from scheduler_svc.remote_engine import build_service_engine

    path = runner_config_path
    if model is not None:  # random weights: hand them over through a directory
        save_model(model, path)
    model_args = [
        f"--model={path}",
        f"--device={args.device}",
        f"--block-size={args.block_size}",
        f"--max-num-seqs={args.max_num_seqs}",
        f"--max-num-batched-tokens={args.max_num_batched_tokens}",
    ]
    if args.num_gpu_blocks:
        model_args.append(f"--num-gpu-blocks={args.num_gpu_blocks}")
    if args.device == "cpu":
        model_args.append("--torch-threads=1")
    services = Services(None, model_args)
    config = services.config(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.service_pipelined,
    )
    return LLM.from_engine(build_service_engine(config, skip_tokenizer_init=True, token=services.token)), services


def hf_row(runner, prompts, params, tok_s: float) -> str:
    """transformers' continuous batching on the same weights and workload, as a table row."""
    from bench.hf_peer import run_hf_continuous_batching
    from model_svc.loader import save_model

    if runner.random_weights:  # hand the weights over through the model directory
        save_model(runner.model, runner.model_path)
    try:
        seconds, n = run_hf_continuous_batching(
            runner.model_path,
            prompts,
            [p.max_tokens for p in params],
            params[0].temperature,
            runner.device,
            runner.dtype,
        )
    except Exception as exc:  # noqa: BLE001 - an API of transformers that moves: report it, keep the run
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return f"| transformers continuous batching | failed: {why} | | | | | | |"
    hf_tok_s = n / seconds
    return (
        f"| transformers continuous batching | {n} | {seconds:.2f} | {hf_tok_s:,.0f} | "
        f"| {hf_tok_s / tok_s:.1%} of embedded | | |"
    )


def timed_generate(
    llm, prompts, params, device, cold_cache: bool = True, warmup: str = "tiny"
) -> tuple[float, int, int, int]:
    """Seconds and output tokens of one generate call after a warm-up. cold_cache: start
    from an empty prefix cache (embedded; the services start cold anyway). warmup: "tiny" (two
    short requests: kernels compile on first use) or "workload" (also the workload's prompts
    with 16 output tokens each: the first full-size prefill and decode batches). Returns seconds,
    output tokens, engine steps and preemptions of the timed call."""
    from scheduler_svc import SamplingParams

    sync = device_sync(device)
    llm.generate([[1, 2, 3, 4], list(range(5, 40))], SamplingParams(max_tokens=8, ignore_eos=True))
    if warmup == "workload":
        short = [SamplingParams(temperature=p.temperature, max_tokens=16, ignore_eos=True) for p in params]
        llm.generate(prompts, short)
    if cold_cache:  # the workload's prompts, cached by an earlier run, would skip their prefill
        llm.engine.reset_prefix_cache()
    sync()
    stats = llm.engine.scheduler.stats
    steps, preemptions = stats.num_steps, stats.num_preemptions
    if phase_times.ENABLED:  # phases of the timed call only (the model service's: as a difference)
        phase_times.reset()
        MODEL_PHASES_BEFORE.clear()
        MODEL_PHASES_BEFORE.update(phase_times.load("model"))
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    sync()
    seconds = time.perf_counter() - t
    return seconds, sum(len(o.token_ids) for o in outs), stats.num_steps - steps, stats.num_preemptions - preemptions


class _Help(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """The docstring as written, and each flag's default (as picovllm's own help)."""


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument(
        "--model", default="qwen3-0.6b", help="'qwen3-0.6b' or 'tiny' (random weights) or a local HF directory"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu)"
    )
    ap.add_argument(
        "--mode",
        default="embedded",
        choices=["embedded", "service"],
        help="service: embedded first, then the same workload through the KV-cache and model services",
    )
    ap.add_argument("--num-seqs", type=int, default=256, help="requests in the workload")
    ap.add_argument("--max-len", type=int, default=1024, help="max input and output length")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    ap.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="device KV pool size in blocks (default: measured from free memory)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one step at most")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens in one step at most (default: LLM()'s for the device: config.offline_batched_tokens)",
    )
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--pipeline-depth",
        type=int,
        default=None,
        help="overlapped scheduling: steps in flight before the oldest is read back (default: the engine's, 2)",
    )
    ap.add_argument(
        "--service-pipelined",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="service mode: pipeline the model steps, two ahead (default: the service's own, on for a GPU)",
    )
    add_overlap_flag(ap)
    ap.add_argument(
        "--peer",
        choices=["hf"],
        default=None,
        help="hf: also time transformers' continuous batching on the same weights and workload (default: none)",
    )
    ap.add_argument(
        "--warmup",
        choices=["tiny", "workload"],
        default="tiny",
        help="before each run: two short requests, or also the workload's prompts with 16 output tokens",
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="time the workload this many times in one process (median reported)"
    )
    ap.add_argument(
        "--check", action="store_true", help="first check greedy parity of the optimized path vs the plain one"
    )
    ap.add_argument(
        "--user-path",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first time the user path: LLM(model=dir) with defaults and the real tokenizer, in a fresh process",
    )
    ap.add_argument(
        "--user-path-tokenizers",
        default="qwen2",
        help="the user path's runs, comma-separated, in order: qwen2 (the directory's), none "
        "(skip_tokenizer_init=True: what detokenization costs), bytes (a slow byte-level tokenizer), "
        'fp8 (the directory\'s, kv_cache_dtype="fp8"; its roofline counts one byte a K/V element)',
    )
    ap.add_argument("--out", default=None, help="write a markdown result here (default: print only)")
    args = ap.parse_args()
    if args.max_num_batched_tokens is None:
        from scheduler_svc.config import offline_batched_tokens

        args.max_num_batched_tokens = offline_batched_tokens(args.device)
    return args


def timed_runs(args, llm, prompts, params, dev: torch.device) -> tuple[list[tuple], list[str]]:
    """args.repeats timed runs of the workload: (seconds, output tokens, steps, preemptions)
    each, and a note per run (its counters, the Triton kernels it compiled)."""
    counters, runs, run_notes = RunCounters(), [], []
    for _ in range(max(1, args.repeats)):
        before = counters.snapshot()
        runs.append(timed_generate(llm, prompts, params, dev, warmup=args.warmup))
        run_notes.append(
            f"- {runs[-1][1] / runs[-1][0]:,.0f} tok/s, {runs[-1][2]} steps; during warm-up and run: "
            f"{RunCounters.delta(before, counters.snapshot())}"
        )
        run_notes += [
            f"  - compiled: {name}"
            for name in counters.compiled[len(counters.compiled) - (counters.compiles - before["triton compiles"]) :]
        ]
    return runs, run_notes


def service_rows(args, runner, prompts, params, tok_s: float, sync_tok_s: float, overlapped: bool) -> list[str]:
    """The same workload through the KV-cache and model services, as table rows, then its
    phase tables when PICOVLLM_PHASE_TIMES is set. The embedded engine must be gone: this
    frees its runner's pools and graphs for the model service."""
    config_path, model = runner.model_path, runner.model
    runner.graphs = runner.prefill_graphs = runner.pools = None
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
    svc, services = run_service(args, config_path, model if runner.random_weights else None)
    svc_pipelined = svc.engine.pipelined
    if args.pipeline_depth is not None:
        svc.engine.pipeline_depth = args.pipeline_depth
    del model
    try:
        svc_seconds, svc_out, svc_steps, _ = timed_generate(
            svc, prompts, params, torch.device("cpu"), cold_cache=False, warmup=args.warmup
        )
    finally:
        services.close()
    svc_tok_s = svc_out / svc_seconds
    ratio = f"{svc_tok_s / sync_tok_s:.1%} of embedded synchronous" + (
        f", {svc_tok_s / tok_s:.1%} of embedded overlapped" if overlapped else ""
    )
    rows = [
        f"| service (3 processes, gRPC{', pipelined' if svc_pipelined else ''}) | {svc_out} | {svc_seconds:.2f} "
        f"| {svc_tok_s:,.0f} | | {ratio} | {svc_steps} | |"
    ]
    if phase_times.ENABLED:  # where each process spent the service run's steps
        model_phases = {
            k: (s - MODEL_PHASES_BEFORE.get(k, (0.0, 0))[0], n - MODEL_PHASES_BEFORE.get(k, (0.0, 0))[1])
            for k, (s, n) in phase_times.load("model").items()
        }
        rows += [
            "",
            f"Phase times, service run, scheduler process ({svc_steps} steps):",
            *phase_times.table(phase_times.snapshot(), svc_steps),
            "",
            "Phase times, service run, model service:",
            *phase_times.table(model_phases, svc_steps),
        ]
    return rows


def main() -> None:
    args = parse_args()
    env = environment()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # as the model service runs on the CPU: a like-for-like comparison
    prompts, params = make_workload(args.num_seqs, args.max_len, args.max_len)
    user_tokenizers = args.user_path_tokenizers.split(",") if args.user_path else []
    user = [user_path_run(args.model, args.num_seqs, args.max_len, name) for name in user_tokenizers]
    parity = []
    if args.check:
        from bench.parity import check_parity

        parity = check_parity(args.model, args.device, args.dtype, near_tie=1e-2)
        print("\n".join(parity))
    llm, runner = run_embedded(args)
    if args.pipeline_depth is not None:
        llm.engine.pipeline_depth = args.pipeline_depth
    bw, fl = copy_bandwidth(dev), matmul_flops(dev)  # before any other process shares the device
    runs, run_notes = timed_runs(args, llm, prompts, params, dev)
    seconds, num_out, embedded_steps, embedded_preemptions = sorted(runs)[len(runs) // 2]  # the median run
    phase_rows = []
    if phase_times.ENABLED:
        phase_rows += [
            "",
            f"Phase times, last embedded run ({runs[-1][2]} steps):",
            *phase_times.table(phase_times.snapshot(), runs[-1][2]),
        ]
    tok_s = num_out / seconds
    overlapped, llm_depth = llm.engine.async_scheduling, llm.engine.pipeline_depth
    # Read before a service run takes the runner's pools and graphs away.
    num_device_blocks, graphs = runner.num_device_blocks, runner.graphs is not None
    extra_rows = [hf_row(runner, prompts, params, tok_s)] if args.peer == "hf" else []
    if args.mode == "service":  # embedded first (the reference), then the services, same run
        sync_tok_s = tok_s
        if overlapped:  # the services step synchronously: time embedded that way too, like for like
            llm.engine.async_scheduling = False
            sync_seconds, sync_out, _, _ = timed_generate(llm, prompts, params, dev, warmup=args.warmup)
            sync_tok_s = sync_out / sync_seconds
            extra_rows.append(
                f"| embedded, synchronous scheduling | {sync_out} | {sync_seconds:.2f} | {sync_tok_s:,.0f} | | | | |"
            )
        del llm  # the embedded engine goes before the model service takes the device
        rows = service_rows(args, runner, prompts, params, tok_s, sync_tok_s, overlapped)
        extra_rows.append(rows[0])
        phase_rows += rows[1:]

    def roofline(kv_dtype_bytes: int = 2) -> float:
        lens = [len(p) for p in prompts], [p.max_tokens for p in params]
        return (
            roofline_tok_s(runner.config, *lens, bw, fl, kv_dtype_bytes=kv_dtype_bytes)
            if dev.type == "cuda"
            else float("nan")
        )

    roof = roofline()
    lines = [
        "| mode | output tokens | seconds | tok/s | roofline tok/s | fraction | steps | preemptions |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(user_path_row(run, roofline(1 if name == "fp8" else 2), name) for name, run in zip(user_tokenizers, user)),
        f"| embedded, in-memory model, no tokenizer | {num_out} | {seconds:.2f} | {tok_s:,.0f} | {roof:,.0f} "
        f"| {tok_s / roof:.1%} | {embedded_steps} | {embedded_preemptions} |",
        *extra_rows,
        *(
            ["", f"repeats in one process (tok/s, in order): {', '.join(f'{r[1] / r[0]:,.0f}' for r in runs)}"]
            if len(runs) > 1
            else []
        ),
        "",
        f"each run ({args.warmup} warm-up before it):",
        *run_notes,
        "",
        f"prompt tokens {sum(len(p) for p in prompts)}, copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul "
        f"{fl / 1e12:.0f} TFLOP/s, device blocks {num_device_blocks}, kernels {runner.ops.name}, "
        f"cuda graphs {graphs}, overlapped scheduling {overlapped} (pipeline depth {llm_depth})",
    ]
    lines += notes(phase_rows, parity)
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Offline throughput (nano-vllm workload)", env, "\n".join(lines))


def notes(phase_rows: list[str], parity: list[str]) -> list[str]:
    """The report's tail: the phase tables, the parity check."""
    lines = []
    if phase_rows:
        lines += [
            "",
            "(phase tables: PICOVLLM_PHASE_TIMES was set; wall time per phase of each process, see "
            "contracts/phase_times.py)",
            *phase_rows,
        ]
    if parity:
        lines += [
            "",
            "Greedy parity, optimized vs plain path on the same weights (first 32 tokens; 8 prompts one at a time, "
            "then 48 stepped together; bench/parity.py):",
            *(f"- {r}" for r in parity),
        ]
    return lines


if __name__ == "__main__":
    main()
