"""What the model service says about itself (GetInfo): its epoch, the model's facts the
scheduler needs, and the pools' geometry. The service builds it, the scheduler's model client
reads it back; `info_to_pb` / `info_from_pb` are the wire form (picovllm.model.v1).
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.picovllm.model.v1 import model_pb2 as pb


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The model facts the scheduler needs: what the engine reads as its `model_config`
    (a local runner's ModelConfig has the same names)."""

    family: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    epoch: str  # a random id made at every start of the model service
    model: str  # the model directory
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    device: str
    dtype: str
    config: ModelFacts
    kv_group_windows: tuple[int, ...] = (0,)  # per KV-cache group: its window (contracts.kv_groups)


def info_to_pb(info: ModelInfo) -> pb.GetInfoResponse:
    c = info.config
    return pb.GetInfoResponse(
        epoch=info.epoch,
        model=info.model,
        family=c.family,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        eos_token_ids=c.eos_token_ids,
        bos_token_id=c.bos_token_id,
        block_size=info.block_size,
        num_device_blocks=info.num_device_blocks,
        num_host_blocks=info.num_host_blocks,
        device=info.device,
        dtype=info.dtype,
        kv_group_windows=info.kv_group_windows,
    )


def info_from_pb(m: pb.GetInfoResponse) -> ModelInfo:
    config = ModelFacts(
        m.family,
        m.vocab_size,
        m.max_position_embeddings,
        tuple(m.eos_token_ids),
        m.bos_token_id if m.HasField("bos_token_id") else None,
    )
    windows = tuple(m.kv_group_windows) or (0,)
    return ModelInfo(
        m.epoch, m.model, m.block_size, m.num_device_blocks, m.num_host_blocks, m.device, m.dtype, config, windows
    )
