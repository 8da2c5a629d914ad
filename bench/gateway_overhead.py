"""The HTTP gateway's own latency: time to first token through the gateway's streamed
`/v1/completions` against `Generate` straight to the scheduler, with a stand-in scheduler that
answers at once, so that the difference is the gateway's (its HTTP parsing and validation,
the gRPC call it makes, the SSE event) plus the HTTP client's, and no model time.

    python bench/gateway_overhead.py [--requests 400] [--prompt-len 512] [--out FILE]

Three processes: the stand-in scheduler (grpc.aio: GetModelInfo, and Generate streaming
`--tokens` messages of one token each), one gateway (http_svc.app under uvicorn, as `serve
http` runs it, one worker) and the client, one request at a time, each path in turn after a
warm-up: gRPC and httpx through bench.serve_clients, and HTTP/1.1 written by hand (the
gateway's share without a client library's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_clients import Job, Record, completion_body, run_clients, summarize  # noqa: E402
from contracts.rpc import free_port  # noqa: E402

BUNDLED = Path(__file__).resolve().parent.parent / "model_svc" / "bundled" / "stories260k"
MODEL = "stories260k"


def _scheduler(port: int, tokens: int) -> None:
    import grpc

    from contracts.generate_stream import generate_stream
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

        async def GenerateStream(self, request_iterator, context):  # the gateway's requests
            async for answer in generate_stream(self.Generate, request_iterator):
                yield answer

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


async def _raw_one(reader, writer, port: int, model: str, job: Job) -> Record:
    """One streamed completion over a kept-alive connection, HTTP/1.1 written and read by hand
    (chunked SSE): the gateway's cost without an HTTP client library's."""
    record = Record(job.index, time.monotonic())
    body = json.dumps(completion_body(model, job, include_usage=False)).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    status = await reader.readline()
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # the headers
    if b" 200 " not in status:
        record.error = status.decode().strip()
        return record
    while True:
        line = await reader.readline()
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            record.arrivals.append(time.monotonic())
            record.counts.append(1)
    while (await reader.readline()) != b"0\r\n":  # the last chunk, then its blank line
        pass
    await reader.readline()
    record.completion_tokens = len(record.counts)
    return record


def _raw_client(port: int, model: str, jobs: list[Job], conn) -> None:
    async def main() -> list[Record]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return [await _raw_one(reader, writer, port, model, job) for job in jobs]
        finally:
            writer.close()

    conn.send(asyncio.run(main()))
    conn.close()


def run_raw(port: int, jobs: list[Job], model: str = MODEL) -> list[Record]:
    """`jobs` one at a time from one client process, HTTP/1.1 by hand (streamed completions)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_raw_client, args=(port, model, jobs, child), daemon=True)
    p.start()
    records = parent.recv()
    p.join(30)
    return records


def measure(args: argparse.Namespace) -> dict[str, dict]:
    ctx = mp.get_context("spawn")
    sched_port, http_port = free_port(), free_port()
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
        run_raw(http_port, jobs[:20])
        runs: dict[str, list[dict]] = {k: [] for k in [*targets, "http-raw"]}
        for _ in range(args.repeats):
            for kind, target in targets.items():
                runs[kind].append(summarize(run_clients(target, jobs, 1, sequential=True)))
            runs["http-raw"].append(summarize(run_raw(http_port, jobs)))
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
    grpc_ttft = results["grpc"]["ttft_p50"]
    lines += [
        "",
        "http: httpx (bench.serve_clients, as bench/http_vs_grpc.py); http-raw: HTTP/1.1 by hand on one "
        "kept-alive connection, so the gateway's share without the client library's.",
        "",
        f"TTFT p50 over gRPC: http {(results['http']['ttft_p50'] - grpc_ttft) * 1e3:+.3f} ms, "
        f"http-raw {(results['http-raw']['ttft_p50'] - grpc_ttft) * 1e3:+.3f} ms",
    ]
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
