"""Weights in and out: load a local Hugging Face directory (config.json + *.safetensors, sharded
or not) into our model code, build random-weight models for tests and benchmarks, and save a
model back in HF format (the tokenizer: contracts.tokenizer).

Checkpoint names are HF's; the model's packed_modules_mapping says which of them are rows of
a merged projection (q/k/v -> qkv_proj, gate/up -> gate_up_proj).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from contracts.engine_fields import KV_CACHE_DTYPES
from model_svc.config import ModelConfig
from model_svc.layers import MergedLinear, RMSNorm
from model_svc.models import build_model
from model_svc.models.llama import LlamaForCausalLM
from pico_kernels import select_ops
from pico_kernels.ops import KernelOps

if TYPE_CHECKING:
    from model_svc.parallel import TPGroup

logger = logging.getLogger(__name__)

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled" / "stories260k"

# Checkpoint tensors we never need (old checkpoints store rope's inv_freq as a buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """A dtype, its name, or None for the device's default."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    return dtype


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: "auto" the model's, "fp8" / "fp8_e4m3" float8_e4m3fn (scale 1,
    as vLLM's without calibrated scales): half the bytes a token of a 16-bit model."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA, fp32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# Below this many parameters a CPU forward's matrix products are too small to split: extra
# torch threads only wait on each other (bench/results/cpu_defaults.md).
SMALL_MODEL_PARAMS = 100_000_000


def cpu_threads(model: nn.Module, requested: int | None) -> int:
    """torch's thread count for this model on the CPU: `requested` when given, else one for a
    small model and torch's own default (one per core) for a larger one."""
    if requested is not None:
        return requested
    num_params = sum(p.numel() for p in model.parameters())
    return 1 if num_params < SMALL_MODEL_PARAMS else torch.get_num_threads()


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    ops: KernelOps | None = None,
    tp: TPGroup | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for the directory's config and stream its safetensors weights in;
    with tp, this rank's shard of them (the config returned is the whole model's)."""
    config = ModelConfig.from_pretrained(path)  # raises FileNotFoundError / ValueError
    files = safetensors_files(path)
    # The checkpoint's own architecture: several families run on one model class of ours.
    logger.info("loading %s (%s family) from %s", config.architecture, config.family, path)
    dtype = dtype or default_dtype(device)
    model = build_model(config, ops or select_ops(device), dtype, device, tp)
    weights = iter_safetensors(files)
    if tp is not None:
        from model_svc.parallel import shard_weights

        weights = shard_weights(weights, config, tp.rank, tp.size)
    load_weights(model, weights)
    model.fold_norm_weights()  # for the deferred norms, where they run (LlamaModel.fold_norm_weights)
    return model, config


def safetensors_files(path: str | Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {str(path)!r}")
    return files


def iter_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, so at most one checkpoint tensor is in host memory."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable; keys() is its API
                yield name, f.get_tensor(name)


def _expected_keys(model: nn.Module) -> set[str]:
    """Every parameter, and every shard of a merged parameter, the checkpoint must provide."""
    keys: set[str] = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, MergedLinear):
                keys.update(f"{full}:{shard}" for shard in module.shard_slices)
            else:
                keys.add(full)
    return keys


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model (casting to its dtype and device). Raises
    ValueError for an unexpected name, a wrong shape, or a parameter left unloaded."""
    params = dict(model.named_parameters())
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name.startswith("lm_head.")):
            continue
        module_name, _, param_name = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if leaf in mapping:
            merged_name, shard = mapping[leaf]
            target = f"{parent}.{merged_name}"
            module = model.get_submodule(target) if f"{target}.{param_name}" in params else None
            if not isinstance(module, MergedLinear):
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            module.load_shard(shard, param_name, tensor)
            loaded.add(f"{target}.{param_name}:{shard}")
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
        param.copy_(tensor)
        loaded.add(name)
    missing = _expected_keys(model) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:5]}")


@torch.no_grad()
def build_random_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    ops: KernelOps | None = None,
    std: float = 0.02,
) -> LlamaForCausalLM:
    """Random weights: normal(0, std) everywhere, norm weights 1 + normal(0, std). The same
    seed gives the same weights on the same device type."""
    model = build_model(config, ops or select_ops(device), dtype, device)
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            param.normal_(0.0, std, generator=gen)
            if isinstance(module, RMSNorm):
                param.add_(1.0)
    model.fold_norm_weights()  # as load_model
    return model


@torch.no_grad()
def save_model(model: LlamaForCausalLM, path: str | Path) -> Path:
    """Write config.json and model.safetensors in HF layout (merged projections split back),
    so load_model (or transformers) can read the directory. Tokenizer files are not written."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    inverse = {(merged, shard): leaf for leaf, (merged, shard) in getattr(model, "packed_modules_mapping", {}).items()}
    tensors: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if isinstance(module, MergedLinear):
                parent, _, merged = module_name.rpartition(".")
                for shard, rows in module.shard_slices.items():
                    tensors[f"{parent}.{inverse[(merged, shard)]}.{param_name}"] = param[rows].contiguous().cpu()
            else:
                tensors[f"{module_name}.{param_name}"] = param.contiguous().cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    return path
