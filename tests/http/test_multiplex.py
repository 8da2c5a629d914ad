"""GenerateStream end to end in one process: the gateway's Multiplexer (http_svc.multiplex)
against a grpc.aio server whose GenerateStream is contracts.generate_stream over a stand-in
Generate. Each request gets its own messages in order and its own end (OK, or the status its
Generate raised), a request left early is dropped on the server, a bad request id ends only
that request, and a stream that breaks fails its open requests with UNAVAILABLE."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from contracts.errors import QueueFull
from contracts.generate_stream import generate_stream
from http_svc.multiplex import Multiplexer
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from tests.services.conftest import free_port


class StandIn(pb_grpc.SchedulerServiceServicer):
    """Generate: `max_tokens` one-token messages (the prompt's ids), QueueFull for a prompt
    [0], a context abort for [1], and for [2] it waits until dropped."""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    async def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        if ids == [0]:
            raise QueueFull("8 requests are already waiting")
        if ids == [1]:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        try:
            if ids == [2]:
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[2])
                await asyncio.Event().wait()
            for i in range(request.sampling.max_tokens):
                await asyncio.sleep(0)
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[ids[i % len(ids)]])
        except asyncio.CancelledError:
            self.dropped.append(request.request_id)
            raise

    async def GenerateStream(self, request_iterator, context):
        async for answer in generate_stream(self.Generate, request_iterator):
            yield answer


def request(request_id: str, ids: list[int], max_tokens: int = 3) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id, token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=max_tokens)
    )


async def collect(mux: Multiplexer, req: pb.GenerateRequest) -> list[int]:
    return [m.token_ids[0] async for m in mux.generate(req)]


async def serving(servicer: StandIn, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def test_requests_share_one_stream_and_end_each_their_own_way():
    async def run() -> None:
        servicer, port = StandIn(), free_port()
        server = await serving(servicer, port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            mux = Multiplexer(pb_grpc.SchedulerServiceStub(channel), None)
            results = await asyncio.gather(
                collect(mux, request("a", [5, 6, 7], 6)),
                collect(mux, request("b", [9], 2)),
                collect(mux, request("full", [0])),
                collect(mux, request("late", [1])),
                return_exceptions=True,
            )
            assert results[0] == [5, 6, 7, 5, 6, 7] and results[1] == [9, 9]
            assert results[2].code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already waiting" in results[2].details()
            assert results[3].code() == grpc.StatusCode.DEADLINE_EXCEEDED

            stream = mux.generate(request("left", [2]))  # one message, then left early
            assert (await anext(stream)).token_ids[0] == 2
            await stream.aclose()
            for _ in range(100):
                if servicer.dropped:
                    break
                await asyncio.sleep(0.01)
            assert servicer.dropped == ["left"]

            assert await collect(mux, request("after", [3], 1)) == [3]  # the stream goes on
            await mux.close()
        await server.stop(None)

    asyncio.run(run())


def test_a_broken_stream_fails_its_open_requests_and_the_next_stream_serves():
    async def run() -> None:
        port = free_port()
        server = await serving(StandIn(), port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.SchedulerServiceStub(channel)
            mux = Multiplexer(stub, None)
            waiting = mux.generate(request("w", [2]))
            assert (await anext(waiting)).token_ids[0] == 2
            await server.stop(None)  # the scheduler goes away
            with pytest.raises(grpc.RpcError) as err:
                await anext(waiting)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and mux.broken
            with pytest.raises(grpc.RpcError):  # handed to the broken stream: fails at once
                await anext(mux.generate(request("x", [3])))
            server = await serving(StandIn(), port)
            fresh = Multiplexer(stub, None)
            assert await collect(fresh, request("y", [8], 2)) == [8, 8]
            await fresh.close()
            await mux.close()
        await server.stop(None)

    asyncio.run(run())


def test_a_request_id_twice_on_one_stream_ends_the_second_alone():
    """At the scheduler's end (the gateway's ids are unique): the first runs to its end."""

    async def run() -> list[pb.GenerateStreamResponse]:
        servicer = StandIn()

        async def requests():
            yield pb.GenerateStreamRequest(generate=request("twice", [4], 20))
            yield pb.GenerateStreamRequest(generate=request("twice", [4]))
            yield pb.GenerateStreamRequest(generate=request("", [4]))

        return [answer async for answer in generate_stream(servicer.Generate, requests())]

    answers = asyncio.run(run())
    ends = [(e.request_id, grpc.StatusCode.INVALID_ARGUMENT.value[0] == e.code) for a in answers for e in a.ends]
    assert ends == [("twice", True), ("", True), ("twice", False)]
    assert [m.token_ids[0] for a in answers for m in a.responses] == [4] * 20
