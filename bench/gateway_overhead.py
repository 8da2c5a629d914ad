"""The HTTP gateway's own latency: time to first token through the gateway's streamed
`/v1/completions` against `Generate` straight to the scheduler, with a stand-in scheduler that
answers at once, so that the difference is the gateway's (its HTTP parsing and validation,
the gRPC call it makes, the SSE event) plus the HTTP client's, and no model time.

    python bench/gateway_overhead.py [--requests 400] [--prompt-len 512] [--out FILE]

Three processes: the stand-in scheduler (grpc.aio: GetModelInfo, and Generate streaming
`--tokens` messages of one token each), one gateway (http_svc.app under uvicorn, as `serve
http` runs it, one worker) and the client (bench.serve_clients: one request at a time, each
path in turn, a warm-up first).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import Job, run_clients, summarize  # noqa: E402

BUNDLED = Path(__file__).resolve().parent.parent / "model_svc" / "bundled" / "stories260k"
MODEL = "stories260k"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scheduler(port: int, tokens: int) -> None:
    import grpc

    from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
    from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

    class Instant(pb_grpc.SchedulerServiceServicer):
        async def GetModelInfo(self, request, context):
            return pb.GetModelInfoResponse(model=f"/models/{MODEL}", vocab_size=512, max_model_len=4096)

        async def Generate(self, request, context):
            for i in range(tokens):
                last = i == tokens - 1
                yield pb.GenerateResponse(
                    request_id=request.request_id,
                    token_ids=[100 + i],
                    text=" a",
                    finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                    usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=i + 1) if last else None,
                )

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_SchedulerServiceServicer_to_server(Instant(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _gateway(port: int, scheduler_port: int) -> None:
    import uvicorn

    from http_svc.app import create_app
    from http_svc.backend import SchedulerBackend

    async def main() -> None:
        backend = SchedulerBackend(f"127.0.0.1:{scheduler_port}", None, str(BUNDLED))
        app = create_app(backend, None, 16 << 20)
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="off")
        await backend.start()
        await backend.wait_ready()
        await uvicorn.Server(config).serve()

    asyncio.run(main())


def _wait_http(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the gateway at {url} did not come up")


def measure(args: argparse.Namespace) -> dict[str, dict]:
    ctx = mp.get_context("spawn")
    sched_port, http_port = _free_port(), _free_port()
    procs = [
        ctx.Process(target=_scheduler, args=(sched_port, args.tokens), daemon=True),
        ctx.Process(target=_gateway, args=(http_port, sched_port), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        url = f"http://127.0.0.1:{http_port}"
        _wait_http(url)
        targets = {"grpc": f"127.0.0.1:{sched_port}", "http": f"{url}/{MODEL}"}
        jobs = [
            Job(i, [5 + (i + j) % 400 for j in range(args.prompt_len)], args.tokens, 0.0) for i in range(args.requests)
        ]
        for target in targets.values():
            run_clients(target, jobs[:20], 1, sequential=True)  # warm-up
        runs: dict[str, list[dict]] = {k: [] for k in targets}
        for _ in range(args.repeats):
            for kind, target in targets.items():
                runs[kind].append(summarize(run_clients(target, jobs, 1, sequential=True)))
        return {kind: sorted(r, key=lambda s: s["ttft_p50"])[len(r) // 2] for kind, r in runs.items()}
    finally:
        for p in procs:
            p.terminate()
            p.join(10)


def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [
        f"{args.requests} requests one at a time, prompt {args.prompt_len} token ids, {args.tokens} one-token "
        f"messages each, against a scheduler that answers at once; median of {args.repeats} alternating runs.",
        "",
        "| path | TTFT p50 (ms) | TTFT p99 (ms) | inter-token p50 (ms) | errors |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for kind, s in results.items():
        lines.append(
            f"| {kind} | {s['ttft_p50'] * 1e3:.3f} | {s['ttft_p99'] * 1e3:.3f} | {s['itl_p50'] * 1e3:.3f} "
            f"| {len(s['errors'])} |"
        )
    overhead = (results["http"]["ttft_p50"] - results["grpc"]["ttft_p50"]) * 1e3
    lines += ["", f"gateway TTFT p50 overhead: {overhead:+.3f} ms"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=4, help="messages per request (default: 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    text = report(measure(args), args)
    print(text)
    if args.out:
        from bench.common import environment, write_result

        write_result(args.out, "HTTP gateway latency against an instant scheduler", environment(), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
