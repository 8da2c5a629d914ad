"""Write new tokens' K and V into the paged caches (Triton).

Contract: `store_kvcache` has the signature and semantics of
`pico_kernels.reference.store_kvcache_ref`: token n goes to slot slot_mapping[n] (block
slot // block_size, offset slot % block_size) of both caches; a negative slot is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pico_kernels.triton_common import next_pow2, to_cache


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        offset = slot % PAGE
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(key_ptr + token * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(value_ptr + token * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
        tl.store(
            k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], to_cache(k, k_cache_ptr.dtype.element_ty), mask=mask
        )
        tl.store(
            v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], to_cache(v, v_cache_ptr.dtype.element_ty), mask=mask
        )


def _as_cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows with unit stride, in the cache dtype unless that is FP8 (the kernel rounds to it,
    triton_common.to_cache). A dtype mismatch is otherwise rare (the model writes in the cache
    dtype); casting here on the host keeps torch's rounding, which the interpreter's own
    float-to-bf16 conversion does not reproduce."""
    if x.dtype != dtype and dtype != torch.float8_e4m3fn:
        x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kvcache(
    key: torch.Tensor,  # (N, Hkv, D)
    value: torch.Tensor,  # (N, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (N,) int64; slot = block_id * block_size + offset; -1 = skip
) -> None:
    """Triton version of pico_kernels.reference.store_kvcache_ref (in place)."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    key, value = _as_cache_rows(key, k_cache.dtype), _as_cache_rows(value, v_cache.dtype)
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(head_dim),
        PAGE=k_cache.shape[1],
        num_warps=4 if num_heads * head_dim >= 1024 else 1,
    )
