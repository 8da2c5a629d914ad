"""Temperature sampling in one pass over the logits (Gumbel-max), in Triton.

The torch sampler materialises several (B, V) fp32 tensors per step (the fp32 logits, the
scaled logits, softmax, exponential noise, the ratio) before its argmax: at B = 256 and
Qwen3's 151,936-token vocabulary each is 156 MB, about 2 GB of traffic per step. Sampling
token i with probability softmax(x / T)_i is the same as taking argmax_i(x_i / T + g_i) with
g_i independent Gumbel(0, 1) noise, which is the exponential race of the torch path in log
space (g = -log E, E ~ Exp(1)). The logits are read once, in their own dtype; the noise comes
from Philox keyed by (seed, row, column), four uniforms per Philox call (the noise, not the
loads, bounds this kernel), so a draw does not depend on how the work is split.

Two launches. The vocabulary of each row is cut into `num_chunks` column ranges, one program
each, which keep a running argmax and write their best value and column; a second kernel, one
program per row, picks the best of its chunks (with one chunk a row the first kernel writes
the draw and the second is not launched). One program per row (the first version) left
the GPU mostly idle below a few hundred rows, compute-bound on the noise (bench/NOTES.md);
chunks give every batch size about PROGRAMS_PER_SM programs per SM.

Rows marked greedy take the plain argmax (first index among equal maxima, as torch.argmax).
Rows with top-k, top-p, min-p, penalties, logprobs or their own seeded generator stay on the
torch path (model_svc.sampler decides).

Contract: `gumbel_sample(logits, temperature, greedy, seed)` -> (B,) int64 token ids, greedy
rows equal to logits.argmax(-1), the others distributed as softmax(logits / temperature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pico_kernels.triton_common import cdiv, interpreting, next_pow2, num_sms

PROGRAMS_PER_SM = 4  # resident programs of 8 warps per SM, enough to hide Philox and the loads
BLOCK = 2048  # columns per loop step on a GPU


def pick_num_chunks(batch: int, vocab: int, block: int, num_sms: int) -> int:
    """Column ranges per row: about PROGRAMS_PER_SM programs per SM in all, none shorter than
    one block of columns. On an H200 (132 SMs), V = 151,936: B = 1 -> 75 chunks of 2,048
    columns, B = 64 -> 8, B = 256 -> 2, B >= 528 -> 1."""
    chunks = int(PROGRAMS_PER_SM * num_sms / max(1, batch) + 0.5)
    return max(1, min(chunks, cdiv(vocab, block)))


@triton.jit
def _consider(base, cols, last, u, inv_t, greedy, best, best_idx):
    """One quarter block: the Gumbel-perturbed logits of columns `cols` (noise from uniforms
    u) against the running best of each lane."""
    x = tl.load(base + cols, mask=cols < last, other=float("-inf")).to(tl.float32)
    # -log(-log(u)) is Gumbel(0, 1); greedy rows keep the plain logits
    x = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(tl.maximum(u, 1e-20))))
    better = x > best  # strict: the earliest column of a lane keeps a tie, as torch.argmax does
    return tl.where(better, x, best), tl.where(better, cols, best_idx)


@triton.jit(do_not_specialize=["vocab", "stride_row", "seed", "chunk"])
def _gumbel_chunk_kernel(
    logits_ptr, temperature_ptr, greedy_ptr, best_ptr, best_idx_ptr, out_ptr, seed_ptr,
    vocab, stride_row, seed, chunk,
    BLOCK: tl.constexpr, FINAL: tl.constexpr, SEED_PTR: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    part = tl.program_id(1)
    if SEED_PTR:  # the key in device memory (a CUDA graph's input), as the int32 the argument is
        seed = tl.load(seed_ptr).to(tl.int32)
    greedy = tl.load(greedy_ptr + row) != 0
    inv_t = 1.0 / tl.load(temperature_ptr + row)
    QUARTER: tl.constexpr = BLOCK // 4
    quad = tl.arange(0, QUARTER)
    base = logits_ptr + row.to(tl.int64) * stride_row
    first = part * chunk
    last = tl.minimum(first + chunk, vocab)
    # Philox gives four uniforms per counter: counter (row, start / 4 + i) serves column
    # start + j * QUARTER + i for j = 0..3. Blocks start at multiples of BLOCK whatever the
    # chunking, so every column always gets the same uniform.
    counter0 = row * tl.cdiv(vocab, 4)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32) + first  # a chunk of only -inf (or NaN) reports its first column
    for start in range(first, last, BLOCK):
        u0, u1, u2, u3 = tl.rand4x(seed, counter0 + start // 4 + quad)
        cols = start + quad
        best, best_idx = _consider(base, cols, last, u0, inv_t, greedy, best, best_idx)
        best, best_idx = _consider(base, cols + QUARTER, last, u1, inv_t, greedy, best, best_idx)
        best, best_idx = _consider(base, cols + 2 * QUARTER, last, u2, inv_t, greedy, best, best_idx)
        best, best_idx = _consider(base, cols + 3 * QUARTER, last, u3, inv_t, greedy, best, best_idx)
    top = tl.max(best, 0)
    # the smallest column among the lanes holding the maximum
    idx = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    if FINAL:  # one chunk a row: this is the draw
        tl.store(out_ptr + row, idx.to(tl.int64))
    else:
        out = row * tl.num_programs(1) + part
        tl.store(best_ptr + out, top)
        tl.store(best_idx_ptr + out, idx)


@triton.jit(do_not_specialize=["num_chunks"])
def _gumbel_pick_kernel(best_ptr, best_idx_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    mask = offs < num_chunks
    best = tl.load(best_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    idx = tl.load(best_idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(best, 0)
    # chunks are in column order and each reports its first maximum: the smallest column wins
    pick = tl.min(tl.where((best == top) & mask, idx, 2147483647), 0)
    tl.store(out_ptr + row, pick.to(tl.int64))


def gumbel_sample(
    logits: torch.Tensor,  # (B, V), any float dtype, unit stride along V
    temperature: torch.Tensor,  # (B,) fp32, > 0 on sampled rows
    greedy: torch.Tensor,  # (B,) bool
    seed: int | torch.Tensor,  # one per step: Philox key in [0, 2**31), or a (1,) int64 device tensor holding it
    num_chunks: int | None = None,  # column ranges per row; None: pick_num_chunks
    out: torch.Tensor | None = None,  # (B,) int64 to write the draws into
) -> torch.Tensor:  # (B,) int64
    """A seed tensor is read by the kernel, so a captured launch takes each step's key from
    memory; the draws equal those of the same key given as an int."""
    assert logits.dim() == 2 and logits.stride(-1) == 1
    batch, vocab = logits.shape
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    # The interpreter runs programs one after another and pays per operation, not per lane:
    # wide blocks and one chunk a row unless a test asks for more.
    block = 256 if interpreting() else max(64, min(BLOCK, next_pow2(vocab)))
    if num_chunks is None:
        num_chunks = 1 if interpreting() else pick_num_chunks(batch, vocab, block, num_sms(logits.device))
    chunk = cdiv(cdiv(vocab, num_chunks), block) * block  # whole blocks; the last chunk may be short
    num_chunks = cdiv(vocab, chunk)  # none empty
    final = num_chunks == 1
    if final:  # the chunk kernel writes the draws: no scratch (its pointers go unused)
        best = best_idx = out
    else:
        best = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
        best_idx = torch.empty((batch, num_chunks), dtype=torch.int32, device=logits.device)
    seed_ptr = isinstance(seed, torch.Tensor)
    _gumbel_chunk_kernel[(batch, num_chunks)](
        logits, temperature, greedy, best, best_idx, out, seed if seed_ptr else out,
        vocab, logits.stride(0), 0 if seed_ptr else seed & 0x7FFFFFFF, chunk,
        BLOCK=block, FINAL=final, SEED_PTR=seed_ptr, num_warps=4 if interpreting() else 8,
    )  # fmt: skip
    if final:
        return out
    # CHUNKS bounds num_chunks for any batch of this vocabulary: one compiled pick kernel
    _gumbel_pick_kernel[(batch,)](
        best, best_idx, out, num_chunks, CHUNKS=max(2, next_pow2(cdiv(vocab, block))), num_warps=1
    )
    return out
