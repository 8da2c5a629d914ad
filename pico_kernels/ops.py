"""KernelOps: the paged-cache operations the model code calls, one implementation per backend;
REFERENCE_OPS: the plain-torch references (pico_kernels.reference), which define them.

A module of its own so that pico_kernels.triton_ops can build its KernelOps without importing the
package's select_ops, which imports pico_kernels.triton_ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pico_kernels.reference import (
    cascade_decode_attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    store_kvcache_ref,
)


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The paged-cache operations the model code calls; signatures as in pico_kernels.reference."""

    name: str
    store_kvcache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    cascade_decode_attention: Callable[..., torch.Tensor]  # decode reading a shared prefix once


REFERENCE_OPS = KernelOps(
    "torch", store_kvcache_ref, paged_decode_attention_ref, paged_prefill_attention_ref, cascade_decode_attention_ref
)
