"""The checks of the engine's settings, each written once: the embedded engine's config
(scheduler_svc.config.EngineConfig) and the service config's scheduler and model sections
(contracts.service_config) carry the same fields and validate them here.

`check_fields(obj, prefix)` checks every field of the table that `obj` has; a bad value raises
ValueError naming the field (with the section's prefix) and showing the value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _power_of_two(v: Any) -> bool:
    return isinstance(v, int) and v >= 1 and not v & (v - 1)


def _positive_int_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, int) and v >= 1)


def _non_negative_int_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, int) and v >= 0)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and v >= 1


# field -> (valid?, what a valid value is)
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "block_size": (_power_of_two, "must be a power of two"),
    "num_gpu_blocks": (_positive_int_or_none, "must be a positive integer or None"),
    "num_cpu_blocks": (_non_negative_int_or_none, "must be a non-negative integer or None"),
    "max_model_len": (_positive_int_or_none, "must be a positive integer or None"),
    "gpu_memory_utilization": (lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
    "swap_space_gib": (lambda v: v >= 0, "must be >= 0"),
    "preemption_mode": (lambda v: v in ("swap", "recompute"), "must be 'swap' or 'recompute'"),
    "max_num_seqs": (_positive_int, "must be >= 1"),
    "max_num_batched_tokens": (_positive_int, "must be >= 1"),
    "torch_threads": (_positive_int_or_none, "must be a positive integer or None"),
    "dtype": (lambda v: v is None or v in DTYPES, "must be float32, bfloat16 or float16"),
    "kv_cache_dtype": (lambda v: v in KV_CACHE_DTYPES, f"must be one of {', '.join(KV_CACHE_DTYPES)}"),
    "kernel_backend": (lambda v: v in (None, "torch", "triton"), "must be 'torch' or 'triton'"),
    "tensor_parallel_size": (_positive_int, "must be a positive integer"),  # the heads' split: the runner's check
    "tp_master_addr": (lambda v: isinstance(v, str) and bool(v), "must be a host name or address"),
    "tp_master_port": (lambda v: v is None or (isinstance(v, int) and 0 < v < 65536), "must be a port number or None"),
}


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check each field of the table that `obj` has. prefix: the section's, e.g. "model."."""
    for name, (valid, expected) in _FIELDS.items():
        if not hasattr(obj, name):
            continue
        value = getattr(obj, name)
        try:
            ok = valid(value)
        except TypeError:  # a string where a number goes
            ok = False
        if not ok:
            raise ValueError(f"{prefix}{name} {expected}, got {value!r}")
