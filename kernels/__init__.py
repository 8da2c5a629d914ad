"""Kernels for the model service: each fast path sits beside its plain-torch reference.

`select_ops(device)` is called once at start-up: Triton kernels on CUDA, the torch
references elsewhere (or when asked for by name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.reference import cascade_decode_attention_ref, paged_decode_attention_ref, paged_prefill_attention_ref, store_kvcache_ref


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The paged-cache operations the model code calls; signatures as in kernels.reference."""

    name: str
    store_kvcache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    cascade_decode_attention: Callable[..., torch.Tensor]  # decode reading a shared prefix once


REFERENCE_OPS = KernelOps("torch", store_kvcache_ref, paged_decode_attention_ref, paged_prefill_attention_ref,
                          cascade_decode_attention_ref)


def select_ops(device: torch.device | str, backend: str | None = None) -> KernelOps:
    """backend: None (auto: "triton" on CUDA, "torch" otherwise), "torch" or "triton"."""
    device = torch.device(device)
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return REFERENCE_OPS
    if backend == "triton":
        from kernels.triton_ops import TRITON_OPS

        return TRITON_OPS
    raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
