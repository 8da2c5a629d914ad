"""The HTTP gateway's cost: the headline workload streamed through the scheduler's gRPC
`Generate` and through the OpenAI-compatible `/v1/completions` (stream: true) of the same
`picovllm serve all`, in one run.

    python bench/http_vs_grpc.py --model qwen3-0.6b --device cuda --out bench/results/http_vs_grpc_h200.md
    python bench/http_vs_grpc.py --device cpu --num-requests 32 --max-input-len 128 --max-output-len 32   # bundled

Cases, each run on both paths, alternating (`--repeats` each after a warm-up; the median run
is reported):
- throughput: nano-vllm's workload (bench/serve.py's, token-id prompts, ignore_eos,
  temperature 0.6), every request at once from `--clients` client processes: output tokens/s.
- low load: `--low-load-requests` requests one at a time: TTFT p50 and p99.
Both paths send the same token ids, so no tokenization differs; the HTTP clients are plain
httpx over SSE (bench/serve_clients.py), so the client's own parsing stays small.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import run_raw  # noqa: E402
from bench.serve import _version, make_jobs, prepare_model  # noqa: E402
from bench.serve_clients import Job, run_clients, summarize  # noqa: E402
from contracts.rpc import free_port  # noqa: E402


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    """`picovllm serve all` on free loopback ports; (process, gRPC address, HTTP URL)."""
    grpc_addr, http_port = f"127.0.0.1:{free_port()}", free_port()
    argv = [
        sys.executable,
        "-m",
        "scheduler_svc.cli",
        "serve",
        "all",
        "--scheduler-addr",
        grpc_addr,
        "--kvcache-addr",
        f"127.0.0.1:{free_port()}",
        "--model-addr",
        f"127.0.0.1:{free_port()}",
        "--metrics-port",
        "0",
        "--port",
        str(http_port),
        "--device",
        args.device,
        "--max-model-len",
        str(args.max_input_len + args.max_output_len + 16),
    ]
    argv += ["--model", args.model] if args.model else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PICOVLLM_INTERNAL_TOKEN": secrets.token_urlsafe(32),
    }
    env.pop("PICOVLLM_API_KEY", None)
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + args.startup_timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve all exited with {proc.returncode}")
        try:
            with opener.open(f"{url}/health", timeout=1) as reply:
                if reply.status == 200:
                    return proc, grpc_addr, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"serve all not ready after {args.startup_timeout} s")


def _served_model(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{url}/v1/models", timeout=10) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def _median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def measure(grpc_addr: str, url: str, args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """{case: {path: the median run's summary}}."""
    targets = {"grpc": grpc_addr, "http": f"{url}/{_served_model(url)}"}
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    jobs = make_jobs(args.num_requests, args.min_len, args.max_input_len, args.max_output_len, vocab, 0, 0.6)
    low = [
        Job(j.index, j.prompt, 16, 0.0)
        for j in make_jobs(args.low_load_requests, args.min_len, args.max_input_len, 16, vocab, 1, 0.0)
    ]
    port, model = int(url.rsplit(":", 1)[1]), targets["http"].rsplit("/", 1)[1]
    for target in targets.values():  # warm-up: graphs, connections, the gateway's first request
        run_clients(target, jobs[: min(32, len(jobs))], 1)
    run_raw(port, low[:4], model)
    runs: dict[str, dict[str, list[dict]]] = {
        "throughput": {k: [] for k in targets},
        "low load": {k: [] for k in [*targets, "http-raw"]},
    }
    for _ in range(args.repeats):
        for kind, target in targets.items():
            if args.throughput:
                runs["throughput"][kind].append(summarize(run_clients(target, jobs, args.clients)))
                print(f"{kind}: {runs['throughput'][kind][-1]['tok_s']:,.0f} tok/s", file=sys.stderr)
            runs["low load"][kind].append(summarize(run_clients(target, low, 1, sequential=True)))
        runs["low load"]["http-raw"].append(summarize(run_raw(port, low, model)))
    return {case: {kind: _median(r) for kind, r in by_kind.items() if r} for case, by_kind in runs.items()}


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> str:
    thr, low = results["throughput"], results["low load"]
    lines = [
        f"Throughput case: {args.num_requests} requests at once from {args.clients} client processes, prompt "
        f"{args.min_len}-{args.max_input_len} tokens, output {args.min_len}-{args.max_output_len} (temperature 0.6, "
        f"ignore_eos). Low load: {args.low_load_requests} requests one at a time, 16 tokens each (greedy). Median of "
        f"{args.repeats} alternating runs.",
        "",
        "| path | output tok/s | output tokens | errors | low load TTFT p50 (ms) | low load TTFT p99 (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in ("grpc", "http", "http-raw"):
        t, lo = thr.get(kind), low[kind]
        tput = f"{t['tok_s']:,.0f} | {t['tokens']}" if t is not None else "- | -"
        errs = len(lo["errors"]) + (len(t["errors"]) if t is not None else 0)
        lines.append(f"| {kind} | {tput} | {errs} | {lo['ttft_p50'] * 1e3:.2f} | {lo['ttft_p99'] * 1e3:.2f} |")
    ratio = f"{thr['http']['tok_s'] / thr['grpc']['tok_s']:.1%}" if thr else "not run (--no-throughput)"
    over = {k: (low[k]["ttft_p50"] - low["grpc"]["ttft_p50"]) * 1e3 for k in ("http", "http-raw")}
    lines += [
        "",
        "http: the httpx client (bench.serve_clients); http-raw: HTTP/1.1 written by hand on one kept-alive "
        "connection (bench.gateway_overhead), the gateway's cost without the client library's.",
        "",
        f"HTTP / gRPC throughput: {ratio}; HTTP TTFT p50 overhead at low load: {over['http-raw']:+.2f} ms "
        f"(http-raw), {over['http']:+.2f} ms (httpx)",
    ]
    errors = [e for case in results.values() for r in case.values() for e in r["errors"]]
    if errors:
        lines.append(f"errors ({len(errors)}): {errors[:3]}")
    return "\n".join(lines)


def _versions() -> str:
    names = ("torch", "triton", "grpcio", "protobuf", "fastapi", "uvicorn")
    return ", ".join(f"{name} {_version(name)}" for name in names)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="a model directory, or qwen3-0.6b / tiny: random weights with the Qwen2 "
        "tokenizer (bench/serve.py) (default: the bundled stories260k)",
    )
    p.add_argument("--device", default="cuda", help="the model service's device (default: cuda)")
    p.add_argument("--num-requests", type=int, default=256, help="requests of the throughput case (default: 256)")
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt and output (default: 100)")
    p.add_argument("--max-input-len", type=int, default=1024, help="longest prompt (default: 1024)")
    p.add_argument("--max-output-len", type=int, default=1024, help="longest output (default: 1024)")
    p.add_argument("--clients", type=int, default=4, help="client processes of the throughput case (default: 4)")
    p.add_argument("--low-load-requests", type=int, default=16, help="requests of the low-load case (default: 16)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each path (default: 3)")
    p.add_argument(
        "--throughput",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the throughput case (--no-throughput: the low-load case alone)",
    )
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for serve all (default: 900)")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args()
    args.model, tmp = prepare_model(args.model)
    proc, grpc_addr, url = start_server(args)
    try:
        text = report(measure(grpc_addr, url, args), args)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(text)
    if args.out:
        command = " ".join(a if not a.startswith("/") else f"bench/results/{Path(a).name}" for a in sys.argv[1:])
        Path(args.out).write_text(
            f"# HTTP gateway vs gRPC, one `serve all` (bench/http_vs_grpc.py)\n\n"
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n- versions: {_versions()}\n"
            f"- command: `python bench/http_vs_grpc.py {command}`\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
