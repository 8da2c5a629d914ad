"""The two kernels of the cascade decode attention (pico_kernels.triton_cascade, whose docstring
describes them): the prefix kernel, which reads the shared prefix once for the whole batch
(and, with the store, norms the step's q and writes its K and V), and the suffix kernel, which
reads each sequence's own tokens and combines both sides' partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pico_kernels.triton_cascade_store import normed_query_rows, store_kv_rows
from pico_kernels.triton_common import load_rows, pdl_prologue
from pico_kernels.triton_decode_tiles import attend_pages, combine_group


@triton.jit
def split_len(n, num_splits, ALIGN: tl.constexpr, MIN: tl.constexpr):
    """Tokens per piece when n tokens are cut into at most num_splits pieces: a multiple of
    ALIGN, at least MIN (a multiple of ALIGN, >= 1); the last pieces may be shorter or empty.
    Both kernels use it, so they agree on the pieces."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, num_splits), ALIGN) * ALIGN, MIN)


@triton.jit(do_not_specialize=["num_rows", "num_chunks", "num_parts", "num_seqs"],  # they change with the batch
            do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])  # slices of packed tensors  # fmt: skip
def prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, prefix_blocks_ptr,
    part_out_ptr, part_lse_ptr,
    scale_log2, num_rows, num_chunks, num_parts,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    # FUSED only: this step's projections in (q_ptr is then the raw q), the norm + rotary inputs
    k_ptr, v_ptr, q_out_ptr, q_w_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, slot_ptr,
    stride_kn, stride_kh_in, stride_vn, stride_vh_in, stride_cs, num_seqs, eps,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr,
    FUSED: tl.constexpr, HAS_NORM: tl.constexpr, FIX_BF16: tl.constexpr,
    FIX_K_CACHE: tl.constexpr, FIX_V_CACHE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    # Row tiles vary fastest: the programs reading the same chunk of K/V run side by side and
    # share it through L2.
    row_tile = tl.program_id(0)
    chunk_id = tl.program_id(1)
    kv_head = tl.program_id(2)
    num_q_heads = tl.num_programs(2) * GROUP

    prefix_len = tl.load(prefix_blocks_ptr) * PAGE
    chunk = split_len(prefix_len, num_chunks, BLOCK_N, MIN_CHUNK)
    start = chunk_id * chunk
    end = tl.minimum(start + chunk, prefix_len)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = row_tile * BLOCK_M + offs_m
    row_mask = rows < num_rows
    seq = (rows // GROUP).to(tl.int64)
    q_head = kv_head * GROUP + rows % GROUP
    if FUSED:
        # This launch also does the q/k norm + rotary + K/V store of the step, spread over the
        # chunks: chunk 0 of a (row tile, KV head) writes its q rows for the suffix kernel,
        # chunk 1 (0 when there is one) its sequences' new K and V. Every chunk norms its own
        # q rows (a few us of work, no dependency on another program).
        q = normed_query_rows(q_ptr, q_out_ptr, q_w_ptr, cos_sin_ptr, pos_ptr, seq, q_head, row_mask,
                              chunk_id == 0, eps, stride_qb, stride_qh, stride_cs, tl.num_programs(2) * GROUP,
                              BLOCK_M, BLOCK_D // 2, HAS_NORM, FIX_BF16)  # fmt: skip
        if chunk_id == tl.minimum(1, num_chunks - 1):
            store_kv_rows(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_w_ptr, cos_sin_ptr, pos_ptr, slot_ptr,
                          row_tile, kv_head, num_seqs, eps,
                          stride_kn, stride_kh_in, stride_vn, stride_vh_in, stride_cs,
                          stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          GROUP, BLOCK_M, BLOCK_D // 2, PAGE, HAS_NORM, FIX_BF16, FIX_K_CACHE, FIX_V_CACHE)  # fmt: skip
    if start < end:  # chunks past a prefix shorter than the bound (or than the chunks' minimum) return
        D_MASK: tl.constexpr = BLOCK_D != HEAD_DIM
        d_mask = offs_d < HEAD_DIM
        if not FUSED:
            # Padding rows load zeros: their scores stay finite and their stores are masked.
            q = load_rows(q_ptr + (seq * stride_qb + q_head * stride_qh)[:, None] + offs_d[None, :],
                          row_mask, d_mask, True, D_MASK)  # (BLOCK_M, BLOCK_D)  # fmt: skip

        # Every row of the block table starts with the prefix's blocks: row 0 stands for all.
        # Every tile holds at least one key (n0 < end), so no row's running max stays -inf.
        acc, m_i, l_i = attend_pages(
            q, block_tables_ptr,
            k_cache_ptr + kv_head.to(tl.int64) * stride_kh, v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
            start, end, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, PRECISION, UPCAST, SPLIT_P,
        )  # fmt: skip

        part = (seq * num_q_heads + q_head) * num_parts + chunk_id  # (BLOCK_M,)
        tl.store(part_out_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None],
                 mask=row_mask[:, None])  # fmt: skip
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit(do_not_specialize=["num_chunks", "num_splits", "num_parts", "stride_bt"])
def suffix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, prefix_blocks_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    scale_log2, num_chunks, num_splits, num_parts,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr, PREFIX_MIN_CHUNK: tl.constexpr,
    COUNTERS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr,
    FIX_BF16: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = tl.load(prefix_blocks_ptr) * PAGE
    # The prefix chunks the prefix kernel filled (the same arithmetic as there).
    prefix_used = tl.cdiv(prefix_len, split_len(prefix_len, num_chunks, PREFIX_BLOCK_N, PREFIX_MIN_CHUNK))
    suffix_len = tl.maximum(seq_len - prefix_len, 0)
    chunk = split_len(suffix_len, num_splits, BLOCK_N, BLOCK_N)
    suffix_used = tl.cdiv(suffix_len, chunk)
    start = prefix_len + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    q_heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    if split < suffix_used:
        q = tl.load(
            q_ptr + seq.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        )  # (GROUP_PAD, BLOCK_D)  # fmt: skip
        acc, m_i, l_i = attend_pages(
            q, block_tables_ptr + seq.to(tl.int64) * stride_bt,
            k_cache_ptr + kv_head.to(tl.int64) * stride_kh, v_cache_ptr + kv_head.to(tl.int64) * stride_vh, start, end,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            GROUP_PAD, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, PRECISION, UPCAST, SPLIT_P,
        )  # fmt: skip
        # A used split holds at least one key: l_i > 0. Suffix partials follow the prefix ones.
        row = (seq.to(tl.int64) * num_q_heads + q_heads) * num_parts + prefix_used + split  # (GROUP_PAD,)
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc / l_i[:, None], mask=g_mask[:, None])
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=g_mask)

    # The program that arrives last combines. Split 0 arrives even with an empty suffix (then
    # the output is the prefix's alone); the other empty splits just end.
    arrivals = tl.maximum(suffix_used, 1)
    if split < arrivals:
        # Every thread's partial stores complete before the barrier (this program's own
        # partial is read back by other threads in the combine).
        tl.debug_barrier()
        last = True
        if COUNTERS:
            # As in triton_decode: a gpu-scope acq_rel ticket releases this program's partials
            # to the last arrival and, in that one, acquires everyone else's.
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            last = ticket == arrivals - 1
        if last:
            combine_group(
                part_out_ptr, part_lse_ptr,
                (seq.to(tl.int64) * num_q_heads + kv_head * GROUP) * num_parts, num_parts, prefix_used + suffix_used,
                out_ptr + seq.to(tl.int64) * stride_ob + (kv_head * GROUP).to(tl.int64) * stride_oh, stride_oh,
                GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, BLOCK_S, FIX_BF16,
            )  # fmt: skip
            if COUNTERS:
                tl.store(counter, 0)  # every ticket is taken: ready for the next launch
