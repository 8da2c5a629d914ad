"""Helpers shared by the Triton kernels: launch-time facts about the device and the dtype.

Nothing here launches a kernel. The Triton interpreter (TRITON_INTERPRET=1, CPU tensors) runs
the same kernels as CUDA; the only difference it needs is `upcast_dot` below.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Streaming multiprocessors assumed when the tensors are not on a GPU (the interpreter):
# an H200, so that split counts chosen under the interpreter match the ones on the GPU.
DEFAULT_NUM_SMS = 132
LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * LOG2E)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int() of a 1-element
    array, which NumPy >= 2.4 refuses; every loop with run-time bounds then fails. Upstream
    fixed it (triton-lang/triton#9171) by taking the element first; do the same here until
    the installed Triton has the fix. Touches the interpreter only, never compiled kernels."""
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
        return  # this NumPy still converts; nothing to fix
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_picovllm_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._picovllm_fixed = True  # type: ignore[attr-defined]  # a marker that outlives a reload
    interpreter._patch_lang_tensor = patch_lang_tensor


if interpreting():
    _fix_interpreter_scalar_index()


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return DEFAULT_NUM_SMS


PDL_ENV = "PICOVLLM_PDL"  # "1": programmatic dependent launch everywhere; "0": nowhere; unset: small decode graphs
_pdl_scope: bool | None = None  # set by pdl_scope(): what launches inside it want when the variable is unset


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_wanted() -> bool:
    """The policy, before the device's say: PICOVLLM_PDL=1 everywhere, =0 nowhere; unset, only
    inside a pdl_scope(True) (the decode graphs of small batches)."""
    setting = os.environ.get(PDL_ENV)
    if setting is not None and setting != "":
        return setting == "1"
    return bool(_pdl_scope)


@contextlib.contextmanager
def pdl_scope(enabled: bool):
    """Launches (and graph captures) inside the block take programmatic dependent launch when
    `enabled`, unless PICOVLLM_PDL says otherwise. One thread captures at a time."""
    global _pdl_scope
    previous, _pdl_scope = _pdl_scope, enabled
    try:
        yield
    finally:
        _pdl_scope = previous


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later, not under the interpreter; pdl_wanted
    decides where): a kernel launched with it may start while the kernel before it in the
    stream is still finishing (once every program of that one has passed its
    `pdl_prologue`), so its launch and start-up overlap the other's tail. A CUDA graph's
    capture keeps it as a programmatic edge. The RMSNorm, q/k-norm + rotary + KV store,
    SiLU-and-mul, decode, cascade and small-batch projection kernels take it.

    By default only the decode graphs of small batches capture it (model_svc.cuda_graphs):
    it made the steps of small kernels faster but the steps of large ones slower, for reasons
    not yet measured (bench/results/pdl_h200.md; bench/NOTES.md, "Figures behind the code's choices")."""
    if device.type != "cuda" or interpreting() or not pdl_wanted():
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel that begins with `pdl_prologue(PDL)`: its PDL
    constexpr and Triton's launch_pdl option, both from use_pdl, so they always agree."""
    pdl = use_pdl(device)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Before a kernel launched with launch_pdl=PDL reads anything the kernel ahead may have
    written (the gemv requests its weights first): wait until the previous
    kernel in the stream has completed and its writes are visible (nothing before this may
    read what that kernel wrote), then let the next kernel start launching. Waiting first
    keeps at most two kernels' programs on the GPU at once. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products ("ieee"), not tf32, so fp32 matches the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype) -> bool:
    """The Triton 3.6 interpreter returns garbage for tl.dot on bf16 operands (fp16 and fp32
    are right), so under the interpreter bf16 operands are widened to fp32 before the product.
    Rounding is unchanged: the values are exactly the bf16 ones."""
    return interpreting() and dtype == torch.bfloat16


def split_p(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """bf16 keeps 8 bits of each probability, fp16 11, fp32 24. In bf16 a kernel configured
    with split_p takes P in P @ V as two bf16 terms (hi + lo, 16 bits together; see mma_pv),
    so attention rounds about as the fp32 reference does: decode does by default (it is
    memory-bound, the second product is free), prefill does not (tensor-core bound). dtype
    is the query's; over an FP8 cache the products run in fp16 (query_operand): no split."""
    return dtype == torch.bfloat16 and cache_dtype != torch.float8_e4m3fn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def fix_bf16_rounding(dtype: torch.dtype) -> bool:
    """The Triton 3.6 interpreter casts fp32 to bf16 by truncation, where the GPU (and torch)
    round to nearest even; the kernels then round by hand first (see round_to)."""
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def round_to(x, dt: tl.constexpr, FIX_BF16: tl.constexpr):
    """fp32 x rounded to dt, to nearest even. With FIX_BF16 the rounding is done on the bits,
    so the interpreter's truncating cast that follows is exact (NaN payloads aside)."""
    if FIX_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dt)


FP8_MAX = tl.constexpr(448.0)  # torch.finfo(torch.float8_e4m3fn).max


@triton.jit
def to_cache(x, cache_dt: tl.constexpr):
    """x as a KV cache of dtype cache_dt holds it. An FP8 cache (e4m3, scale 1, as vLLM's
    "fp8" without calibrated scales) takes x clamped to +-FP8_MAX and rounded to the nearest
    e4m3 value, ties to even: torch's cast of the clamped value, bit for bit. The rounding is
    done in fp32 (on the bits for normal values; for the subnormals, whose step is 2**-9, by
    adding 1.5 * 2**14 to the magnitude), so the cast that follows is exact: Triton's
    interpreter rounds FP8 casts wrongly."""
    if cache_dt == tl.float8e4nv:
        sign = (x.to(tl.float32).to(tl.int32, bitcast=True) >> 31) << 31  # x's, before arithmetic flushes it
        f = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_MAX), FP8_MAX)
        bits = f.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        tiny = ((tl.abs(f) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
        tiny = (tiny | sign).to(tl.float32, bitcast=True)  # signed on the bits: -0 stays -0
        return tl.where(tl.abs(f) < 0.015625, tiny, normal).to(cache_dt)
    return x.to(cache_dt)


@triton.jit
def query_operand(q, cache_dt: tl.constexpr):
    """The query as the products over a cache of cache_dt take it. Over an FP8 cache a 16-bit
    query goes to fp16 (clamped to its range), and each K/V tile is widened to q's dtype after
    its load: FP8 to fp16 is exact and one instruction for two values on Hopper, where widening
    to bf16 takes several (with bf16 the FP8 cache ran slower than the 16-bit one,
    bench/NOTES.md, "An FP8 KV cache"). Otherwise q as it is."""
    FP16: tl.constexpr = cache_dt == tl.float8e4nv and q.dtype != tl.float32
    if FP16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def mask_and(mask, cond):
    """mask & cond for a scalar condition cond (a comparison of program ids or bounds): the
    same select-and once compiled. Spelled as a select because the interpreter (Triton 3.6 to
    3.9) broadcasts a scalar comparison as integers, not booleans, so `mask & cond` comes out
    an int32 mask there, which Triton 3.9's interpreter refuses in loads and stores."""
    return tl.where(cond, mask, False)


@triton.jit
def row_rstd(sums_ptr, offs_m, m_mask, num_parts, hidden, eps, PARTS: tl.constexpr):
    """RMSNorm's 1 / sqrt(mean(x^2) + eps) of rows offs_m, from their sums of squares in
    num_parts parts (row-major (rows, num_parts) fp32, PARTS >= num_parts a power of two):
    the deferred norm's scale (pico_kernels.triton_splitk)."""
    offs_p = tl.arange(0, PARTS)
    sums = tl.load(
        sums_ptr + offs_m[:, None] * num_parts + offs_p[None, :],
        mask=m_mask[:, None] & (offs_p < num_parts)[None, :],
        other=0.0,
    )
    return tl.rsqrt(tl.sum(sums, axis=1) / hidden + eps)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with an fp32 result."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def mma_pv(p, v, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SPLIT_P: tl.constexpr):
    """p (rows, n) fp32 probabilities @ v (n, d) in v's dtype, fp32 result. With SPLIT_P, p is
    taken as p_hi + p_lo, both in v's dtype (p_lo = the rounding error of p_hi): a second
    tensor-core product instead of a 2^-9 relative error on every probability."""
    p_hi = p.to(v.dtype)
    out = mma(p_hi, v, PRECISION, UPCAST)
    if SPLIT_P:
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        out += mma(p_lo, v, PRECISION, UPCAST)
    return out


@triton.jit
def page_slots(table, tok, t_mask, PAGE: tl.constexpr):
    """The cache page (int64) and slot of one sequence's tokens `tok`, found through its block
    table (`table`: the sequence's row of page ids). Tokens outside t_mask read no table entry
    (page 0); t_mask None: every token is in range."""
    if t_mask is None:
        page = tl.load(table + tok // PAGE).to(tl.int64)
    else:
        page = tl.load(table + tok // PAGE, mask=t_mask, other=0).to(tl.int64)
    return page, tok % PAGE


@triton.jit
def tile_ptrs(head, page, slot, stride_b, stride_s, offs_d):
    """The (tokens, BLOCK_D) pointers of the tokens' rows in one cache (`head`: offset to the
    KV head), from page_slots' page and slot: page x the page stride + slot x the token stride."""
    return head + (page * stride_b + slot * stride_s)[:, None] + offs_d[None, :]


@triton.jit
def load_rows(ptrs, row_mask, d_mask, ROW_MASK: tl.constexpr, D_MASK: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, masking only what needs it: a mask along the head dim
    exists only when head_dim is not a power of two >= 16, so full rows keep 16-byte loads."""
    if ROW_MASK:
        if D_MASK:
            x = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=d_mask[None, :], other=0.0) if D_MASK else tl.load(ptrs)
    return x


@triton.jit
def softmax_step(qk, m_i, l_i, scale_log2):
    """One online-softmax step over a tile of raw scores qk (rows, cols), masked entries -inf,
    in base 2 with the softmax scale folded into scale_log2. Returns p (the tile's
    unnormalised probabilities), alpha (the factor rescaling the old accumulator), and the new
    running max and sum."""
    s = qk * scale_log2
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def softmax_step_safe(qk, m_i, l_i, scale_log2):
    """softmax_step for tiles in which a row may have seen no key yet (a sliding window that
    starts further on): such a row keeps m = -inf and gets p = 0, l = 0 instead of NaN."""
    s = qk * scale_log2
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m_i - shift)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
