"""The path users take: `picovllm serve all` driven through the scheduler's public streaming
`Generate` from client processes apart from the server, against embedded `LLM.generate` on
the same model directory and workload, in one run.

    python bench/serve.py --model qwen3-0.6b --device cuda --out bench/results/serve_h200.md
    python bench/serve.py --model path/to/hf-dir --device cuda --clients 4
    python bench/serve.py --device cpu --num-requests 64 --min-len 16 --max-input-len 128 --max-output-len 64

`--model qwen3-0.6b` (or `tiny`) writes random weights of that architecture to a temporary
directory with the real Qwen2 tokenizer of tests/fixtures beside them, so the server
tokenizes and detokenizes for real; no `--model`: the bundled stories260k.

Cases, all with token-id prompts and ignore_eos (nano-vllm's workload: random prompt and
output lengths, seeded):
- embedded: `LLM.generate` over the whole workload in a process of its own (temperature 0.6),
  timed after a warm-up; the reference.
- service, throughput: every request streamed at once from `--clients` processes (grpc.aio),
  tokens/s over the window from the first request sent to the last message; the ratio to
  embedded; every stream's token count checked against its max_tokens and its usage.
- service, latency-bound: `--latency-streams` streams at a time from one process: TTFT and
  the time per output token between messages, p50 and p99.
- greedy parity: `--parity-prompts` prompts one at a time at temperature 0, service vs
  embedded, token for token.
`--py-spy DIR` samples the server's processes during the throughput case (py-spy installed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import add_tokenizer  # noqa: E402
from bench.serve_clients import Job, run_clients, summarize  # noqa: E402
from bench.serve_embedded import run_embedded  # noqa: E402
from bench.serve_probe import server_cpu, start_py_spy, stop_py_spy  # noqa: E402
from contracts.rpc import free_port  # noqa: E402


# ----------------------------------------------------------------- model and workload
def _write_random_model(name: str, path: str) -> None:
    """Random weights of a named architecture (bench/common.py), saved in HF layout."""
    import torch

    from bench.common import CONFIGS
    from model_svc.config import ModelConfig
    from model_svc.loader import build_random_model, save_model

    Path(path, "config.json").write_text(json.dumps(CONFIGS[name]))
    config = ModelConfig.from_pretrained(path)
    dtype = torch.bfloat16 if CONFIGS[name].get("torch_dtype") == "bfloat16" else torch.float32
    save_model(build_random_model(config, dtype, "cpu"), path)


def prepare_model(model: str | None, weights: bool = True) -> tuple[str, str | None]:
    """(model directory, temporary directory to remove or None). weights=False: a named
    architecture gets its config.json and tokenizer only (the null model needs no weights)."""
    if model is None:
        from scheduler_svc.config import BUNDLED_MODEL

        return BUNDLED_MODEL, None
    if model in ("qwen3-0.6b", "tiny"):
        tmp = tempfile.mkdtemp(prefix=f"picovllm-serve-{model}-")
        if weights:
            proc = mp.get_context("spawn").Process(target=_write_random_model, args=(model, tmp))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                raise SystemExit(f"building the random {model} weights failed (exit {proc.exitcode})")
        else:
            from bench.common import CONFIGS

            Path(tmp, "config.json").write_text(json.dumps(CONFIGS[model]))
        add_tokenizer(tmp)
        return tmp, tmp
    return model, None


def make_jobs(
    num: int,
    min_len: int,
    max_input: int,
    max_output: int,
    vocab: int,
    seed: int,
    temperature: float,
    keep_ids: bool = False,
) -> list[Job]:
    """nano-vllm's bench.py workload: prompt ids in [0, 10000] (within the vocabulary),
    prompt and output lengths uniform in [min_len, max] (an output maximum below min_len: up to it)."""
    rng = random.Random(seed)
    top = min(10000, vocab - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(min_len, max_input))] for _ in range(num)]
    return [
        Job(i, p, rng.randint(min(min_len, max_output), max_output), temperature, keep_ids)
        for i, p in enumerate(prompts)
    ]


# ----------------------------------------------------------------- the server
def _server_argv(model_dir: str, args: argparse.Namespace, address: str) -> list[list[str]]:
    """`picovllm serve all` (no HTTP gateway, no metrics port) on free loopback ports; with
    --null-model its three services one by one, the model service replaced by the null one."""
    cli = [sys.executable, "-m", "scheduler_svc.cli", "serve"]
    addrs = [
        "--scheduler-addr",
        address,
        "--kvcache-addr",
        f"127.0.0.1:{free_port()}",
        "--model-addr",
        f"127.0.0.1:{free_port()}",
    ]
    limits = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.null_model is None:
        blocks = ["--num-gpu-blocks", str(args.num_gpu_blocks)] if args.num_gpu_blocks else []
        return [
            cli
            + [
                "all",
                *addrs,
                "--metrics-port",
                "0",
                "--port",
                "0",
                "--model",
                model_dir,
                "--device",
                args.device,
                *limits,
                *blocks,
            ]
        ]
    null = [
        sys.executable,
        "-m",
        "bench.null_model",
        "--model-addr",
        addrs[5],
        "--model",
        model_dir,
        "--step-ms",
        str(args.null_model),
        "--num-gpu-blocks",
        str(args.num_gpu_blocks or 8192),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    return [
        cli + ["kvcache", *addrs],
        null,
        cli + ["scheduler", *addrs, "--metrics-port", "0", "--model", model_dir, "--async-scheduling", *limits],
    ]


def start_server(model_dir: str, args: argparse.Namespace) -> tuple[list[subprocess.Popen], str]:
    from contracts.health import check_health

    address = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PICOVLLM_INTERNAL_TOKEN": secrets.token_urlsafe(32),
    }
    env.pop("PICOVLLM_API_KEY", None)
    procs = [
        subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
        for argv in _server_argv(model_dir, args, address)
    ]
    deadline = time.monotonic() + args.startup_timeout
    while not check_health(address, timeout=1.0):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            stop_server(procs)
            raise SystemExit(f"the server did not start (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.5)
    return procs, address


def stop_server(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):  # the scheduler first: it drains while its peers run
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_service(
    address: str,
    server: list[subprocess.Popen],
    args: argparse.Namespace,
    warm: list[Job],
    jobs: list[Job],
    latency: list[Job],
    parity: list[Job],
) -> dict:
    run_clients(address, warm, 1)
    parity_records = run_clients(address, parity, 1, sequential=True) if parity else []
    spies = start_py_spy(server, args.py_spy) if args.py_spy else []
    cpu_before = server_cpu(server)
    try:
        throughput = run_clients(address, jobs, args.clients)
    finally:
        stop_py_spy(spies)
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in server_cpu(server).items()}
    latency_records = run_clients(address, latency, 1, concurrency=args.latency_streams)
    return {
        "throughput": summarize(throughput),
        "counts": [r.tokens for r in throughput],
        "latency": summarize(latency_records),
        "parity": [r.token_ids for r in parity_records],
        "cpu": cpu,
    }


# ----------------------------------------------------------------- report
def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _host() -> str:
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        name = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return f"{name}, {os.cpu_count()} CPUs"


def _device_name(device: str) -> str:
    """The GPU's name without touching it from this process (nvidia-smi), else `device`."""
    if device.startswith("cuda") and shutil.which("nvidia-smi"):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return device


def _row(name: str, s: dict, embedded_tok_s: float | None) -> str:
    ratio = f"{s['tok_s'] / embedded_tok_s:.1%}" if embedded_tok_s else ""
    return (
        f"| {name} | {s['requests']} | {s['tokens']} | {s['seconds']:.2f} | {s['tok_s']:,.0f} | {ratio} | {s['ttft_p50'] * 1e3:.1f} | "
        f"{s['ttft_p99'] * 1e3:.1f} | {s['itl_p50'] * 1e3:.2f} | {s['itl_p99'] * 1e3:.2f} | {s['tokens_per_message']:.2f} |"
    )


def _parity_line(service: list[list[int]], embedded: list[list[int]] | None) -> str:
    if embedded is None or not service:
        return "greedy parity: not run (--no-embedded or --null-model)"
    diverged = []
    for i, (a, b) in enumerate(zip(service, embedded)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diverged.append(f"prompt {i} at token {at}")
    equal = len(service) - len(diverged)
    return f"greedy parity (one prompt at a time, temperature 0): {equal}/{len(service)} equal to embedded" + (
        f"; diverged: {', '.join(diverged)}" if diverged else ""
    )


def report(args: argparse.Namespace, jobs: list[Job], embedded: dict | None, service: dict) -> str:
    thr, lat = service["throughput"], service["latency"]
    emb_tok_s = embedded["tokens"] / embedded["seconds"] if embedded else None
    want = [j.max_tokens for j in jobs]
    lines = [
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- device: {embedded['device'] if embedded else _device_name(args.device)}; host: {_host()}"
        + (f"; null model ({args.null_model:g} ms a step, bench/null_model.py)" if args.null_model is not None else ""),
        f"- versions: python {platform.python_version()}, torch {_version('torch')}, grpcio {_version('grpcio')}, "
        f"protobuf {_version('protobuf')}, triton {_version('triton')}",
        f"- command: `python bench/serve.py {' '.join(a if not a.startswith('/') else Path(a).name for a in sys.argv[1:])}`",
        f"- workload: {len(jobs)} requests, prompt {args.min_len}-{args.max_input_len} tokens ({sum(len(j.prompt) for j in jobs)} in all), "
        f"output {args.min_len}-{args.max_output_len} ({sum(want)} in all), temperature {args.temperature}, ignore_eos, token-id prompts, "
        f"seed {args.seed}; max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}",
        "",
        "| path | requests | output tokens | seconds | tok/s | of embedded | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | tokens/message |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if embedded:
        lines.append(
            f"| embedded `LLM.generate` | {len(jobs)} | {embedded['tokens']} | {embedded['seconds']:.2f} | {emb_tok_s:,.0f} | 100.0% "
            "| | | | | |"
        )
    lines.append(_row(f"service, {args.clients} client processes, all streams at once", thr, emb_tok_s))
    if embedded:
        lines.append(
            _row(
                f"embedded engine, {args.latency_streams} streams at a time (latency-bound)", embedded["latency"], None
            )
        )
    lines.append(_row(f"service, {args.latency_streams} streams at a time (latency-bound)", lat, None))
    counts_ok = service["counts"] == want and (embedded is None or embedded["counts"] == want)
    lines += [
        "",
        f"token counts: service {thr['tokens']}, embedded {embedded['tokens'] if embedded else '-'}, wanted {sum(want)}: "
        f"{'every stream equal to its max_tokens' if counts_ok else 'MISMATCH'}; usage vs streamed tokens mismatches: "
        f"{thr['usage_mismatch']}; largest message {thr['max_tokens_per_message']} tokens",
        _parity_line(service["parity"], embedded["parity"] if embedded else None),
    ]
    if embedded:
        emb_itl = embedded["latency"]["itl_p50"]
        lines.append(
            f"latency-bound, {args.latency_streams} streams: inter-token p50 through the service {lat['itl_p50'] * 1e3:.2f} ms "
            f"vs the embedded engine's time per step {emb_itl * 1e3:.2f} ms: {lat['itl_p50'] / emb_itl - 1:+.1%}"
        )
    if service["cpu"]:
        lines.append(
            "CPU of the server's processes during the throughput case (seconds, share of its wall time, us per output "
            "token): "
            + "; ".join(
                f"{k} {v:.2f} s, {v / thr['seconds']:.0%}, {v / max(1, thr['tokens']) * 1e6:.1f} us"
                for k, v in sorted(service["cpu"].items(), key=lambda kv: -kv[1])
            )
        )
    errors = thr["errors"] + lat["errors"]
    if errors:
        lines += [f"errors ({len(errors)}): {errors[:3]}"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="a model directory, or qwen3-0.6b / tiny: random weights with the Qwen2 tokenizer "
        "(default: the bundled stories260k)",
    )
    p.add_argument("--device", default="cuda", help="cpu or cuda (default: cuda)")
    p.add_argument("--num-requests", type=int, default=256, help="requests of the throughput case (default: 256)")
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt and output (default: 100)")
    p.add_argument("--max-input-len", type=int, default=1024, help="longest prompt (default: 1024)")
    p.add_argument("--max-output-len", type=int, default=1024, help="longest output (default: 1024)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature of the workload (default: 0.6)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--clients", type=int, default=4, help="client processes of the throughput case (default: 4)")
    p.add_argument(
        "--latency-streams", type=int, default=8, help="streams at a time in the latency-bound case (default: 8)"
    )
    p.add_argument("--latency-requests", type=int, default=32, help="requests of the latency-bound case (default: 32)")
    p.add_argument("--parity-prompts", type=int, default=8, help="greedy prompts compared with embedded (default: 8)")
    p.add_argument("--parity-tokens", type=int, default=64, help="tokens per greedy prompt (default: 64)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step, both paths (default: 256)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=16384, help="tokens per step, both paths (default: 16384)"
    )
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="device KV blocks, both paths (default: measured)")
    p.add_argument("--no-embedded", action="store_true", help="skip the embedded reference")
    p.add_argument(
        "--null-model",
        type=float,
        default=None,
        metavar="MS",
        help="no model: a null model service (bench/null_model.py) answering after MS of emulated device time a "
        "step, on both paths (no weights are built; no parity check): the scheduler's own cost",
    )
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for serve all (default: 900)")
    p.add_argument(
        "--py-spy",
        default=None,
        metavar="DIR",
        help="sample the server's processes during the throughput case into DIR",
    )
    p.add_argument("--out", default=None, help="also write the result as markdown to this file")
    args = p.parse_args()
    if args.null_model is not None:
        args.device = "cpu"  # nothing runs on a device
    model_dir, tmp = prepare_model(args.model, weights=args.null_model is None)
    try:
        vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
        jobs = make_jobs(
            args.num_requests, args.min_len, args.max_input_len, args.max_output_len, vocab, args.seed, args.temperature
        )
        warm = make_jobs(
            min(32, args.num_requests), args.min_len, args.max_input_len, 16, vocab, args.seed + 1, args.temperature
        )
        parity = [
            Job(j.index, j.prompt, args.parity_tokens, 0.0, True)
            for j in make_jobs(
                args.parity_prompts, args.min_len, args.max_input_len, args.min_len, vocab, args.seed + 2, 0.0
            )
            if args.null_model is None
        ]
        latency = [
            Job(j.index, j.prompt, min(j.max_tokens, 256), j.temperature)
            for j in make_jobs(
                args.latency_requests,
                args.min_len,
                args.max_input_len,
                args.max_output_len,
                vocab,
                args.seed + 3,
                args.temperature,
            )
        ]
        cases = {"warm": warm, "jobs": jobs, "parity": parity, "latency": latency}
        embedded = None if args.no_embedded else run_embedded(model_dir, args, cases)
        if embedded:
            embedded["latency"] = summarize(embedded["latency"])
            print(f"embedded: {embedded['tokens'] / embedded['seconds']:,.0f} tok/s", file=sys.stderr)
        server, address = start_server(model_dir, args)
        try:
            service = run_service(address, server, args, warm, jobs, latency, parity)
        finally:
            stop_server(server)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, jobs, embedded, service)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(f"# The service as users call it vs embedded (bench/serve.py)\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
