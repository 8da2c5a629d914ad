"""The HTTP gateway's cost: the same streamed greedy workload through the scheduler's gRPC
`Generate` and through the OpenAI-compatible `/v1/completions` (stream: true) of the same
`picovllm serve all`.

    python bench/http_vs_grpc.py --model path/to/Qwen3-0.6B --device cuda --out bench/results/http_vs_grpc_h200.md
    python bench/http_vs_grpc.py --device cpu --num-requests 64 --concurrency 16 --max-tokens 32   # bundled

Every request has a token-id prompt (the same ids on both paths, so no tokenization differs)
and ignores EOS, so both paths generate the same number of tokens. Runs alternate gRPC and
HTTP (`--repeats` each, after a warm-up) and the median run of each is reported: output
tokens/s, time to the first streamed text, and the time between streamed messages. Needs the
`openai` package (the test extra) for the HTTP side; `--grpc-addr` with `--http-url` measures
an already running server instead of starting one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import free_port, prepare_model  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def make_workload(num: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num)]


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
        str(args.prompt_len + args.max_tokens + 16),
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


class Timing:
    """One request: when it started, when each message with output came."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.arrivals: list[float] = []
        self.tokens = 0

    def ttft(self) -> float | None:
        return self.arrivals[0] - self.start if self.arrivals else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


async def grpc_one(stub, prompt: list[int], max_tokens: int) -> Timing:
    from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb

    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    request.token_ids.ids.extend(prompt)
    timing = Timing()
    async for message in stub.Generate(request):
        if message.token_ids:
            timing.arrivals.append(time.perf_counter())
            timing.tokens += len(message.token_ids)
    return timing


async def http_one(client, model: str, prompt: list[int], max_tokens: int) -> Timing:
    timing = Timing()
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            timing.arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
    return timing


async def run_once(
    kind: str, grpc_addr: str, url: str, model: str, prompts: list[list[int]], args: argparse.Namespace
) -> dict:
    import grpc
    import openai

    from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

    limit = asyncio.Semaphore(args.concurrency)
    async with grpc.aio.insecure_channel(grpc_addr) as channel:
        stub = pb_grpc.SchedulerServiceStub(channel)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)

        async def one(prompt: list[int]) -> Timing:
            async with limit:
                if kind == "grpc":
                    return await grpc_one(stub, prompt, args.max_tokens)
                return await http_one(client, model, prompt, args.max_tokens)

        start = time.perf_counter()
        timings = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
        await client.close()
    gaps = [g for t in timings for g in t.gaps()]
    ttfts = [t.ttft() for t in timings if t.ttft() is not None]
    return {
        "kind": kind,
        "seconds": seconds,
        "tokens": sum(t.tokens for t in timings),
        "tok_s": sum(t.tokens for t in timings) / seconds,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "gap_p50": percentile(gaps, 50),
        "gap_p99": percentile(gaps, 99),
    }


async def measure(grpc_addr: str, url: str, args: argparse.Namespace) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    info = (await client.models.list()).data[0]
    await client.close()
    prompts = make_workload(args.num_requests, args.prompt_len, args.vocab)
    warm = prompts[: max(1, args.concurrency // 4)]
    for kind in ("grpc", "http"):
        await run_once(kind, grpc_addr, url, info.id, warm, args)
    runs: dict[str, list[dict]] = {"grpc": [], "http": []}
    for _ in range(args.repeats):
        for kind in ("grpc", "http"):
            runs[kind].append(await run_once(kind, grpc_addr, url, info.id, prompts, args))
            print(f"{kind}: {runs[kind][-1]['tok_s']:.1f} tok/s", file=sys.stderr)
    return [sorted(r, key=lambda x: x["seconds"])[len(r) // 2] for r in runs.values()]


def report(results: list[dict], args: argparse.Namespace) -> str:
    grpc_run, http_run = results
    lines = [
        f"Workload: {args.num_requests} requests, {args.concurrency} at a time, {args.prompt_len}-token prompts, "
        f"{args.max_tokens} tokens each (greedy, ignore_eos); median of {args.repeats} alternating runs.",
        "",
        "| path | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | between messages p50 (ms) | p99 (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['kind']} | {r['tok_s']:.1f} | {r['ttft_p50'] * 1e3:.2f} | {r['ttft_p99'] * 1e3:.2f} | "
            f"{r['gap_p50'] * 1e3:.3f} | {r['gap_p99'] * 1e3:.3f} |"
        )
    lines += ["", f"HTTP throughput / gRPC throughput: {100 * http_run['tok_s'] / grpc_run['tok_s']:.1f} %"]
    return "\n".join(lines)


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
    p.add_argument("--num-requests", type=int, default=512, help="requests per run (default: 512)")
    p.add_argument("--concurrency", type=int, default=128, help="requests in flight at once (default: 128)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per request (default: 256)")
    p.add_argument(
        "--vocab", type=int, default=500, help="prompt ids are drawn from [3, VOCAB) (default: 500, fits every model)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs of each path (default: 3)")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for serve all (default: 900)")
    p.add_argument("--grpc-addr", default=None, help="a running scheduler's address (with --http-url): start nothing")
    p.add_argument("--http-url", default=None, help="a running gateway's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args()
    args.model, tmp = prepare_model(args.model)
    proc = None
    if args.grpc_addr and args.http_url:
        grpc_addr, url = args.grpc_addr, args.http_url
    else:
        proc, grpc_addr, url = start_server(args)
    try:
        text = report(asyncio.run(measure(grpc_addr, url, args)), args)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(text)
    if args.out:
        Path(args.out).write_text(
            f"# HTTP gateway vs gRPC\n\nDate: {time.strftime('%Y-%m-%d')}. Command: "
            f"`python bench/http_vs_grpc.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
