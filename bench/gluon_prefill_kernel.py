"""A probe, not the model's path: paged prefill attention for Hopper in Gluon, the softmax
of a key tile run while the previous tile's P V product is in flight
(bench/gluon_prefill_probe.py checks it and times it against pico_kernels.triton_prefill).

The same contract, grid and tile numbering (`pico_kernels.prefill_tiles`) as the Triton kernel,
for long prompts: 16-bit queries over a cache of the same dtype, head_dim 64 or 128, no sliding
window, 128 query rows of one head a program, 8 warps.

What it changes is the schedule of a key tile. Triton waits for each warpgroup matrix product
before its result is used, so a tile's exponentials run between its two products, never
beside them (bench/NOTES.md, "Prefill attention: the launch order"). Here the products are
issued asynchronously and waited for by count, as FlashAttention-3 pipelines one warpgroup:

    S_j = Q K_j^T        issued
    O   = O * alpha_{j-1} + P_{j-1} V_{j-1}   issued
    wait for S_j; softmax(S_j) -> P_j, alpha_j   (beside the P V product)
    wait for O

K and V tiles are gathered from the pages by cp.async, K into a ring of K_STAGES (3: K_{j+2}
requested at the start of tile j; 2: once both warpgroups have S_j), V into two stages (V_{j+1}
once the product reading V_{j-1} is done). OVERLAP=False waits for S_j and P V together (the
control). Measured on an H100 it does not beat the Triton kernel (bench/NOTES.md, "Prefill
attention: the softmax beside the P V product").
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from pico_kernels.gluon_prefill import _barrier, _rows_layout, _softmax, _softmax_start, _tile_of_program
from pico_kernels.prefill_tiles import row_tiles
from pico_kernels.triton_common import LOG2E

# The cp.async copy's name after Triton 3.6.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

BLOCK_M = 128  # query rows a program: two warpgroups of 64
BLOCK_N = 128  # keys a tile
NUM_WARPS = 8


@gluon.jit
def _issue_tile(smem, head_ptr, stride_b, stride_s, table, n0, kv_end, PAGE: gl.constexpr):
    """Request the key tile starting at n0 into smem as one cp.async group (an empty group
    past the last tile, so that every tile keeps the same count of groups after it)."""
    BLOCK_N: gl.constexpr = smem.shape[0]
    HEAD_DIM: gl.constexpr = smem.shape[1]
    layout: gl.constexpr = _rows_layout(HEAD_DIM, gl.num_warps())
    if n0 < kv_end:
        tok = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        t_mask = tok < kv_end
        block = gl.load(table + tok // PAGE, mask=t_mask, other=0).to(gl.int64)
        rows = block * stride_b + (tok % PAGE) * stride_s
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        _cp_async(smem, head_ptr + gl.expand_dims(rows, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(t_mask, 1))
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, OVERLAP: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, HEAD_DIM, 16])  # fmt: skip
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = _rows_layout(HEAD_DIM, num_warps)
    tile_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)

    head = gl.program_id(0)
    kv_head = head // GROUP
    seq, row0, rows, first_pos, kv_end, full_end = _tile_of_program(cu_seqlens_q_ptr, seq_lens_ptr, num_seqs,
                                                                    BLOCK_M, BLOCK_N)  # fmt: skip
    if rows > 0:
        n_tiles = gl.cdiv(kv_end, BLOCK_N)

        # Q: loaded once, kept in shared memory as the first operand of S = Q K^T.
        offs_qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_l))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_l))
        q_rows = (row0 + offs_qm).to(gl.int64)
        q_mask = gl.expand_dims(offs_qm < rows, 1)
        q = gl.load(q_ptr + gl.expand_dims(q_rows * stride_qt + head * stride_qh, 1) + gl.expand_dims(offs_d, 0),
                    mask=q_mask, other=0.0)  # fmt: skip
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_smem_l, q)

        k_smem = gl.allocate_shared_memory(dtype, [K_STAGES, BLOCK_N, HEAD_DIM], tile_smem)
        v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], tile_smem)
        table = block_tables_ptr + seq.to(gl.int64) * stride_bt
        k_head = k_cache_ptr + kv_head.to(gl.int64) * stride_kh
        v_head = v_cache_ptr + kv_head.to(gl.int64) * stride_vh

        # Groups in issue order: K0, K1, V0, then for each tile j: K_{j+2}, V_{j+1}. So at the
        # start of tile j the two groups after V_{j-1} may still be in flight.
        _issue_tile(k_smem.index(0), k_head, stride_kb, stride_ks, table, 0, kv_end, PAGE)
        _issue_tile(k_smem.index(1), k_head, stride_kb, stride_ks, table, BLOCK_N, kv_end, PAGE)
        _issue_tile(v_smem.index(0), v_head, stride_vb, stride_vs, table, 0, kv_end, PAGE)

        offs_m, offs_n, q_pos, zeros, acc, m_i, l_i = _softmax_start(0, first_pos, BLOCK_M, BLOCK_N, HEAD_DIM, mma)

        # Tile 0: its scores alone.
        async_copy.wait_group(2)
        _barrier()
        if K_STAGES == 3:
            _issue_tile(k_smem.index(2), k_head, stride_kb, stride_ks, table, 2 * BLOCK_N, kv_end, PAGE)
        fence_async_shared()
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if K_STAGES == 2:
            _barrier()
            _issue_tile(k_smem.index(0), k_head, stride_kb, stride_ks, table, 2 * BLOCK_N, kv_end, PAGE)
        p, alpha, m_i, l_i = _softmax(s, 0, full_end, q_pos, offs_n, m_i, l_i, scale_log2)
        _issue_tile(v_smem.index(1), v_head, stride_vb, stride_vs, table, BLOCK_N, kv_end, PAGE)

        for j in range(1, n_tiles):
            k_stage = j % K_STAGES
            v_stage = 1 - j % 2  # V_{j-1}'s
            async_copy.wait_group(2)  # K_j and V_{j-1} are in
            _barrier()
            if K_STAGES == 3:  # K_{j-1}'s stage: every warpgroup is done with it
                k_next = k_smem.index((j + 2) % 3)
                _issue_tile(k_next, k_head, stride_kb, stride_ks, table, (j + 2) * BLOCK_N, kv_end, PAGE)
            fence_async_shared()
            s_j = warpgroup_mma(q_smem, k_smem.index(k_stage).permute((1, 0)), zeros, use_acc=False, is_async=True)
            acc = acc * gl.expand_dims(alpha, 1)
            pv = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(pv, v_smem.index(v_stage), acc, is_async=True)
            s_j = warpgroup_mma_wait(num_outstanding=1 if OVERLAP else 0, deps=(s_j,))
            if K_STAGES == 2:
                _barrier()  # every warpgroup is done with K_j's stage
                _issue_tile(k_smem.index(k_stage), k_head, stride_kb, stride_ks, table, (j + 2) * BLOCK_N, kv_end, PAGE)
            p, alpha, m_i, l_i = _softmax(s_j, j * BLOCK_N, full_end, q_pos, offs_n, m_i, l_i, scale_log2)
            acc, pv = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pv))
            _barrier()  # and with V_{j-1}'s
            _issue_tile(v_smem.index(v_stage), v_head, stride_vb, stride_vs, table, (j + 1) * BLOCK_N, kv_end, PAGE)

        # The last tile's P V.
        async_copy.wait_group(2)
        _barrier()
        fence_async_shared()
        acc = acc * gl.expand_dims(alpha, 1)
        pv = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(pv, v_smem.index((n_tiles - 1) % 2), acc, is_async=True)
        acc, pv = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pv))
        async_copy.wait_group(0)

        out = (acc / gl.expand_dims(l_i, 1)).to(dtype)
        offs_od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
        o_rows = (row0 + offs_m).to(gl.int64)
        o_ptrs = out_ptr + gl.expand_dims(o_rows * stride_ot + head * stride_oh, 1) + gl.expand_dims(offs_od, 0)
        gl.store(o_ptrs, out, mask=gl.expand_dims(offs_m < rows, 1))


def prefill(
    q: torch.Tensor,  # (Nq, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: torch.Tensor,  # (B + 1,) int32
    seq_lens: torch.Tensor,  # (B,) int32
    scale: float,
    out: torch.Tensor,  # (Nq, Hq, D)
    overlap: bool = True,
    k_stages: int = 3,
) -> torch.Tensor:
    """The launch: 16-bit q and cache of one dtype, head_dim 64 or 128, rows contiguous."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    num_tiles = row_tiles(num_tokens, num_seqs, BLOCK_M)
    _prefill_kernel[(num_q_heads, num_tiles)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, K_STAGES=k_stages, OVERLAP=overlap, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
