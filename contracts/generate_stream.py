"""GenerateStream: many Generate requests on one long-lived call (the HTTP gateway's), for
every server of the public API (the scheduler, the router): built on the server's Generate.

A call per request costs its set-up and teardown on both sides, about a quarter of a
millisecond of grpc.aio work before the first token (bench/NOTES.md, "The gateway's TTFT at
low load"); on one open stream a request is one message. Each request runs exactly as its own
Generate call would (the same checks, limits, metrics and clean-up), in a task of its own;
its messages go out tagged with their request_id, all that are ready in one message, and its
end follows its last message: OK, or the status and public text its call would have ended
with. An `abort` drops a request (Generate's clean-up aborts it in the engine); the stream's
end drops every request still on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from contracts.errors import public_message, status_code_for
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb

logger = logging.getLogger(__name__)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _RequestContext:
    """What Generate reads of its call's context, for a request of a stream: no deadline of its
    own; an abort ends this request (not the stream) with that status."""

    @staticmethod
    def time_remaining() -> None:
        return None

    @staticmethod
    async def abort(code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


def _end(request_id: str, code: grpc.StatusCode = grpc.StatusCode.OK, message: str = "") -> pb.StreamEnd:
    return pb.StreamEnd(request_id=request_id, code=code.value[0], message=message)


class _Requests:
    """The requests of one stream, each in its task, and their answers not yet sent."""

    def __init__(self, generate: Callable[..., AsyncIterator[pb.GenerateResponse]]) -> None:
        self.generate = generate
        self.ready: list[pb.GenerateResponse] = []
        self.ends: list[pb.StreamEnd] = []
        self.wake = asyncio.Event()
        self.tasks: dict[str, asyncio.Task] = {}

    def answer(self) -> pb.GenerateStreamResponse | None:
        """Everything ready, in one message (None: nothing)."""
        if not (self.ready or self.ends):
            return None
        answer = pb.GenerateStreamResponse(responses=self.ready, ends=self.ends)
        self.ready.clear()
        self.ends.clear()
        return answer

    async def run(self, request: pb.GenerateRequest) -> None:
        end = _end(request.request_id)
        try:
            async for message in self.generate(request, _RequestContext):
                self.ready.append(message)
                self.wake.set()
        except asyncio.CancelledError:
            return  # dropped by the caller: nothing more goes out for it
        except _Aborted as exc:
            end = _end(request.request_id, exc.code, exc.details)
        except Exception as exc:  # noqa: BLE001 - this request's status, as its own call would end
            code = status_code_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("internal error in a streamed request", exc_info=exc)
            end = _end(request.request_id, code, public_message(exc, code))
        finally:
            self.tasks.pop(request.request_id, None)
        self.ends.append(end)
        self.wake.set()

    async def read(self, requests: AsyncIterator[pb.GenerateStreamRequest]) -> None:
        async for item in requests:
            kind = item.WhichOneof("kind")
            if kind == "generate":
                request_id = item.generate.request_id
                if not request_id or request_id in self.tasks:
                    why = "a streamed request needs a request_id of its own on the stream"
                    self.ends.append(_end(request_id, grpc.StatusCode.INVALID_ARGUMENT, why))
                    self.wake.set()
                    continue
                self.tasks[request_id] = asyncio.ensure_future(self.run(item.generate))
            elif kind == "abort":
                task = self.tasks.pop(item.abort.request_id, None)
                if task is not None:
                    task.cancel()


async def generate_stream(
    generate: Callable[..., AsyncIterator[pb.GenerateResponse]], requests: AsyncIterator[pb.GenerateStreamRequest]
) -> AsyncIterator[pb.GenerateStreamResponse]:
    """The stream's answers; `generate` is the servicer's Generate."""
    state = _Requests(generate)
    reader = asyncio.ensure_future(state.read(requests))
    reader.add_done_callback(lambda _: state.wake.set())
    try:
        while True:
            await state.wake.wait()
            state.wake.clear()
            answer = state.answer()
            if answer is not None:
                yield answer
            if reader.done() and not state.tasks:  # the caller closed its side and every request ended
                reader.result()
                return
    finally:
        reader.cancel()
        running = list(state.tasks.values())
        for task in running:
            task.cancel()
        await asyncio.gather(reader, *running, return_exceptions=True)
