"""EngineConfig: one frozen config for the embedded engine, validated once; and
resolve_model, which every entry point uses to turn `--model` into a local directory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from contracts.engine_fields import check_fields
from contracts.service_config import BUNDLED_MODEL

# Hugging Face's repo id forms, "name" or "namespace/name"; anything else is a path.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class ModelNotFoundError(FileNotFoundError):
    """`--model` is neither a local directory nor a repo in the local Hugging Face cache."""


def resolve_model(model: str) -> str:
    """The local directory of `model`: a directory as given, else a Hugging Face repo id
    already in the local cache (HF_HUB_CACHE, HF_HOME), found offline. The server never
    downloads: it may run where nothing outside can be reached, and a multi-GB download
    hidden in a start-up is not something an operator expects."""
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    if not _REPO_ID.fullmatch(model):
        raise ModelNotFoundError(f"model directory not found: {model}")
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:  # comes with transformers; without it only directories work
        raise ModelNotFoundError(f"model directory not found: {model} (and huggingface_hub is not installed)") from None
    try:
        return snapshot_download(model, local_files_only=True)
    except (ValueError, OSError):  # an invalid id (HFValidationError), or not in the cache (LocalEntryNotFoundError)
        pass
    raise ModelNotFoundError(
        f"model {model!r} is not a local directory and not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
        f"this server never downloads: fetch it first with `hf download {model}` "
        "(older huggingface_hub: `huggingface-cli download`)"
    )


def check_device(device: str | None) -> None:
    """A device this machine has, as a ValueError naming it (the CLI's one line), not a
    traceback from deep in the model runner: None, "cpu", "cuda" or "cuda:N"."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine's torch ({torch.__version__}) sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def offline_batched_tokens(device: str | None) -> int:
    """The embedded engine's step budget when none is given: 16,384 tokens on a CUDA device
    of 70 GiB or more other than an A100 (H100, H200 class), else 8,192, the figures vLLM's
    offline LLM class takes (its server, like ours, keeps a smaller one for latency): an
    offline run's prompts come all at once, and larger prefill steps measured faster on the
    headline workload (bench/NOTES.md, "The user-path headline: where its time goes, the
    offline step budget")."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda":
        return 8192
    props = torch.cuda.get_device_properties(dev)
    return 16384 if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower() else 8192


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = BUNDLED_MODEL
    block_size: int = 16
    num_gpu_blocks: int | None = None  # the device pool, whatever the device; None = measure
    num_cpu_blocks: int | None = None  # the host (swap) pool; None = from swap_space_gib
    swap_space_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "swap"  # "swap" | "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: offline_batched_tokens(device)
    max_model_len: int | None = None
    device: str | None = None  # None: cuda if available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8_e4m3fn, half a 16-bit cache's bytes
    kernel_backend: str | None = None  # None: triton on cuda, torch otherwise
    enforce_eager: bool = False  # True: no CUDA graphs
    # Schedule step k+1 while step k runs (placeholder tokens; identical output). None: on when
    # the engine drives a CUDA model runner (faster in tokens/s and batch-1 latency, bench/NOTES.md),
    # off on the CPU where nothing overlaps.
    async_scheduling: bool | None = None
    skip_tokenizer_init: bool = False  # token-id prompts only, no text out (benchmarks)
    torch_threads: int | None = None  # CPU threads for torch; None: one for a small model, else one per core
    # The model split over this many ranks, one process (and device) each (docs/TENSOR_PARALLEL.md);
    # the ranks rendezvous at tp_master_addr:tp_master_port (None: a free port).
    tensor_parallel_size: int = 1
    tp_master_addr: str = "127.0.0.1"
    tp_master_port: int | None = None

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.max_num_batched_tokens is None:
            object.__setattr__(self, "max_num_batched_tokens", offline_batched_tokens(self.device))
        check_fields(self)
        # A repo id becomes its snapshot directory here, once, so that everything reading the
        # config (the model runner, the tokenizer) gets a local directory.
        object.__setattr__(self, "model", resolve_model(self.model))
