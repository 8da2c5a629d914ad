"""Kernels for the model service: each fast path sits beside its plain-torch reference.

`select_ops(device)` is called once at start-up: Triton kernels on CUDA, the torch
references elsewhere (or when asked for by name). The operations: pico_kernels.ops.KernelOps.
"""

from __future__ import annotations

import torch

from pico_kernels.ops import REFERENCE_OPS, KernelOps


def select_ops(device: torch.device | str, backend: str | None = None) -> KernelOps:
    """backend: None (auto: "triton" on CUDA, "torch" otherwise), "torch" or "triton"."""
    device = torch.device(device)
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return REFERENCE_OPS
    if backend == "triton":
        from pico_kernels.triton_ops import TRITON_OPS

        return TRITON_OPS
    raise ValueError(f"unknown kernel backend {backend!r}; expected 'torch' or 'triton'")
