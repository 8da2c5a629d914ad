"""Server-sent events and the life of the scheduler streams behind one HTTP request.

SSE framing: a text/event-stream response, each event one `data: <json>` line and a blank
line, closed by `data: [DONE]`, as OpenAI sends them (no event names, ids, retries or pings:
sse-starlette's extras are not needed). The response (SSEResponse) is Starlette's Response
with a body sent event by event while one watcher task waits for the client's disconnect
and cancels the stream, which is what aborts the request. Starlette's StreamingResponse does
the same under ASGI 2.3 (uvicorn's) through an anyio task group per response, which cost a
tenth of a millisecond before the first event.

A request with several prompts runs one scheduler stream per prompt at once; their messages
are merged in arrival order, each tagged with its choice index. Whatever ends the merge (the
last message, an error, a disconnect) cancels every call still open.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from http_svc.errors import from_rpc
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb

T = TypeVar("T")
Tagged = tuple[int, pb.GenerateResponse]
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def merged(streams: list[AsyncIterator[pb.GenerateResponse]]) -> AsyncIterator[Tagged]:
    """(choice index, message) from every stream as they come; the first error ends it all."""
    if len(streams) == 1:
        try:
            async for message in streams[0]:
                yield 0, message
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[Tagged | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async for message in stream:
                await queue.put((index, message))
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read: the next ASGI message is
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) when the client leaves first.
    `work` runs in the calling task, with one watcher task beside it that cancels it on a
    disconnect: no task switch between the result and its caller (the first token's path)."""
    task = asyncio.current_task()
    assert task is not None, "called from a task"
    watch = asyncio.ensure_future(_disconnected(request))
    gone = False

    def on_gone(done: asyncio.Future) -> None:
        nonlocal gone
        if not done.cancelled() and done.exception() is None:
            gone = True
            task.cancel()

    watch.add_done_callback(on_gone)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        uncancel = getattr(task, "uncancel", None)  # Python 3.11+: the cancel was ours, and is handled
        if uncancel is not None:
            uncancel()
        raise ClientGone() from None
    finally:
        watch.remove_done_callback(on_gone)
        watch.cancel()


async def first_then_rest(request: Request, messages: AsyncIterator[Tagged]) -> AsyncIterator[Tagged]:
    """Waits for the first message before any byte of the response is sent, so that what
    fails at once (a full queue, a bad request, the scheduler down) gets its own HTTP
    status; then the same messages, the first included."""
    first = await until_disconnect(
        request, anext(messages)
    )  # StopAsyncIteration cannot happen: a stream ends on a finish

    async def chained() -> AsyncIterator[Tagged]:
        try:
            yield first
            async for item in messages:
                yield item
        finally:
            await messages.aclose()  # type: ignore[attr-defined]

    return chained()


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, request: Request, events: AsyncIterator[str]) -> None:
        # As StreamingResponse does: no body, so the headers get no Content-Length (chunked).
        self.status_code, self.background = 200, None
        self.init_headers(SSE_HEADERS)
        self.request, self.events = request, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            await until_disconnect(self.request, self._send_events(send))
        except ClientGone:
            return  # the events were cancelled: the scheduler calls with them
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_events(self, send: Send) -> None:
        """Every event; an error after the first becomes an error event (OpenAI's error
        object, which the official clients raise) before [DONE]."""
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        except grpc.RpcError as err:
            for event in (sse(from_rpc(err).body()), DONE):
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]


async def collect(messages: AsyncIterator[Tagged], on_message: Callable[[int, pb.GenerateResponse], None]) -> None:
    try:
        async for index, message in messages:
            on_message(index, message)
    finally:
        await messages.aclose()  # type: ignore[attr-defined]
