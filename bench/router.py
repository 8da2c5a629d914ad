"""Two replicas behind the router vs round-robin vs one engine, on a multi-tenant workload.

    python bench/router.py --model qwen3-0.6b --device cuda --out bench/results/router_h200.md
    python bench/router.py --device cpu --tenants 4 --per-tenant 4 --prefix-tokens 64 --num-gpu-blocks 64

The workload (seeded): `--tenants` system prompts of `--prefix-tokens` token ids each, and
`--per-tenant` requests per tenant, each its tenant's system prompt and a suffix of its
own, shuffled, sent `--concurrency` at a time, greedy, ignore_eos, `--max-tokens` out.

Cases, each after a short warm-up and on fresh caches (a cache salt of its own):
- one engine: `serve all` with the whole KV pool (`--num-gpu-blocks`)
- router: two replicas, each `serve all` with half the pool (both on the one device),
  publishing their prefix index to a redis-server this script starts, behind
  `serve router --policy prefix`
- round-robin: the same two replicas behind `serve router --policy round_robin`
Per case: the prefix-cache hit rate (cached / prompt tokens, from the usage the server
reports), output tokens/s over the run, TTFT p50 and p99, and how many greedy outputs equal
the one engine's (all of them in fp32 on the CPU; in bf16 on a GPU a request batched with
others than in the one engine's run may take another token where two are near-equal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serve import prepare_model  # noqa: E402
from bench.serve_clients import percentile  # noqa: E402
from contracts.rpc import free_port  # noqa: E402


# ----------------------------------------------------------------- workload
def make_workload(
    tenants: int, per_tenant: int, prefix_tokens: int, max_suffix: int, vocab: int, seed: int
) -> list[tuple[int, list[int]]]:
    """(tenant, prompt token ids), shuffled: each tenant's system prompt, then 8 to max_suffix
    tokens of the request's own."""
    rng = random.Random(seed)
    top = min(vocab, 10000)  # as bench/serve.py: ids well inside the vocabulary
    systems = [[rng.randrange(top) for _ in range(prefix_tokens)] for _ in range(tenants)]
    work = [
        (t, systems[t] + [rng.randrange(top) for _ in range(rng.randint(min(8, max_suffix), max_suffix))])
        for t in range(tenants)
        for _ in range(per_tenant)
    ]
    rng.shuffle(work)
    return work


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it (time.monotonic())."""

    index: int
    tenant: int
    start: float = 0.0
    first: float | None = None  # the first message that carried tokens
    end: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    messages: int = 0
    error: str | None = None  # the status code's name


async def _one(stub, pb, index: int, tenant: int, prompt: list[int], max_tokens: int, salt: str, timeout: float):
    import grpc

    request = pb.GenerateRequest(
        cache_salt=salt, sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    )
    request.token_ids.ids.extend(prompt)
    out = Outcome(index, tenant, time.monotonic())
    try:
        async for message in stub.Generate(request, timeout=timeout):
            out.messages += 1
            if message.token_ids and out.first is None:
                out.first = time.monotonic()
            out.token_ids.extend(message.token_ids)
            if message.finish_reason:
                out.prompt_tokens, out.cached_tokens = message.usage.prompt_tokens, message.usage.cached_tokens
    except grpc.RpcError as err:
        out.error = err.code().name
    out.end = time.monotonic()
    return out


def run_workload(
    address: str,
    work: list[tuple[int, list[int]]],
    concurrency: int,
    max_tokens: int,
    salt: str = "",
    timeout: float = 300.0,
    outcomes: list[Outcome] | None = None,
) -> tuple[list[Outcome], float]:
    """Every request of `work`, `concurrency` at a time, over one channel; (outcomes in the
    workload's order, seconds from the first sent to the last done). `outcomes`: appended to
    as requests end (a caller watching the run from another thread)."""
    import grpc

    from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
    from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

    done = outcomes if outcomes is not None else []

    async def main() -> float:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.SchedulerServiceStub(channel)
            gate = asyncio.Semaphore(concurrency)

            async def gated(i: int, tenant: int, prompt: list[int]) -> None:
                async with gate:
                    done.append(await _one(stub, pb, i, tenant, prompt, max_tokens, salt, timeout))

            start = time.monotonic()
            await asyncio.gather(*(gated(i, t, p) for i, (t, p) in enumerate(work)))
            return time.monotonic() - start

    elapsed = asyncio.run(main())
    return sorted(done, key=lambda o: o.index), elapsed


def summarize(outcomes: list[Outcome], elapsed: float) -> dict:
    ok = [o for o in outcomes if o.error is None]
    prompt = sum(o.prompt_tokens for o in ok)
    ttfts = [o.first - o.start for o in ok if o.first is not None]
    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "out_tok_s": sum(len(o.token_ids) for o in ok) / elapsed if elapsed else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "seconds": elapsed,
    }


# ----------------------------------------------------------------- the fleet
def group_args(name: str, blocks: int, device: str, model: str | None = None, publish: bool = True) -> list[str]:
    """`serve all` arguments of one replica group on free loopback ports (no gateway, no
    metrics); its scheduler's address is the value after --scheduler-addr."""
    args = ["--scheduler-addr", f"127.0.0.1:{free_port()}", "--kvcache-addr", f"127.0.0.1:{free_port()}"]
    args += ["--model-addr", f"127.0.0.1:{free_port()}", "--metrics-port", "0", "--port", "0"]
    args += ["--device", device, "--num-gpu-blocks", str(blocks), "--num-cpu-blocks", "16", "--deployment", name]
    args += ["--drain-timeout", "5"] + (["--model", model] if model else [])
    if device == "cpu":
        args += ["--torch-threads", "1"]
    return args + (["--publish-prefixes"] if publish else [])


def scheduler_address(args: list[str]) -> str:
    return args[args.index("--scheduler-addr") + 1]


def router_args(replicas: list[str], policy: str, model: str | None = None) -> list[str]:
    """`serve router` arguments on a free loopback port, its metrics on another."""
    args = ["--router-addr", f"127.0.0.1:{free_port()}", "--router-metrics-port", str(free_port())]
    args += ["--policy", policy] + [a for r in replicas for a in ("--replica", r)]
    return args + (["--model", model] if model else [])


def serve_env(redis_url: str | None) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PICOVLLM_INTERNAL_TOKEN": secrets.token_urlsafe(32),
    }
    env.pop("PICOVLLM_API_KEY", None)
    if redis_url:
        env["PICOVLLM_REDIS_URL"] = redis_url
    return env


def spawn(kind: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "scheduler_svc.cli", "serve", kind, *args],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_serving(address: str, procs: list[subprocess.Popen], timeout: float) -> None:
    from contracts.health import check_health

    deadline = time.monotonic() + timeout
    while not check_health(address, timeout=1.0):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise SystemExit(f"{address} did not start (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.3)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_redis(log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log_dir / "redis.log", "w") as out:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log_dir,
        )
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


# ----------------------------------------------------------------- the run
def run_cases(args: argparse.Namespace, model_dir: str, log_dir: Path) -> dict:
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    work = make_workload(args.tenants, args.per_tenant, args.prefix_tokens, args.max_suffix, vocab, args.seed)
    redis, url = start_redis(log_dir)
    procs: list[subprocess.Popen] = []
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    try:
        single = group_args("single", args.num_gpu_blocks, args.device, model_dir, publish=False)
        halves = [group_args(f"replica{i}", args.num_gpu_blocks // 2, args.device, model_dir) for i in range(2)]
        for i, g in enumerate([single, *halves]):
            procs.append(spawn("all", g, serve_env(url), log_dir / f"group{i}.log"))
        replicas = [scheduler_address(g) for g in halves]
        routers = {p: router_args(replicas, p, model_dir) for p in ("prefix", "round_robin")}
        for policy, r in routers.items():
            procs.append(spawn("router", r, serve_env(url), log_dir / f"router-{policy}.log"))
        for address in [scheduler_address(single), *replicas]:
            wait_serving(address, procs, args.startup_timeout)
        for r in routers.values():
            wait_serving(r[1], procs, args.startup_timeout)
        time.sleep(2.0)  # the routers have polled every replica
        cases = {"one engine": scheduler_address(single), **{f"router ({p})": r[1] for p, r in routers.items()}}
        warm = make_workload(2, args.concurrency, 16, 16, vocab, args.seed + 1)
        for name, address in cases.items():
            run_workload(address, warm, args.concurrency, 4, salt=f"warm {name}")  # warm-up, not timed
            outcomes, elapsed = run_workload(address, work, args.concurrency, args.max_tokens, salt=name)
            results[name] = summarize(outcomes, elapsed)
            outputs[name] = [o.token_ids for o in outcomes]
            print(f"{name}: {results[name]}", file=sys.stderr)
    finally:
        stop(procs)
        redis.kill()
        redis.wait()
    for name in results:
        results[name]["greedy_equal"] = sum(a == b for a, b in zip(outputs[name], outputs["one engine"]))
    return results


def report(args: argparse.Namespace, results: dict) -> str:
    lines = [
        f"Workload: {args.tenants} tenants x {args.per_tenant} requests, system prompts of {args.prefix_tokens} "
        f"tokens, suffixes of 8 to {args.max_suffix}, {args.max_tokens} output tokens, {args.concurrency} at a "
        f"time (seed {args.seed}); one engine with {args.num_gpu_blocks} KV blocks, each replica "
        f"{args.num_gpu_blocks // 2}.",
        "",
        "| case | prefix hit rate | output tok/s | TTFT p50 ms | TTFT p99 ms | errors | outputs = one engine's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, s in results.items():
        lines.append(
            f"| {name} | {s['hit_rate']:.1%} | {s['out_tok_s']:.0f} | {s['ttft_p50_ms']:.0f} | "
            f"{s['ttft_p99_ms']:.0f} | {s['errors']} | {s['greedy_equal']}/{s['requests']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory, or qwen3-0.6b / tiny (default: stories260k)")
    p.add_argument("--device", default="cuda", help="cpu or cuda (default: cuda)")
    p.add_argument("--tenants", type=int, default=64, help="distinct system prompts (default: 64)")
    p.add_argument("--per-tenant", type=int, default=16, help="requests per tenant (default: 16)")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="tokens of each system prompt (default: 2048)")
    p.add_argument("--max-suffix", type=int, default=64, help="most tokens of a request's own (default: 64)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (default: 64)")
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=10240,
        help="KV blocks of the one engine; each replica gets half (default: 10240)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for a service (default: 900)")
    p.add_argument("--out", default=None, help="also write the result as markdown to this file")
    args = p.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed (the replicas publish their prefix index to it)")
    model_dir, tmp = prepare_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="picovllm-router-bench-"))
    try:
        results = run_cases(args, model_dir, log_dir)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    body = report(args, results)
    print(body)
    if args.out:
        from bench.common import environment, write_result

        write_result(args.out, "Replicas behind the router (bench/router.py)", environment(), body)
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
