"""The one way to build a ModelRunner from settings, for the embedded engine
(scheduler_svc.engine) and the model service (model_svc.server) alike, so that both get the
same runner for the same config: the same pools, kernels, CUDA graphs and PDL choice.

Torch-free at import: the scheduler's config may name what lives here without loading torch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model_svc.parallel import TPGroup
    from model_svc.runner import ModelRunner


def small_batch_pdl(async_scheduling: bool | None) -> bool:
    """Whether the model runner's small-batch decode graphs should capture programmatic
    dependent launch (model_svc.cuda_graphs.PDL_MAX_BATCH): yes when steps are queued back to
    back (overlapped scheduling, the default on CUDA, embedded or pipelined service steps),
    where it shortens batch-1 decode; no when each step is launched alone and waited for
    (synchronous), where it lengthens it (bench/NOTES.md, "PDL for small batches")."""
    return async_scheduling is not False


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """Everything a runner is built from: the engine config's fields, or the model section's
    with the scheduler's batch limit and scheduling mode."""

    model: str  # a local directory
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: measured
    num_cpu_blocks: int | None = None  # None: from swap_space_gib
    swap_space_gib: float = 1.0
    device: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str = "auto"
    kernel_backend: str | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False
    max_num_seqs: int = 256
    torch_threads: int | None = None
    async_scheduling: bool | None = None  # the scheduler's: decides the PDL choice
    tensor_parallel_size: int = 1  # ranks (devices) the model is split over (model_svc.parallel)
    tp_master_addr: str = "127.0.0.1"  # the ranks' rendezvous (docs/TENSOR_PARALLEL.md)
    tp_master_port: int | None = None  # None: a free port

    @classmethod
    def of(cls, config: Any, **given: Any) -> RunnerSettings:
        """Every setting from `given`, else the config's attribute of the same name (the
        engine config has them all; the model section all but max_num_seqs and
        async_scheduling, which are the scheduler's)."""
        names = [f.name for f in dataclasses.fields(cls)]
        if unknown := set(given) - set(names):
            raise TypeError(f"unknown runner settings: {sorted(unknown)}")
        return cls(**{name: given[name] if name in given else getattr(config, name) for name in names})

    @property
    def small_batch_pdl(self) -> bool:
        return small_batch_pdl(self.async_scheduling)


def build_runner(
    s: RunnerSettings, tp: TPGroup | None = None, on_failure: Callable[[str], None] | None = None
) -> ModelRunner:
    """The runner (rank 0 of a tensor-parallel one: it starts the other ranks, and
    on_failure(message) runs when one of them dies); tp: a spawned rank's group."""
    from model_svc.kv_cache import host_pool_blocks
    from model_svc.runner import ModelRunner

    if tp is None and s.tensor_parallel_size > 1:
        from model_svc.tp_launch import start_ranks

        build = functools.partial(build_runner, s)  # what each started rank runs, on its group
        tp = start_ranks(s.tensor_parallel_size, s.tp_master_addr, s.tp_master_port, s.device, build, on_failure)

    return ModelRunner(
        s.model,
        block_size=s.block_size,
        num_device_blocks=s.num_gpu_blocks,
        num_host_blocks=functools.partial(host_pool_blocks, s.num_cpu_blocks, s.swap_space_gib),
        device=s.device,
        dtype=s.dtype,
        kv_cache_dtype=s.kv_cache_dtype,
        kernel_backend=s.kernel_backend,
        device_memory_fraction=s.gpu_memory_utilization,
        max_num_batched_tokens=s.max_num_batched_tokens,
        enforce_eager=s.enforce_eager,
        max_num_seqs=s.max_num_seqs,
        small_batch_pdl=s.small_batch_pdl,
        torch_threads=s.torch_threads,
        tp=tp,
    )
