"""The model gRPC service (picovllm.model.v1): a thin servicer over ModelRunner.

Every start makes a new epoch (a random id): the KV tensors and per-sequence state die with
the process, and a scheduler that sees the epoch change recomputes what lived here. A step
sent for another epoch is refused without running. Runner calls happen on one worker
thread, so health checks answer while a step (or the model load) runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from contracts import phase_times, step_convert
from contracts.errors import FailedPrecondition, ModelLost, Unavailable
from contracts.model_info import ModelFacts, ModelInfo, info_to_pb
from contracts.rpc import announce, freeze_heap, start_server, stop_event
from contracts.service_config import ModelSection
from contracts.step import StepInput
from protos.picovllm.model.v1 import model_pb2 as pb
from protos.picovllm.model.v1 import model_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelService"].full_name
RANK_LOST_EXIT_CODE = 3  # the process's status when a tensor-parallel rank died


class EpochMismatch(FailedPrecondition):
    pass


class ModelService:
    def __init__(
        self, config: ModelSection, max_num_seqs: int = 256, runner: Any = None, async_scheduling: bool | None = None
    ) -> None:
        self.config = config
        self.max_num_seqs = max_num_seqs  # the scheduler's batch limit (CUDA graph sizes)
        self.async_scheduling = async_scheduling  # the scheduler's (pipelined steps): the PDL choice
        self.epoch = uuid.uuid4().hex
        self.runner = runner

    def load(self) -> None:
        """The runner the embedded engine would build for the same settings (runner_factory);
        self.config is validated (ModelSection) and its model a local directory (serve_cli)."""
        from model_svc.runner_factory import RunnerSettings, build_runner

        settings = RunnerSettings.of(
            self.config, max_num_seqs=self.max_num_seqs, async_scheduling=self.async_scheduling
        )
        self.runner = build_runner(settings, on_failure=_rank_lost)

    def close(self) -> None:
        """Stop the runner's other ranks (tensor parallel), on the thread that runs its steps."""
        if self.runner is not None:
            self.runner.close()

    def info(self) -> ModelInfo:
        r = self._ready()
        mc = r.config
        facts = ModelFacts(
            mc.family, mc.vocab_size, mc.max_position_embeddings, tuple(mc.eos_token_ids), mc.bos_token_id
        )
        return ModelInfo(
            self.epoch,
            self.config.model,
            r.block_size,
            r.num_device_blocks,
            r.num_host_blocks,
            str(r.device),
            str(r.dtype),
            facts,
            r.kv_group_windows,
        )

    def launch(self, expected_epoch: str, inp: StepInput) -> Any:
        """Queue the step on the device (ModelRunner.launch); `.result()` reads it back."""
        runner = self._ready()
        if expected_epoch != self.epoch:
            raise EpochMismatch(f"step for epoch {expected_epoch or '(none)'}; this service is epoch {self.epoch}")
        try:
            return runner.launch(inp)
        except ModelLost as exc:  # a tensor-parallel rank is gone: no answer, the process ends
            _rank_lost(str(exc))
            raise

    def _ready(self) -> Any:
        if self.runner is None:
            raise Unavailable("the model is still loading")
        return self.runner


def _rank_lost(message: str) -> None:
    """A tensor-parallel rank died: the KV tensors are incomplete and a collective may never
    return, so the process ends now. The scheduler sees the model service go and come back
    with a new epoch once a supervisor restarts it, as after any model-service crash."""
    logger.critical("%s; the model service exits", message)
    logging.shutdown()
    os._exit(RANK_LOST_EXIT_CODE)


class ModelServicer(pb_grpc.ModelServiceServicer):
    """Steps are launched on one thread and read back on another, each in arrival order: a
    scheduler that sends step k+1 before step k's answer (pipelined) gets k+1 queued on the
    device while k is read back.

    One step is one trip through both threads and back to the event loop: the launch thread
    converts the request and launches, then hands the step straight to the readback thread,
    which reads it back, builds the answer and wakes the loop once (the loop only receives
    and sends). A step whose call was cancelled meanwhile is still read back, in order."""

    def __init__(self, service: ModelService, executor: ThreadPoolExecutor) -> None:
        self.service = service
        self.executor = executor
        self.readback = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-readback")

    async def Step(self, request: pb.StepRequest, context) -> pb.StepResponse:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self.executor.submit(self._launch, request, loop, answer, phase_times.start())
        return await answer

    async def StepStream(self, request_iterator, context) -> AsyncIterator[pb.StepResponse]:
        """Steps in the order they arrive on the stream, each launched as Step launches it (so
        the next ones are queued on the device while one is read back), answered in that
        order. A failed step ends the stream with its status (the interceptor maps it)."""
        loop = asyncio.get_running_loop()
        answers: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    answer = loop.create_future()
                    self.executor.submit(self._launch, request, loop, answer, phase_times.start())
                    answers.put_nowait(answer)
            except (asyncio.CancelledError, grpc.RpcError):  # the caller went away
                pass
            finally:
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not None:
                yield await answer
        finally:
            reader.cancel()

    def _launch(
        self, request: pb.StepRequest, loop: asyncio.AbstractEventLoop, answer: asyncio.Future, received: float
    ) -> None:
        """On the launch thread."""
        try:
            phase_times.add("model.queued", received)
            t = phase_times.start()
            inp = step_convert.step_from_pb(request)
            phase_times.add("model.decode", t)
            t = phase_times.start()
            launched = self.service.launch(request.expected_epoch, inp)
            phase_times.add("model.launch", t)
            self.readback.submit(self._read_back, launched, loop, answer)
        except BaseException as exc:  # noqa: BLE001 - raised in the handler (the interceptor maps it)
            _settle(loop, answer, None, exc)

    def _read_back(self, launched: Any, loop: asyncio.AbstractEventLoop, answer: asyncio.Future) -> None:
        """On the readback thread."""
        try:
            t = phase_times.start()
            out = launched.result()
            phase_times.add("model.wait", t)
            t = phase_times.start()
            resp = step_convert.output_to_pb(out, self.service.epoch)
            phase_times.add("model.encode", t)
        except BaseException as exc:  # noqa: BLE001
            _settle(loop, answer, None, exc)
            return
        _settle(loop, answer, resp, None)

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        return info_to_pb(self.service.info())


def _settle(loop: asyncio.AbstractEventLoop, answer: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """From a worker thread: complete the handler's future on its loop (unless the call was
    cancelled meanwhile, or the loop is gone: the server is stopping)."""

    def settle() -> None:
        if answer.done():
            return
        if exc is not None:
            answer.set_exception(exc)
        else:
            answer.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed
        loop.call_soon_threadsafe(settle)


async def serve(
    config: ModelSection, max_num_seqs: int = 256, token: str | None = None, *, async_scheduling: bool | None = None
) -> None:
    """Load the model (NOT_SERVING meanwhile), serve until SIGTERM/SIGINT. `token`: the
    internal token callers must present (every call but health and reflection).
    `max_num_seqs` and `async_scheduling`: the scheduler section's."""
    service = ModelService(config, max_num_seqs, async_scheduling=async_scheduling)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner")
    servicer = ModelServicer(service, executor)
    running = await start_server(
        config.address, [(pb_grpc.add_ModelServiceServicer_to_server, servicer, SERVICE_NAME)], auth_token=token
    )
    stop = stop_event()
    load = asyncio.get_running_loop().run_in_executor(executor, service.load)
    stopped = asyncio.ensure_future(stop.wait())
    either: list[asyncio.Future[Any]] = [load, stopped]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if load.done():
        load.result()  # a model that fails to load ends the process with the error
        freeze_heap()  # the model and torch: out of the collector's sight, so no full collection stalls a step
        phase_times.configure("model", "model.wait")
        await running.set_serving(True)
        logger.info(
            "model service epoch %s: %d device / %d host blocks",
            service.epoch,
            service.runner.num_device_blocks,
            service.runner.num_host_blocks,
        )
        announce(
            f"model service ready: gRPC {running.address} "
            f"({service.runner.config.architecture}, {service.runner.device})"
        )
        await stopped
    await running.set_serving(False)
    await running.server.stop(grace=5)
    if load.done() and load.exception() is None:
        await asyncio.get_running_loop().run_in_executor(executor, service.close)
    executor.shutdown(wait=False, cancel_futures=True)
