"""Triton fast paths for the paged KV cache, one module per kernel.

    store_kvcache            pico_kernels.triton_store    write new K/V at a slot mapping
    paged_decode_attention   pico_kernels.triton_decode   split-KV decode, GQA heads packed per KV head
    paged_prefill_attention  pico_kernels.triton_prefill  causal flash attention over a paged prefix
                             (on Hopper by default pico_kernels.gluon_prefill, in Gluon)
    cascade_decode_attention pico_kernels.triton_cascade  decode reading a batch's shared prefix once

Each has exactly the signature and semantics of its reference in pico_kernels.reference. They run on
CUDA tensors, and on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before
triton is imported), which is how the tests run without a GPU.
"""

from __future__ import annotations

from pico_kernels.ops import KernelOps
from pico_kernels.triton_cascade import cascade_decode_attention
from pico_kernels.triton_decode import DecodeConfig, decode_with_config, paged_decode_attention, pick_num_splits
from pico_kernels.triton_prefill import PrefillConfig, paged_prefill_attention, prefill_with_config
from pico_kernels.triton_store import store_kvcache

TRITON_OPS = KernelOps(
    "triton", store_kvcache, paged_decode_attention, paged_prefill_attention, cascade_decode_attention
)

__all__ = [
    "TRITON_OPS",
    "cascade_decode_attention",
    "DecodeConfig",
    "PrefillConfig",
    "decode_with_config",
    "paged_decode_attention",
    "paged_prefill_attention",
    "pick_num_splits",
    "prefill_with_config",
    "store_kvcache",
]
