"""The scheduler's model client in service mode: `.step(StepInput) -> StepOutput` over gRPC,
with the pool sizes and model facts the engine reads (`num_device_blocks`, `config`, ...).

It remembers the service's epoch. A step refused for another epoch raises ModelRestarted
(the service came back empty: recompute); a service that stays down for the retry window
raises ModelUnavailable (the engine tries again on its next step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from model_svc import convert
from model_svc.step import StepInput, StepOutput
from protos.picovllm.model.v1 import model_pb2 as pb
from protos.picovllm.model.v1 import model_pb2_grpc as pb_grpc
from scheduler_svc.errors import FailedPrecondition, Unavailable
from scheduler_svc.rpc import CHANNEL_OPTIONS, call_with_retry


class ModelUnavailable(Unavailable):
    pass


class ModelRestarted(Unavailable):
    """The model service lost its KV tensors and sequences (a new epoch)."""


@dataclass(frozen=True, slots=True)
class RemoteModelConfig:
    """The model facts the scheduler needs (the engine's `model_config`)."""

    family: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


@dataclass(frozen=True, slots=True)
class RemoteModelInfo:
    epoch: str
    model: str
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    device: str
    dtype: str
    config: RemoteModelConfig
    columnar_step: bool = False  # the service reads the columnar step encoding (plain decode rows as lists)


def info_from_pb(m: pb.GetInfoResponse) -> RemoteModelInfo:
    config = RemoteModelConfig(m.family, m.vocab_size, m.max_position_embeddings, tuple(m.eos_token_ids),
                               m.bos_token_id if m.HasField("bos_token_id") else None)
    return RemoteModelInfo(m.epoch, m.model, m.block_size, m.num_device_blocks, m.num_host_blocks, m.device, m.dtype, config,
                           m.columnar_step)


class RemoteModel:
    def __init__(self, address: str, rpc_timeout_s: float = 30.0, retry_window_s: float = 1.0) -> None:
        self.address = address
        self.rpc_timeout_s = rpc_timeout_s
        self.retry_window_s = retry_window_s
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.ModelServiceStub(self.channel)
        self.info: RemoteModelInfo | None = None
        self.num_steps = 0
        self.step_seconds = 0.0

    # What LLMEngine reads from a model client.
    @property
    def config(self) -> RemoteModelConfig:
        return self._info.config

    @property
    def num_device_blocks(self) -> int:
        return self._info.num_device_blocks

    @property
    def num_host_blocks(self) -> int:
        return self._info.num_host_blocks

    @property
    def epoch(self) -> str:
        return self._info.epoch

    @property
    def _info(self) -> RemoteModelInfo:
        assert self.info is not None, "connect() first"
        return self.info

    def fetch_info(self, window_s: float | None = None) -> RemoteModelInfo:
        """The service's current info (its epoch may be new); ModelUnavailable if it does not
        answer within `window_s` (default: the retry window)."""
        window = self.retry_window_s if window_s is None else window_s
        resp = call_with_retry(self.stub.GetInfo, pb.GetInfoRequest(), time.monotonic() + window,
                               min(self.rpc_timeout_s, max(window, 0.05)), f"model {self.address} GetInfo", ModelUnavailable)
        return info_from_pb(resp)

    def connect(self, timeout_s: float) -> RemoteModelInfo:
        """Wait (bounded) for the service to be up with its model loaded; adopt its epoch."""
        self.info = self.fetch_info(timeout_s)
        return self.info

    def step(self, inp: StepInput, timeout: float | None = None) -> StepOutput:
        info = self._info
        request = convert.step_to_pb(inp, info.epoch, info.columnar_step)
        start = time.monotonic()
        t = self.rpc_timeout_s if timeout is None else min(timeout, self.rpc_timeout_s)
        try:
            resp = call_with_retry(self.stub.Step, request, start + self.retry_window_s, t, f"model {self.address} Step", ModelUnavailable)
        except FailedPrecondition as exc:  # another epoch: the service restarted
            raise ModelRestarted(str(exc)) from None
        finally:
            self.step_seconds += time.monotonic() - start
        self.num_steps += 1
        return convert.output_from_pb(resp)

    def close(self) -> None:
        self.channel.close()
