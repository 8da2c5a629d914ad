"""Paged prefill attention for Hopper (sm_90) in Gluon, with FlashAttention-3's split of the
warps: what `pico_kernels.triton_prefill.prefill_with_config` launches by default where it
applies (`applies`: 16-bit queries over a cache of their dtype, head_dim 64 or 128, no sliding
window, pages that divide a 128-key tile, contiguous caches). bench/results/gluon_prefill_ws_h100.md
measures it at 1.47-1.59x the Triton kernel.

The same contract, grid and tile numbering (`pico_kernels.prefill_tiles`) as the Triton kernel,
128 query rows of one head a program. No barrier spans the program:

    producer (1 warp)      fills K and V stages by TMA, one [PAGE, D] box a page (eight a
                           128-key tile of 16-token pages), each stage signalled by an mbarrier
                           when its bytes land
    consumer 0 (4 warps)   query rows 0-63 of the tile
    consumer 1 (4 warps)   query rows 64-127

Each consumer waits only for the stage it reads and frees it with an arrive, so the two
warpgroups drift apart; they take turns issuing their products (PINGPONG), so that one's
exponentials run while the other's products hold the tensor cores. Within a consumer the scores
of tile j are issued before the P V product of tile j - 1 (OVERLAP). Both are on by default;
off, they are the controls of bench/gluon_prefill_probe.py.

Keys past the sequence's end: their pages are read from block 0 (every page of a tile is one
box, so each stage expects the same bytes), and in the last tile the producer zeroes the V
rows past the end before it signals the stage, since a zero probability times a stale NaN is
NaN; K's are masked out of the scores.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pico_kernels.prefill_tiles import find_seq, row_tiles
from pico_kernels.triton_common import LOG2E

# Names that changed after Triton 3.6: the TMA load and the CTA barrier.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

BLOCK_M = gl.constexpr(128)  # query rows a program
HALF = gl.constexpr(64)  # a consumer warpgroup's
BLOCK_N = gl.constexpr(128)  # keys a tile
NUM_WARPS = 4  # the default partition: consumer 0
# Registers a thread, set by warpgroup out of maxnreg x 3 warpgroups: the default partition
# gets what the workers leave (168 x 3 - 232 - 40 = 232).
MAXNREG = 168


@gluon.constexpr_function
def _rows_layout(head_dim, num_warps):
    """The cp.async tiles' layout: 16 bytes a thread, a row over head_dim / 8 threads."""
    tpr = head_dim // 8
    return gl.BlockedLayout([1, 8], [32 // tpr, tpr], [num_warps, 1], [1, 0])


@gluon.jit
def _tile_of_program(cu_seqlens_q_ptr, seq_lens_ptr, num_seqs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The program's row tile, numbered as the Triton kernel numbers them: its sequence, its
    first query row, the rows left from there (<= 0: a spare program), the context position
    of its first row, one past the last key any row sees, and where the causal mask starts."""
    tile_id = gl.num_programs(1) - 1 - gl.program_id(1)
    seq = find_seq(cu_seqlens_q_ptr, num_seqs, tile_id, BLOCK_M)
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m_start = (tile_id - (q_start // BLOCK_M + seq)) * BLOCK_M
    first_pos = gl.load(seq_lens_ptr + seq) - q_len + m_start
    kv_end = gl.minimum(first_pos + BLOCK_M, first_pos + q_len - m_start)  # and the sequence's end
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # key tiles below it need no mask
    return seq, q_start + m_start, q_len - m_start, first_pos, kv_end, full_end


@gluon.jit
def _softmax(s, n0, full_end, q_pos, offs_n, m_i, l_i, scale_log2):
    """One online-softmax step over raw scores s (causal mask on tiles from full_end on), the
    scale applied after the row max. Returns p, alpha and the new max (raw) and sum."""
    if n0 >= full_end:
        visible = gl.expand_dims(n0 + offs_n, 0) <= gl.expand_dims(q_pos, 1)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new * scale_log2, 1))
    alpha = gl.exp2((m_i - m_new) * scale_log2)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _softmax_start(
    row0, first_pos, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, mma: gl.constexpr
):
    """The online softmax's start for ROWS query rows from row0 of the tile in the products'
    layout: row and key offsets, the rows' context positions, a zero score tile, and the
    accumulator, max and sum."""
    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    zeros = gl.zeros([ROWS, BLOCK_N], gl.float32, mma)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, mma))
    return offs_m, offs_n, first_pos + offs_m, zeros, acc, m_i, l_i


@gluon.jit
def _release(bar):
    """Every warp of this consumer is done with the stage; one arrival frees it for it."""
    _barrier()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _take_turn(turn, half: gl.constexpr, k, PINGPONG: gl.constexpr):
    """Round k of issuing products: consumer 0 first, then the two alternate."""
    if PINGPONG:
        mbarrier.wait(turn.index(half), (k + 1 - half) & 1)


@gluon.jit
def _pass_turn(turn, half: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - half), count=1)


@gluon.jit
def _zero_rows_from(buf, valid):
    """Zero the rows of a [BLOCK_N, D] stage from `valid` on, 8 rows a plain load and store
    (one warp), fenced for the tensor cores' reads."""
    ROWS: gl.constexpr = buf.shape[0]
    HEAD_DIM: gl.constexpr = buf.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [1, 1], [1, 0])
    for r in gl.static_range(ROWS // 8):
        if r * 8 + 8 > valid:
            piece = buf.slice(r * 8, 8)
            rows = r * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
            x = piece.load(layout)
            piece.store(gl.where(gl.expand_dims(rows < valid, 1), x, gl.zeros_like(x)))
    fence_async_shared()


@gluon.jit
def _load_pages(desc, buf, bar, table, n0, kv_end, col):
    """One tile's pages into a stage, a box a page; pages past kv_end read block 0."""
    PAGE: gl.constexpr = desc.block_type.shape[0]
    mbarrier.expect(bar, buf.shape[0] * buf.shape[1] * buf.dtype.primitive_bitwidth // 8)
    for p in gl.static_range(buf.shape[0] // PAGE):
        tok = n0 + p * PAGE
        block = gl.load(table + tok // PAGE, mask=tok < kv_end, other=0)
        _tma_load(desc, [block * PAGE, col], bar, buf.slice(p * PAGE, PAGE))


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, bars, tail, table, kv_end, n_tiles, col):
    k_ready, k_empty, v_ready, v_empty, _ = bars
    STAGES: gl.constexpr = k_smem.shape[0]
    for j in range(n_tiles):
        st = j % STAGES
        ph = (j // STAGES) & 1
        n0 = j * BLOCK_N
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        _load_pages(k_desc, k_smem.index(st), k_ready.index(st), table, n0, kv_end, col)
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        if n0 + BLOCK_N <= kv_end:
            _load_pages(v_desc, v_smem.index(st), v_ready.index(st), table, n0, kv_end, col)
        else:  # the last tile, partly past the end: zeroed past it before it is signalled
            _load_pages(v_desc, v_smem.index(st), tail.index(0), table, n0, kv_end, col)
            mbarrier.wait(tail.index(0), 0)
            _zero_rows_from(v_smem.index(st), kv_end - n0)
            mbarrier.arrive(v_ready.index(st), count=1)


@gluon.jit
def _consumer(
    half: gl.constexpr, q_ptr, out_ptr, q_smem, k_smem, v_smem, bars, head, row0, rows, first_pos, full_end, n_tiles,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    k_ready, k_empty, v_ready, v_empty, turn = bars
    dtype: gl.constexpr = k_smem.dtype
    STAGES: gl.constexpr = k_smem.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.shape[2]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = _rows_layout(HEAD_DIM, 4)

    # This warpgroup's 64 query rows, in its own shared buffer as the first operand of Q K^T.
    m0 = half * HALF
    offs_qm = m0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, rows_l))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_l))
    q_rows = (row0 + offs_qm).to(gl.int64)
    q = gl.load(q_ptr + gl.expand_dims(q_rows * stride_qt + head * stride_qh, 1) + gl.expand_dims(offs_d, 0),
                mask=gl.expand_dims(offs_qm < rows, 1), other=0.0)  # fmt: skip
    q_tile = q_smem.index(half)
    q_tile.store(q)
    fence_async_shared()
    _barrier()

    offs_m, offs_n, q_pos, zeros, acc, m_i, l_i = _softmax_start(m0, first_pos, HALF, BLOCK_N, HEAD_DIM, mma)

    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(turn, half, 0, PINGPONG)
    s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zeros, use_acc=False, is_async=True)
    _pass_turn(turn, half, PINGPONG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    _release(k_empty.index(0))
    p, alpha, m_i, l_i = _softmax(s, 0, full_end, q_pos, offs_n, m_i, l_i, scale_log2)

    for j in range(1, n_tiles):
        st = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        _take_turn(turn, half, j, PINGPONG)
        s_j = warpgroup_mma(q_tile, k_smem.index(st).permute((1, 0)), zeros, use_acc=False, is_async=True)
        acc = acc * gl.expand_dims(alpha, 1)
        pv = gl.convert_layout(p.to(dtype), a_layout)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(pv, v_smem.index(prev), acc, is_async=True)
        _pass_turn(turn, half, PINGPONG)
        s_j = warpgroup_mma_wait(num_outstanding=1 if OVERLAP else 0, deps=(s_j,))
        _release(k_empty.index(st))
        p, alpha, m_i, l_i = _softmax(s_j, j * BLOCK_N, full_end, q_pos, offs_n, m_i, l_i, scale_log2)
        acc, pv = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pv))
        _release(v_empty.index(prev))

    last = (n_tiles - 1) % STAGES
    acc = acc * gl.expand_dims(alpha, 1)
    pv = gl.convert_layout(p.to(dtype), a_layout)
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    _take_turn(turn, half, n_tiles, PINGPONG)
    acc = warpgroup_mma(pv, v_smem.index(last), acc, is_async=True)
    _pass_turn(turn, half, PINGPONG)
    acc, pv = warpgroup_mma_wait(num_outstanding=0, deps=(acc, pv))
    _release(v_empty.index(last))

    out = (acc / gl.expand_dims(l_i, 1)).to(dtype)
    offs_od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    o_rows = (row0 + offs_m).to(gl.int64)
    o_ptrs = out_ptr + gl.expand_dims(o_rows * stride_ot + head * stride_oh, 1) + gl.expand_dims(offs_od, 0)
    gl.store(o_ptrs, out, mask=gl.expand_dims(offs_m < rows, 1))


@gluon.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_ws_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    scale_log2, num_seqs, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
    GROUP: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr, PINGPONG: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    head = gl.program_id(0)
    seq, row0, rows, first_pos, kv_end, full_end = _tile_of_program(cu_seqlens_q_ptr, seq_lens_ptr, num_seqs,
                                                                    BLOCK_M, BLOCK_N)  # fmt: skip
    if rows > 0:
        n_tiles = gl.cdiv(kv_end, BLOCK_N)
        table = block_tables_ptr + seq.to(gl.int64) * stride_bt

        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], q_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        tail = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers
            mbarrier.init(v_empty.index(i), count=2)
        mbarrier.init(tail.index(0), count=1)
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        bars = (k_ready, k_empty, v_ready, v_empty, turn)
        gl.warp_specialize(
            [
                (_consumer, (0, q_ptr, out_ptr, q_smem, k_smem, v_smem, bars, head, row0, rows, first_pos, full_end,
                             n_tiles, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, OVERLAP, PINGPONG)),
                (_consumer, (1, q_ptr, out_ptr, q_smem, k_smem, v_smem, bars, head, row0, rows, first_pos, full_end,
                             n_tiles, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, OVERLAP, PINGPONG)),
                (_producer, (k_desc, v_desc, k_smem, v_smem, bars, tail, table, kv_end, n_tiles,
                             (head // GROUP) * HEAD_DIM)),
            ],
            [4, 1],  # consumer 1, the producer
            [232, 40],
        )  # fmt: skip


def applies(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int) -> bool:
    """Whether this kernel can take the launch: a Hopper GPU (sm_90), q 16-bit with the caches
    of its dtype and contiguous, head_dim 64 or 128, pages that divide a key tile, no window."""
    return (
        q.is_cuda
        and _capability(q.device) == (9, 0)
        and q.dtype in (torch.bfloat16, torch.float16)
        and k_cache.dtype == v_cache.dtype == q.dtype
        and q.shape[-1] in (64, 128)
        and BLOCK_N.value % k_cache.shape[1] == 0
        and window == 0
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def cache_descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over one cache, (num_blocks, PAGE, Hkv, D) seen as rows of Hkv x D, one
    page of one KV head a box."""
    num_blocks, page, num_kv_heads, head_dim = cache.shape
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[cache.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([page, head_dim], dtype)
    rows = cache.view(num_blocks * page, num_kv_heads * head_dim)
    return TensorDescriptor.from_tensor(rows, [page, head_dim], layout)


def paged_prefill(
    q: torch.Tensor,  # (Nq, Hq, D), rows contiguous
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D), contiguous
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: torch.Tensor,  # (B + 1,) int32
    seq_lens: torch.Tensor,  # (B,) int32
    scale: float,
    out: torch.Tensor,  # (Nq, Hq, D)
    stages: int = 3,
    overlap: bool = True,
    pingpong: bool = True,
) -> torch.Tensor:
    """The launch, where `applies`; stages: K and V stages (2 or 3)."""
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    num_tiles = row_tiles(num_tokens, num_seqs, BLOCK_M.value)  # a plain int for the grid
    _prefill_ws_kernel[(num_q_heads, num_tiles)](
        q, cache_descriptor(k_cache), cache_descriptor(v_cache), block_tables, cu_seqlens_q, seq_lens, out,
        scale * LOG2E, num_seqs, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, STAGES=stages, OVERLAP=overlap, PINGPONG=pingpong,
        num_warps=NUM_WARPS, maxnreg=MAXNREG,
    )  # fmt: skip
    return out
