"""Temperature sampling in one pass over the logits (Gumbel-max), in Triton.

The torch sampler materialises several (B, V) fp32 tensors per step (the fp32 logits, the
scaled logits, softmax, exponential noise, the ratio) before its argmax: at B = 256 and
Qwen3's 151,936-token vocabulary each is 156 MB, about 2 GB of traffic per step. Sampling
token i with probability softmax(x / T)_i is the same as taking argmax_i(x_i / T + g_i) with
g_i independent Gumbel(0, 1) noise, which is the exponential race of the torch path in log
space (g = -log E, E ~ Exp(1)). One program per row reads the row's logits once, in their own
dtype, draws its noise from Philox (seed, element index), and keeps a running argmax.

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

from kernels.triton_common import interpreting, next_pow2


@triton.jit(do_not_specialize=["seed"])
def _gumbel_sample_kernel(
    logits_ptr, temperature_ptr, greedy_ptr, out_ptr,
    vocab, stride_row, seed,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    greedy = tl.load(greedy_ptr + row) != 0
    inv_t = 1.0 / tl.load(temperature_ptr + row)
    offs = tl.arange(0, BLOCK)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if not greedy:
            # uniform in (0, 1): Philox over (seed, row * vocab + col); -log(-log(u)) is Gumbel
            u = tl.rand(seed, row * vocab + cols)
            u = tl.maximum(u, 1e-20)
            x = x * inv_t - tl.log(-tl.log(u))
        better = x > best  # strict: the earliest chunk keeps a tie, as torch.argmax does
        best_idx = tl.where(better, cols, best_idx)
        best = tl.where(better, x, best)
    top = tl.max(best, 0)
    # the smallest column among the lanes holding the maximum
    idx = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_sample(
    logits: torch.Tensor,  # (B, V), any float dtype, unit stride along V
    temperature: torch.Tensor,  # (B,) fp32, > 0 on sampled rows
    greedy: torch.Tensor,  # (B,) bool
    seed: int,  # one per step: Philox key
) -> torch.Tensor:  # (B,) int64
    assert logits.dim() == 2 and logits.stride(-1) == 1
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    block = 64 if interpreting() else min(4096, next_pow2(vocab))
    _gumbel_sample_kernel[(batch,)](
        logits, temperature, greedy, out, vocab, logits.stride(0), seed & 0x7FFFFFFF,
        BLOCK=block, num_warps=4 if interpreting() else 8,
    )  # fmt: skip
    return out
