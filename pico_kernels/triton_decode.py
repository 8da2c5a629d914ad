"""Paged decode attention in Triton: split-KV (flash-decoding) with GQA packing, one launch.

One program handles (split, KV head, sequence): the query heads that share the KV head are
packed as the rows of one tile, so each K/V tile is read from memory once for the whole group.
The sequence's context is cut into `num_splits` chunks (chosen at run time, see
`pick_num_splits`). With one split the program writes the output itself. With more, every
program writes its chunk's normalised partial output and log-sum-exp to scratch, then takes a
ticket from an arrival counter of its (sequence, KV head); the program that arrives last
combines the group's partials, writes the output and sets the counter back to zero for the
next launch (so the counters live across launches and CUDA graph replays; see
`arrival_counters`). There is no second kernel. With a sliding window the context is the
last `window` tokens only: the splits cut that, and no earlier table entry is read.

Contract: `paged_decode_attention` has the signature and semantics of
`pico_kernels.reference.paged_decode_attention_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pico_kernels.triton_common import (
    LOG2E,
    cdiv,
    dot_precision,
    fix_bf16_rounding,
    interpreting,
    mask_and,
    next_pow2,
    num_sms,
    pdl_launch,
    pdl_prologue,
    round_to,
    split_p,
    upcast_dot,
    use_pdl,
)
from pico_kernels.triton_decode_lanes import attend_pages_lanes
from pico_kernels.triton_decode_tiles import attend_pages, combine_group

# Heuristic constants of pick_num_splits (see its docstring).
PROGRAMS_PER_SM = 2
MAX_SPLITS = 256


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_n: int  # context tokens per loop step (any multiple of 16; pages may be smaller or larger)
    num_warps: int
    num_stages: int
    split_p: bool = True  # bf16: P @ V with P as two bf16 terms (pico_kernels.triton_common.mma_pv)
    programs_per_sm: float = PROGRAMS_PER_SM  # the launch pick_num_splits aims at
    lanes: bool = False  # attend_pages_lanes (CUDA-core products; one warp a program)


# The lanes loop's config (DecodeConfig.lanes): 16-token tiles, one warp, 16 programs an SM.
LANES = DecodeConfig(block_n=16, num_warps=1, num_stages=1, split_p=False, programs_per_sm=16, lanes=True)


def default_decode_config(
    dtype: torch.dtype,
    head_dim: int,
    batch: int = 0,
    pdl: bool = False,
    cache_dtype: torch.dtype | None = None,
    group: int = 0,
    num_kv_heads: int = 0,
    sms: int = 132,
) -> DecodeConfig:
    """16-bit: 64-token tiles (32 for head_dim > 128), num_stages=5. The pipeliner spends one
    stage on the block-table load that the K/V addresses depend on, so 5 stages give two K/V
    buffers in flight (3 would give one). One sequence launched with programmatic dependent
    launch (batch 1, pdl, head_dim <= 128): 16-token tiles, 2 warps, splits for ~6 programs
    an SM. Smaller programs and more of them were faster in the model at every context
    measured (512, 4k, 16k tokens; bench/NOTES.md, "Batch-1 decode: the weights before the
    wait, small attention programs"), though slower than the 64-token tiles alone at long
    contexts: presumably the projection programs that PDL starts beside them find room to
    fetch their weights. fp32 (the bundled model, CPU-sized): 16-token tiles, which keep its
    fp32 products free of register spills. The interpreter uses 16-token tiles so that small
    test shapes span several tiles and pages.

    An FP8 cache (cache_dtype) under GQA groups of 1 or 2 (group) with (sequence, KV head)
    pairs for at least 3/4 of a wave of LANES programs (16 an SM of sms SMs: 128 registers a
    lane, as many as the register file holds): attend_pages_lanes, one warp a program. Each
    program waits on every 16-token tile's loads, so the loop needs the SMs full without
    splitting the sequences; on the H200 it beat the tensor-core loop over the same cache at
    256 and 512 sequences of 8 KV heads and lost at 128 and below (bench/NOTES.md, "An FP8
    KV cache")."""
    fp8 = cache_dtype == torch.float8_e4m3fn
    if fp8 and 1 <= group <= 2 and 4 * batch * num_kv_heads >= 3 * LANES.programs_per_sm * sms:
        return LANES
    if interpreting() or dtype == torch.float32:
        return DecodeConfig(block_n=16, num_warps=4, num_stages=3)
    block_d = max(16, next_pow2(head_dim))
    if batch == 1 and pdl and block_d <= 128:
        return DecodeConfig(block_n=16, num_warps=2, num_stages=5, programs_per_sm=6)
    return DecodeConfig(block_n=64 if block_d <= 128 else 32, num_warps=4, num_stages=5)


def pick_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = 132,
    block_n: int = 64,
    programs_per_sm: float = PROGRAMS_PER_SM,
) -> int:
    """Number of KV splits per (sequence, KV head) for the decode kernel.

    The decode kernel launches batch * num_kv_heads * num_splits programs. The split count is
    the one that brings that nearest to programs_per_sm (PROGRAMS_PER_SM, 2, but for the
    batch-1 config) programs per SM:

        num_splits = round(programs_per_sm * num_sms / (batch * num_kv_heads))

    clamped to [1, ceil(max_seq_len / block_n)] (a split shorter than one tile only adds
    partials to combine) and to MAX_SPLITS (256). Why two per SM: an SM holds three decode
    programs at once (72 KB of shared memory each), each keeping two K/V tiles in flight,
    which is enough to saturate memory; aiming at two leaves room for rounding up without a
    second, mostly idle wave of programs; measured against more programs per SM in
    bench/NOTES.md, "Figures behind the code's choices".

    On an H200 (132 SMs) with 8 KV heads: B=1 (its config: 6 an SM, 16-token tiles) -> 99
    splits (about 330 tokens each at L=32k; 64 one-tile splits at L=1k); B=8 -> 4; B=16 -> 2;
    B>=23 -> 1 (nothing to combine).

    max_seq_len may be an upper bound (the decode wrapper passes block_tables.shape[1] *
    block_size, known on the host without a device sync, so the choice is CUDA-graph safe);
    chunks are sized per sequence from its own length, so shorter sequences just leave their
    last splits empty.
    """
    num_programs = max(1, batch * num_kv_heads)
    splits = int(programs_per_sm * num_sms / num_programs + 0.5)
    splits = min(splits, cdiv(max(1, max_seq_len), block_n), MAX_SPLITS)
    return max(1, splits)


@triton.jit
def _attend(
    q, table, k_head, v_head, start, end,
    stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr, LANES_R: tl.constexpr,
):  # fmt: skip
    """The decode kernel's loop: attend_pages_lanes when LANES_R > 0 (DecodeConfig.lanes), else
    attend_pages."""
    if LANES_R > 0:
        return attend_pages_lanes(
            q, table, k_head, v_head, start, end, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            BLOCK_N, LANES_R, BLOCK_D, HEAD_DIM, PAGE,
        )  # fmt: skip
    else:
        return attend_pages(
            q, table, k_head, v_head, start, end, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            q.shape[0], BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, PRECISION, UPCAST, SPLIT_P,
        )  # fmt: skip


@triton.jit
def _store_partial(
    acc, m_i, l_i, part_out_ptr, part_lse_ptr, counter_ptr, out_ptr, stride_oh, ctx_len, chunk, num_splits,
    split, kv_head, seq, q_heads, g_mask,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    FIX_BF16: tl.constexpr,
):  # fmt: skip
    """Several splits: the split's normalised partial and log-sum-exp to scratch, then a ticket;
    the last to arrive of its (sequence, KV head) combines them into the output (out_ptr: the
    sequence's row)."""
    BLOCK_D: tl.constexpr = acc.shape[1]
    offs_d = tl.arange(0, BLOCK_D)
    num_q_heads = tl.num_programs(1) * GROUP
    # Only the first num_used splits hold keys (fewer than num_splits when the sequence is
    # shorter than the longest; none when seq_len is 0): the others store no partials, and
    # the combine reads only these.
    num_used = tl.cdiv(ctx_len, tl.maximum(chunk, 1))
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l = 0 only in unused splits
    out = acc / l_safe[:, None]
    lse = m_i + tl.log2(l_safe)
    row = (seq.to(tl.int64) * num_q_heads + q_heads) * num_splits + split  # (GROUP_PAD,)
    used = mask_and(g_mask, split < num_used)
    tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out, mask=used[:, None])
    tl.store(part_lse_ptr + row, lse, mask=used)

    # Every thread's partial stores complete before the barrier; one thread then takes a
    # ticket with a gpu-scope acq_rel atomic, which releases them to the program that
    # arrives last and, in that program, acquires everyone else's (each ticket is both).
    # Only the splits that hold keys take one (split 0 alone for seq_len 0, to write the
    # zeros): an empty split (a sequence shorter than the graph's width allows) just ends.
    arrivals = tl.maximum(num_used, 1)
    if split < arrivals:
        tl.debug_barrier()
        counter = counter_ptr + seq * tl.num_programs(1) + kv_head
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == arrivals - 1:
            combine_group(
                part_out_ptr, part_lse_ptr,
                (seq.to(tl.int64) * num_q_heads + kv_head * GROUP) * num_splits, num_splits, num_used,
                out_ptr + (kv_head * GROUP).to(tl.int64) * stride_oh, stride_oh,
                GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, BLOCK_S, FIX_BF16,
            )  # fmt: skip
            tl.store(counter, 0)  # every ticket is taken: ready for the next launch


@triton.jit(do_not_specialize=["num_splits", "window", "stride_bt"])  # eager batches have a per-step table width
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    scale_log2, num_splits, window,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr,
    FIX_BF16: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr, WINDOWED: tl.constexpr, LANES_R: tl.constexpr,
):  # fmt: skip
    """Before `pdl_prologue`, what the kernel ahead does not write: the sequence's length (a
    step input)."""
    split, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = tl.maximum(seq_len - window, 0) if WINDOWED else 0  # the first key the query sees
    ctx_len = seq_len - ctx_start
    chunk = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
    start = ctx_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    q_heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    pdl_prologue(PDL)

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # (GROUP_PAD, BLOCK_D)  # fmt: skip
    acc, m_i, l_i = _attend(
        q, table, k_head, v_head, start, end, stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
        BLOCK_N, BLOCK_D, HEAD_DIM, PAGE, PRECISION, UPCAST, SPLIT_P, LANES_R,
    )  # fmt: skip

    out_row = out_ptr + seq.to(tl.int64) * stride_ob
    if DIRECT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # seq_len 0 (padding rows): zeros
        tl.store(out_row + q_heads[:, None] * stride_oh + offs_d[None, :],
                 round_to(out, out_ptr.dtype.element_ty, FIX_BF16), mask=g_mask[:, None] & d_mask[None, :])  # fmt: skip
    else:
        _store_partial(
            acc, m_i, l_i, part_out_ptr, part_lse_ptr, counter_ptr, out_row, stride_oh, ctx_len, chunk, num_splits,
            split, kv_head, seq, q_heads, g_mask, GROUP, GROUP_P2, HEAD_DIM, BLOCK_S, FIX_BF16,
        )  # fmt: skip


# Arrival counters of the split kernel, one zeroed int32 per (sequence, KV head), per device.
# Every launch leaves them at zero, so one buffer serves all launches and graph replays. It is
# allocated (and grown) only outside CUDA graph capture in the normal flow: the engine runs an
# eager call of the same or a larger shape before it captures, and the minimum size covers
# batch 512 x 128 KV heads. A grown-out buffer is kept alive, since a graph captured earlier
# still points at it.
MIN_ARRIVAL_COUNTERS = 65536
_ARRIVAL_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    counters = _ARRIVAL_COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(needed, MIN_ARRIVAL_COUNTERS), dtype=torch.int32, device=device)
        _ARRIVAL_COUNTERS[device] = counters
    return counters


def decode_with_config(
    q: torch.Tensor,  # (B, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    seq_lens: torch.Tensor,  # (B,) int32
    scale: float,
    config: DecodeConfig | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # (B, Hq, D), contiguous; allocated when None
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # (B, Hq, D), dtype of q
    """paged_decode_attention with an explicit tile config, split count and output buffer (for
    tests and benchmarks); None picks the defaults."""
    batch, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache rows must be contiguous"
    if config is None:
        config = default_decode_config(
            q.dtype, head_dim, batch, use_pdl(q.device), k_cache.dtype, num_q_heads // num_kv_heads, num_kv_heads,
            num_sms(q.device),
        )  # fmt: skip
    if num_splits is None:
        max_len = block_tables.shape[1] * page  # host-known bound: no device sync
        if window > 0:
            max_len = min(max_len, window)
        num_splits = pick_num_splits(
            batch, num_kv_heads, max_len, num_sms(q.device), config.block_n, config.programs_per_sm
        )

    group = num_q_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    # The lanes that share one token's row (16 bytes each) and the tokens a warp reads side by side.
    lanes_r = min(config.block_n, max(1, 32 // max(1, block_d * k_cache.element_size() // 16))) if config.lanes else 0
    assert not config.lanes or (group <= 2 and config.num_warps == 1), "the lanes loop: 1-2 query rows, one warp"
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused
        counters = seq_lens  # unused
    else:
        part_out = torch.empty((batch, num_q_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        counters = arrival_counters(q.device, batch * num_kv_heads)
    # The combine's (GROUP_P2, BLOCK_S, BLOCK_D) tile of partials: at most 8k fp32 (64 registers
    # a thread at 4 warps) and 32 splits. Each chunk of splits costs an L2 round trip, so
    # chunks are as large as that allows; a 64-split tile was slower (bench/NOTES.md).
    group_p2 = next_pow2(group)
    block_s = max(1, min(32, (2048 if config.lanes else 8192) // (block_d * group_p2)))

    _decode_split_kernel[(num_splits, num_kv_heads, batch)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_lse, counters,
        scale * LOG2E, num_splits, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=next_pow2(group) if config.lanes else max(16, next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, BLOCK_N=config.block_n,
        DIRECT=direct, PRECISION=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype),
        SPLIT_P=config.split_p and split_p(q.dtype, k_cache.dtype),
        FIX_BF16=fix_bf16_rounding(q.dtype), GROUP_P2=group_p2, BLOCK_S=block_s,
        **pdl_launch(q.device), WINDOWED=window > 0, LANES_R=lanes_r,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def paged_decode_attention(
    q: torch.Tensor,  # (B, Hq, D): one query token per sequence (the last position)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    seq_lens: torch.Tensor,  # (B,) int32, >= 1
    scale: float,
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # (B, Hq, D), dtype of q
    """Triton version of pico_kernels.reference.paged_decode_attention_ref."""
    return decode_with_config(q, k_cache, v_cache, block_tables, seq_lens, scale, window=window)
