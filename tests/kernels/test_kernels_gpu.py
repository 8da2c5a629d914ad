"""GPU only (skipped without CUDA): the attention and store kernels at production shapes (Hq
32, Hkv 8, D 128; decode of one sequence too), odd head dims and other block sizes, the
bundled model's fp32 shapes, and both attention kernels captured in a CUDA graph, each
against its torch reference. The helpers and the CPU/interpreter cases are in
test_kernels.py."""

from __future__ import annotations

import pytest
import torch

from pico_kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, store_kvcache_ref
from pico_kernels.triton_ops import TRITON_OPS, store_kvcache
from tests.kernels.test_kernels import (
    assert_matches,
    make_paged_kv,
    make_query,
    needs_cuda,
    run_decode_case,
    run_prefill_case,
)

# (block size, head dim, (query heads, KV heads)) of production models
PRODUCTION_SHAPES = [(16, 128, (32, 8)), (64, 128, (32, 8)), (8, 256, (16, 2)), (128, 80, (8, 8))]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size,head_dim,heads", PRODUCTION_SHAPES)
def test_gpu_decode_production_shapes(dtype, block_size, head_dim, heads):
    run_decode_case(torch.device("cuda"), dtype, [1, 100, 1000, 4097, 2900], block_size, head_dim, heads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seq_len", [1, 100, 4097, 20000])
@pytest.mark.parametrize("block_size,head_dim,heads", PRODUCTION_SHAPES)
def test_gpu_decode_one_sequence(seq_len, block_size, head_dim, heads):
    """Batch 1 under PDL has its own tiles and split count (triton_decode.default_decode_config)."""
    from pico_kernels.triton_common import pdl_scope

    with pdl_scope(True):
        run_decode_case(torch.device("cuda"), torch.bfloat16, [seq_len], block_size, head_dim, heads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size,head_dim,heads", PRODUCTION_SHAPES)
def test_gpu_prefill_production_shapes(dtype, block_size, head_dim, heads):
    batch = ([700, 1, 300, 129], [1000, 50, 0, 3])
    run_prefill_case(torch.device("cuda"), dtype, batch, block_size, head_dim, heads)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bundled_model_shapes_fp32():
    """stories260k: fp32, 8 query heads, 4 KV heads, head_dim 8."""
    cuda = torch.device("cuda")
    run_decode_case(cuda, torch.float32, [1, 300, 17], 16, 8, (8, 4))
    run_prefill_case(cuda, torch.float32, "ragged", 16, 8, (8, 4))
    run_decode_case(cuda, torch.float32, [1, 300, 17], 16, 128, (8, 4))
    run_prefill_case(cuda, torch.float32, "ragged", 16, 128, (8, 4))


@pytest.mark.gpu
@needs_cuda
def test_gpu_store_kvcache_production_shape():
    gen = torch.Generator().manual_seed(7)
    cuda = torch.device("cuda")
    k_cache = torch.full((300, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device=cuda)
    v_cache = k_cache.clone()
    slots = torch.randperm(300 * 16, generator=gen)[:2000]
    slots[::7] = -1
    slot_mapping = slots.to(cuda)
    qkv = torch.randn((2000, 48, 128), generator=gen).to(cuda, torch.bfloat16)
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_and_prefill_capture_in_cuda_graph():
    """No host sync inside: both attention kernels can be captured and replayed."""
    gen = torch.Generator().manual_seed(8)
    cuda = torch.device("cuda")
    k_cache, v_cache, block_tables, seq_lens = make_paged_kv([900, 33, 2000], 8, 128, 16, torch.bfloat16, cuda, gen)
    q = make_query(3, 32, 8, 128, torch.bfloat16, cuda, gen)
    cu_seqlens_q = torch.tensor([0, 100, 101, 400], dtype=torch.int32, device=cuda)
    qp = make_query(400, 32, 8, 128, torch.bfloat16, cuda, gen)
    ops = TRITON_OPS
    ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.1)  # compile first
    ops.paged_prefill_attention(qp, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_d = ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.1)
        out_p = ops.paged_prefill_attention(qp, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.1)
    q.copy_(torch.randn(q.shape, generator=gen).to(cuda, q.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out_d, paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.1))
    assert_matches(out_p, paged_prefill_attention_ref(qp, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, 0.1))
