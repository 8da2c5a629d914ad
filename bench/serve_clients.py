"""The client side of bench/serve.py: processes that drive the scheduler's public `Generate`
with grpc.aio streams and record when every message came and what it carried.

No torch here: each client process imports grpc and the generated protos (or httpx, for the
HTTP gateway) only, so that N of them start fast and take no memory the server could use.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Job:
    index: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    keep_ids: bool = False  # send the generated ids back (parity checks)


@dataclass(slots=True)
class Record:
    """One streamed request as the client saw it (monotonic clock: comparable across the
    processes of one host)."""

    index: int
    start: float
    arrivals: list[float] = field(default_factory=list)  # one per message that carried tokens
    counts: list[int] = field(default_factory=list)  # tokens in each of those messages
    completion_tokens: int = -1  # the final message's usage
    finish_reason: int = 0
    token_ids: list[int] | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.counts)


async def _one(stub, pb, job: Job, timeout: float) -> Record:
    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=job.temperature, max_tokens=job.max_tokens, ignore_eos=True)
    )
    request.token_ids.ids.extend(job.prompt)
    record = Record(job.index, time.monotonic(), token_ids=[] if job.keep_ids else None)
    try:
        async for message in stub.Generate(request, timeout=timeout):
            if message.token_ids:
                record.arrivals.append(time.monotonic())
                record.counts.append(len(message.token_ids))
                if record.token_ids is not None:
                    record.token_ids.extend(message.token_ids)
            if message.finish_reason:
                record.finish_reason = message.finish_reason
                record.completion_tokens = message.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - reported in the result, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


def completion_body(model: str, job: Job, include_usage: bool) -> dict:
    """The streamed `/v1/completions` request of a job (token-id prompt, ignore_eos)."""
    body = {
        "model": model,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": job.temperature,
        "ignore_eos": True,
        "stream": True,
    }
    return {**body, "stream_options": {"include_usage": True}} if include_usage else body


async def _one_http(client, model: str, job: Job, timeout: float) -> Record:
    """One streamed `/v1/completions` (token-id prompt): a message is an SSE chunk with text;
    its token count is not on the wire, so each counts one and the total is the usage's."""
    body = completion_body(model, job, include_usage=True)
    record = Record(job.index, time.monotonic())
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    record.arrivals.append(time.monotonic())
                    record.counts.append(1)
                if chunk.get("usage"):
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
        if record.counts and record.completion_tokens > 0:
            record.counts[-1] += record.completion_tokens - len(record.counts)
    except Exception as exc:  # noqa: BLE001 - reported in the result, the run goes on
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    return record


async def _gather(one, jobs: list[Job], concurrency: int, sequential: bool) -> list[Record]:
    if sequential:
        return [await one(job) for job in jobs]
    limit = asyncio.Semaphore(concurrency)

    async def bounded(job: Job) -> Record:
        async with limit:
            return await one(job)

    return list(await asyncio.gather(*(bounded(job) for job in jobs)))


async def _drive(
    address: str, jobs: list[Job], concurrency: int, sequential: bool, barrier, timeout: float
) -> list[Record]:
    """address: a scheduler's host:port (gRPC `Generate`), or `http://host:port/MODEL` (the
    OpenAI-compatible gateway's streamed completions for MODEL)."""
    if address.startswith("http://"):
        import httpx

        base, _, model = address.rpartition("/")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=base, limits=limits, trust_env=False) as client:
            if barrier is not None:
                barrier.wait(120)
            return await _gather(lambda job: _one_http(client, model, job, timeout), jobs, concurrency, sequential)
    import grpc

    from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
    from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        stub = pb_grpc.SchedulerServiceStub(channel)
        if barrier is not None:  # every client connected: start together
            barrier.wait(120)
        return await _gather(lambda job: _one(stub, pb, job, timeout), jobs, concurrency, sequential)


def client_main(
    address: str, jobs: list[Job], concurrency: int, sequential: bool, barrier, conn, timeout: float
) -> None:
    """Entry point of one client process: the records go back through `conn`."""
    try:
        conn.send(asyncio.run(_drive(address, jobs, concurrency, sequential, barrier, timeout)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        if barrier is not None:
            barrier.abort()  # the parent stops waiting for this client at once
        conn.send(f"client failed: {type(exc).__name__}: {exc}")
    finally:
        conn.close()


def run_clients(
    address: str,
    jobs: list[Job],
    num_clients: int,
    concurrency: int | None = None,
    sequential: bool = False,
    timeout: float = 3600.0,
) -> list[Record]:
    """Spread `jobs` round-robin over `num_clients` processes that start streaming together;
    `concurrency`: streams in flight per process at most (None: all of its jobs at once)."""
    ctx = mp.get_context("spawn")
    num_clients = max(1, min(num_clients, len(jobs)))
    barrier = ctx.Barrier(num_clients + 1)
    procs, conns = [], []
    for i in range(num_clients):
        mine = jobs[i::num_clients]
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=client_main,
            args=(address, mine, concurrency or len(mine), sequential, barrier, child, timeout),
            daemon=True,
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    try:
        barrier.wait(180)  # all connected
    except threading.BrokenBarrierError:
        raise RuntimeError("; ".join(str(c.recv()) for c in conns if c.poll(5)) or "a client did not start") from None
    records: list[Record] = []
    for conn in conns:
        got = conn.recv()
        if isinstance(got, str):
            raise RuntimeError(got)
        records += got
    for p in procs:
        p.join(30)
    return sorted(records, key=lambda r: r.index)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(records: list[Record]) -> dict:
    """Throughput over the window from the first request sent to the last message, TTFT, the
    time per output token between messages (a message of k tokens after a gap g counts k
    times g / k) and tokens per message."""
    errors = [r.error for r in records if r.error]
    done = [r for r in records if r.arrivals]
    start = min(r.start for r in records)
    end = max(r.arrivals[-1] for r in done) if done else start
    tokens = sum(r.tokens for r in records)
    ttft = [r.arrivals[0] - r.start for r in done]
    itl: list[float] = []
    for r in done:
        for prev, now, k in zip(r.arrivals, r.arrivals[1:], r.counts[1:]):
            itl += [(now - prev) / k] * k
    messages = sum(len(r.counts) for r in records)
    return {
        "requests": len(records),
        "tokens": tokens,
        "seconds": end - start,
        "tok_s": tokens / (end - start) if end > start else 0.0,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
        "tokens_per_message": tokens / messages if messages else 0.0,
        "max_tokens_per_message": max((max(r.counts) for r in done), default=0),
        "errors": errors,
        "usage_mismatch": sum(1 for r in records if r.completion_tokens != r.tokens),
    }
