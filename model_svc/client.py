"""The scheduler's model client in service mode: `.step(StepInput) -> StepOutput` over gRPC,
with the pool sizes and model facts the engine reads (`num_device_blocks`, `config`, ...).

It remembers the service's epoch. A step refused for another epoch raises ModelRestarted
(the service came back empty: recompute); a service that stays down for the retry window
raises ModelUnavailable (the engine tries again on its next step).

`step()` is one unary Step call. The pipelined scheduler uses `launch()` instead: steps go
over one long-lived StepStream in order, so it can send the next steps while the service
still runs earlier ones (a unary call per step could overtake the one before it).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc

from contracts import phase_times, step_convert
from contracts.auth import call_metadata, with_token
from contracts.errors import FailedPrecondition, Unavailable, error_from_rpc
from contracts.model_info import ModelFacts, ModelInfo, info_from_pb
from contracts.rpc import CHANNEL_OPTIONS, RETRYABLE, call_with_retry
from contracts.step import StepInput, StepOutput
from protos.picovllm.model.v1 import model_pb2 as pb
from protos.picovllm.model.v1 import model_pb2_grpc as pb_grpc


class ModelUnavailable(Unavailable):
    pass


class ModelRestarted(Unavailable):
    """The model service lost its KV tensors and sequences (a new epoch)."""


class RemoteModel:
    def __init__(
        self, address: str, rpc_timeout_s: float = 30.0, retry_window_s: float = 1.0, token: str | None = None
    ) -> None:
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.retry_window_s = retry_window_s
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.ModelServiceStub(self.channel)
        # `token`: the internal token, presented on every call (contracts.auth).
        self.metadata = call_metadata(token)
        self._get_info = with_token(self.stub.GetInfo, token)
        self._step = with_token(self.stub.Step, token)
        self.info: ModelInfo | None = None
        self.num_steps = 0
        self.step_seconds = 0.0
        self._stream: _StepStream | None = None  # the step stream of launch() (opened on first use)

    # What LLMEngine reads from a model client.
    @property
    def config(self) -> ModelFacts:
        return self._info.config

    @property
    def num_device_blocks(self) -> int:
        return self._info.num_device_blocks

    @property
    def num_host_blocks(self) -> int:
        return self._info.num_host_blocks

    @property
    def kv_group_windows(self) -> tuple[int, ...]:
        return self._info.kv_group_windows

    @property
    def epoch(self) -> str:
        return self._info.epoch

    @property
    def _info(self) -> ModelInfo:
        assert self.info is not None, "connect() first"
        return self.info

    def fetch_info(self, window_s: float | None = None) -> ModelInfo:
        """The service's current info (its epoch may be new); ModelUnavailable if it does not
        answer within `window_s` (default: the retry window)."""
        window = self.retry_window_s if window_s is None else window_s
        resp = call_with_retry(
            self._get_info,
            pb.GetInfoRequest(),
            time.monotonic() + window,
            min(self.rpc_timeout_s, max(window, 0.05)),
            f"model {self.address} GetInfo",
            ModelUnavailable,
        )
        return info_from_pb(resp)

    def connect(self, timeout_s: float) -> ModelInfo:
        """Wait (bounded) for the service to be up with its model loaded; adopt its epoch."""
        self.info = self.fetch_info(timeout_s)
        return self.info

    def step(self, inp: StepInput, timeout: float | None = None) -> StepOutput:
        info = self._info
        t = phase_times.start()
        request = step_convert.step_to_pb(inp, info.epoch)
        phase_times.add("client.encode", t)
        start = time.monotonic()
        t = self.rpc_timeout_s if timeout is None else min(timeout, self.rpc_timeout_s)
        try:
            resp = call_with_retry(
                self._step, request, start + self.retry_window_s, t, f"model {self.address} Step", ModelUnavailable
            )
        except FailedPrecondition as exc:  # another epoch: the service restarted
            raise ModelRestarted(str(exc)) from None
        finally:
            self.step_seconds += time.monotonic() - start
        self.num_steps += 1
        return _output(resp)

    def launch(self, inp: StepInput, timeout: float | None = None) -> StreamedStep:
        """Send the step over the service's step stream without waiting (the pipelined
        scheduler keeps the next steps queued there); `.result()` waits for its answer."""
        request = step_convert.step_to_pb(inp, self._info.epoch)
        if self._stream is None or self._stream.broken is not None:
            self._stream = _StepStream(self)
        return StreamedStep(self, self._stream, self._stream.send(request), timeout)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.channel.close()


def _output(response: pb.StepResponse) -> StepOutput:
    t = phase_times.start()
    out = step_convert.output_from_pb(response)
    phase_times.add("client.decode", t)
    return out


def _stream_error(err: grpc.RpcError, address: str) -> Exception:
    """What a failed step stream means for the steps sent on it."""
    code = err.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # another epoch: the service restarted
        return ModelRestarted(err.details() or "new epoch")
    if code in RETRYABLE or code == grpc.StatusCode.CANCELLED:
        return ModelUnavailable(f"model {address} StepStream: {code.name}: {err.details()}")
    return error_from_rpc(err) or RuntimeError(f"model {address} StepStream: {code.name}: {err.details()}")


class _StepStream:
    """One StepStream call: requests go out in the order sent, and the answers, which come
    back in that order, are matched to them in order. Once the stream fails, every step sent
    on it that has no answer fails the same way, and so does every later send."""

    def __init__(self, model: RemoteModel) -> None:
        self.address = model.address
        self.broken: Exception | None = None
        self._lock = threading.Lock()
        self._pending: deque[Future] = deque()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._call: Any = None  # grpc's stream-stream call (untyped)
        try:  # a service that is down: fail now (the engine retries on its next step)
            grpc.channel_ready_future(model.channel).result(timeout=model.retry_window_s)
        except grpc.FutureTimeoutError:
            self.broken = ModelUnavailable(f"model {self.address} not ready within {model.retry_window_s} s")
            return
        self._call = model.stub.StepStream(iter(self._requests.get, None), metadata=model.metadata)
        threading.Thread(target=self._read, name="model-stream", daemon=True).start()

    def send(self, request: pb.StepRequest) -> Future:
        answer: Future = Future()
        with self._lock:
            if self.broken is not None:
                answer.set_exception(self.broken)
            else:
                self._pending.append(answer)
                self._requests.put(request)
        return answer

    def _read(self) -> None:
        try:
            for response in self._call:
                with self._lock:
                    answer = self._pending.popleft()
                answer.set_result(response)
            error: Exception = ModelUnavailable(f"model {self.address} closed the step stream")
        except grpc.RpcError as err:
            error = _stream_error(err, self.address)
        except IndexError:  # an answer nobody asked for
            error = RuntimeError(f"model {self.address} answered a step that was not sent")
        self.fail(error)

    def fail(self, error: Exception) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = error
            pending, self._pending = list(self._pending), deque()
        for answer in pending:
            answer.set_exception(error)
        self.close()

    def close(self) -> None:
        self._requests.put(None)  # the end of the request iterator
        if self._call is not None:
            self._call.cancel()


class StreamedStep:
    """A step sent on the step stream; result() is its StepOutput (ModelRestarted,
    ModelUnavailable or the domain error otherwise)."""

    def __init__(self, model: RemoteModel, stream: _StepStream, answer: Future, timeout: float | None) -> None:
        self.model, self.stream, self.answer, self.timeout = model, stream, answer, timeout

    def result(self) -> StepOutput:
        t = self.model.rpc_timeout_s if self.timeout is None else min(self.timeout, self.model.rpc_timeout_s)
        try:
            response = self.answer.result(timeout=t)
        except FutureTimeout:  # the steps behind it cannot be trusted either: drop the stream
            self.stream.fail(ModelUnavailable(f"model {self.model.address}: no answer to a step within {t:.2f} s"))
            response = self.answer.result()  # raises the failure just set
        self.model.num_steps += 1
        return _output(response)
