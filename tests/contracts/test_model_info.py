"""The model service's GetInfo through the wire form (contracts.model_info)."""

from __future__ import annotations

from contracts.model_info import ModelFacts, ModelInfo, info_from_pb, info_to_pb
from protos.picovllm.model.v1 import model_pb2 as pb


def _round_trip(info: ModelInfo) -> ModelInfo:
    return info_from_pb(pb.GetInfoResponse.FromString(info_to_pb(info).SerializeToString()))


def test_info_round_trips():
    info = ModelInfo(
        "e1", "/models/m", 16, 64, 8, "cuda:0", "torch.bfloat16", ModelFacts("qwen3", 512, 4096, (2, 7), 1)
    )
    assert _round_trip(info) == info


def test_a_model_without_bos_reads_back_none():
    info = ModelInfo("e", "m", 16, 64, 8, "cpu", "torch.float32", ModelFacts("llama", 512, 512, (2,), None))
    assert _round_trip(info).config.bos_token_id is None
