"""The gateway's requests to the scheduler on one GenerateStream call.

A call per request costs grpc.aio's set-up and teardown on both sides before the first token;
on one open stream a request is one message (bench/NOTES.md, "The gateway's TTFT at low
load"). Requests go out as they come; a reader hands each answer to its request's queue. A
request ends with the scheduler's end message: OK, or the status its own Generate call would
have ended with, raised here as that call's grpc.RpcError, so the gateway's error mapping
(http_svc.errors.from_rpc) is the same either way. Leaving a request early drops it (the
scheduler aborts it). When the stream breaks (the scheduler restarted, the network), every
open request gets the stream's error and the next request opens a new stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _status(code: grpc.StatusCode, details: str) -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class Multiplexer:
    def __init__(self, stub: Any, metadata: Any) -> None:
        self._queues: dict[str, asyncio.Queue] = {}
        self._outgoing: asyncio.Queue[pb.GenerateStreamRequest] = asyncio.Queue()
        self._call = stub.GenerateStream(self._requests(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())
        self.broken = False

    async def _requests(self) -> AsyncIterator[pb.GenerateStreamRequest]:
        while True:
            yield await self._outgoing.get()

    async def _read(self) -> None:
        error: grpc.RpcError
        try:
            async for answer in self._call:
                for message in answer.responses:
                    queue = self._queues.get(message.request_id)
                    if queue is not None:
                        queue.put_nowait(message)
                for end in answer.ends:
                    queue = self._queues.pop(end.request_id, None)
                    if queue is not None:
                        queue.put_nowait(end)
            error = _status(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the stream")
        except grpc.RpcError as err:
            error = err
        self.broken = True
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The scheduler's messages for one request, as its own Generate call would give them."""
        if self.broken:  # a stream that broke after this request was handed to it
            raise _status(grpc.StatusCode.UNAVAILABLE, "the stream to the scheduler broke")
        request_id = request.request_id
        if request_id in self._queues:  # the gateway's ids are unique; this would orphan the first
            raise _status(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._outgoing.put_nowait(pb.GenerateStreamRequest(generate=request))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, pb.GenerateResponse):
                    yield item
                elif isinstance(item, pb.StreamEnd):
                    if item.code:
                        raise _status(_CODES.get(item.code, grpc.StatusCode.UNKNOWN), item.message)
                    return
                else:
                    raise item
        finally:
            if self._queues.pop(request_id, None) is not None and not self.broken:  # left before its end
                self._outgoing.put_nowait(pb.GenerateStreamRequest(abort=pb.AbortRequest(request_id=request_id)))

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
