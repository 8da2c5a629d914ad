"""Model families by ModelConfig.family. A new family is one small module plus a line here."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from model_svc.config import ModelConfig
from model_svc.models.llama import LlamaForCausalLM
from pico_kernels.ops import KernelOps

if TYPE_CHECKING:
    from model_svc.parallel import TPGroup

# Mistral is structurally Llama; Qwen2/Qwen3 differ only by flags (q/k/v bias, q/k norm).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    config: ModelConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device | str, tp: TPGroup | None = None
) -> LlamaForCausalLM:
    """An eval-mode model with (default-initialised) parameters created directly on device in
    dtype; the loader or build_random_model fills the weights. With tp: this rank's shard
    (model_svc.parallel), config the whole model's."""
    cls = MODEL_REGISTRY.get(config.family)
    if cls is None:
        raise ValueError(f"no model for family {config.family!r}; known: {', '.join(MODEL_REGISTRY)}")
    if tp is not None:
        from model_svc.parallel import shard_config

        config = shard_config(config, tp.size)
    with torch.device(device), _default_dtype(dtype):
        model = cls(config, ops, tp)
    return model.eval().requires_grad_(False)
