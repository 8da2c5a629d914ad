"""A probe, not the model's path: the four projections of every decoder layer at one row in
one persistent Triton launch, separated by grid barriers (bench/persistent_probe.py times it
against the model's chain of four gemv launches a layer).

G programs stay resident for the whole step. In each phase program p computes a contiguous
share of the phase's output rows over the whole of K, a chunk of rows at a time, then
arrives at a grid barrier (one counter, incremented once per program and phase). No phase
writes weights, so they can be requested ahead of the wait (PREFETCH): 0 nothing, 1 the next
phase's first chunk, 2 the whole share of the phase after next (each share one chunk, held
in registers from the request to its product), so that two phases' weights are in flight
through every barrier. A layer's phases:

    A  q|k|v    = W_qkv  . RMSNorm(d + res_b) * w_in     (program 0 writes res_a = d + res_b)
    B  o        = W_o    . qkv[:Q]                        (the attention's stand-in: its query)
    C  gate|up  = W_gu   . RMSNorm(o + res_a) * w_post   (program 0 writes res_b = o + res_a)
    D  d        = W_down . silu(gate) * up

Every product rounds where the model's kernels round (pico_kernels.triton_linear), so the
results equal the chain's up to the order of fp32 sums. Activations written by other programs
are loaded with `.cg` (past the SM's L1, which is not coherent across SMs). With ONLY >= 0 the
launch runs that one phase of layer `layer0` without barriers: the Triton interpreter runs
programs one after another and cannot run a grid barrier.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pico_kernels.triton_common import mask_and, round_to

SPIN_LIMIT = tl.constexpr(1 << 22)


@triton.jit
def _arrive(bar_ptr):
    tl.debug_barrier()  # every thread's stores of this phase are issued before the release
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(bar_ptr, target):
    """Spin until `target` arrivals; bounded, so that programs that are not all resident
    give a wrong result (which the probe's comparison catches) instead of a hung GPU."""
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tries = 0
    while (seen < target) & (tries < SPIN_LIMIT):
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        tries += 1
    tl.debug_barrier()


@triton.jit
def _tile(
    w_ptr, layer, p, c, N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, SHARE: tl.constexpr, RB: tl.constexpr
):
    """Chunk c (RB rows) of program p's rows [p * SHARE, (p + 1) * SHARE) of layer `layer`'s
    (N, K) weight, K padded to its power of two KP."""
    rows = p * SHARE + c * RB + tl.arange(0, RB)
    offs_k = tl.arange(0, KP)
    mask = ((rows < (p + 1) * SHARE) & (rows < N))[:, None] & (offs_k < K)[None, :]
    return tl.load(w_ptr + layer * (N * K) + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _project(
    w_ptr, w0, x, out_ptr, layer, p,
    N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, SHARE: tl.constexpr, RB: tl.constexpr,
    EARLY: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    """out[rows] = W[rows] . x over program p's share of rows, RB rows at a time; with EARLY
    the first chunk is w0, requested before the barrier."""
    for c in tl.static_range((SHARE + RB - 1) // RB):
        w = w0 if EARLY and c == 0 else _tile(w_ptr, layer, p, c, N, K, KP, SHARE, RB)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        rows = p * SHARE + c * RB + tl.arange(0, RB)
        mask = (rows < (p + 1) * SHARE) & (rows < N)
        tl.store(out_ptr + rows, round_to(acc, out_ptr.dtype.element_ty, FIX), mask=mask)


@triton.jit
def _normed(x_ptr, res_ptr, new_res_ptr, nw_ptr, layer, p, eps, K: tl.constexpr, FIX: tl.constexpr):
    """RMSNorm(x + res) * w of the row, rounded as the model's fused norm rounds; program 0
    writes x + res as the new residual."""
    offs = tl.arange(0, K)
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, cache_modifier=".cg").to(tl.float32)
    h = round_to(x + tl.load(res_ptr + offs, cache_modifier=".cg").to(tl.float32), dt, FIX).to(tl.float32)
    tl.store(new_res_ptr + offs, h.to(dt), mask=mask_and(offs < K, p == 0))
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
    normed = round_to(h * rstd, dt, FIX).to(tl.float32)
    w = tl.load(nw_ptr + layer * K + offs).to(tl.float32)
    return round_to(w * normed, dt, FIX).to(tl.float32)


@triton.jit
def _silu_mul(gu_ptr, K: tl.constexpr, KP: tl.constexpr, FIX: tl.constexpr):
    offs = tl.arange(0, KP)
    dt = gu_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    up = tl.load(gu_ptr + K + offs, mask=offs < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dt, FIX).to(tl.float32)
    return round_to(silu * up, dt, FIX).to(tl.float32)


@triton.jit
def _query(qkv_ptr, Q: tl.constexpr):
    return tl.load(qkv_ptr + tl.arange(0, Q), cache_modifier=".cg").to(tl.float32)


@triton.jit
def _two_ahead(
    d_ptr, res_a, res_b, qkv_ptr, o_ptr, gu_ptr, bar_ptr,
    w_qkv, w_o, w_gu, w_down, nw_in, nw_post, eps, n_layers, p, G,
    H: tl.constexpr, Q: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr, IP: tl.constexpr,
    SA: tl.constexpr, RA: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr,
    SC: tl.constexpr, RC: tl.constexpr, SD: tl.constexpr, RD: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    """PREFETCH 2: after arriving at the barrier that ends phase n, a program requests its
    whole share of phase n + 2 (every R* covers its S*), then waits; the loop carries the
    next layer's q|k|v and o shares."""
    GU: tl.constexpr = 2 * INTER
    arrivals = 0
    wa = _tile(w_qkv, 0, p, 0, QKV, H, H, SA, RA)
    wb = _tile(w_o, 0, p, 0, H, Q, Q, SB, RB)
    for layer in range(n_layers):
        nxt = (layer + 1) % n_layers
        x = _normed(d_ptr, res_b, res_a, nw_in, layer, p, eps, H, FIX)
        _project(w_qkv, wa, x, qkv_ptr, layer, p, QKV, H, H, SA, RA, True, FIX)
        _arrive(bar_ptr)
        wc = _tile(w_gu, layer, p, 0, GU, H, H, SC, RC)
        arrivals += G
        _wait(bar_ptr, arrivals)
        _project(w_o, wb, _query(qkv_ptr, Q), o_ptr, layer, p, H, Q, Q, SB, RB, True, FIX)
        _arrive(bar_ptr)
        wd = _tile(w_down, layer, p, 0, H, INTER, IP, SD, RD)
        arrivals += G
        _wait(bar_ptr, arrivals)
        x = _normed(o_ptr, res_a, res_b, nw_post, layer, p, eps, H, FIX)
        _project(w_gu, wc, x, gu_ptr, layer, p, GU, H, H, SC, RC, True, FIX)
        _arrive(bar_ptr)
        wa = _tile(w_qkv, nxt, p, 0, QKV, H, H, SA, RA)
        arrivals += G
        _wait(bar_ptr, arrivals)
        x = _silu_mul(gu_ptr, INTER, IP, FIX)
        _project(w_down, wd, x, d_ptr, layer, p, H, INTER, IP, SD, RD, True, FIX)
        _arrive(bar_ptr)
        wb = _tile(w_o, nxt, p, 0, H, Q, Q, SB, RB)
        arrivals += G
        _wait(bar_ptr, arrivals)


@triton.jit
def layers_kernel(
    d_ptr, res_a, res_b, qkv_ptr, o_ptr, gu_ptr, bar_ptr,
    w_qkv, w_o, w_gu, w_down, nw_in, nw_post, eps, layer0, n_layers,
    H: tl.constexpr, Q: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr, IP: tl.constexpr,
    SA: tl.constexpr, RA: tl.constexpr, SB: tl.constexpr, RB: tl.constexpr,
    SC: tl.constexpr, RC: tl.constexpr, SD: tl.constexpr, RD: tl.constexpr,
    PREFETCH: tl.constexpr, ONLY: tl.constexpr, FIX: tl.constexpr,
):  # fmt: skip
    """d holds the layer input (the embedding, res_b zero), and after the launch the last
    layer's down output; res_b the residual. S* / R* are each phase's rows a program (a
    share) and rows a chunk (a power of two); IP is INTER's power of two. bar_ptr: an int32
    counter, zero at the launch."""
    p = tl.program_id(0)
    G = tl.num_programs(0)
    GU: tl.constexpr = 2 * INTER
    if ONLY == 0:
        x = _normed(d_ptr, res_b, res_a, nw_in, layer0, p, eps, H, FIX)
        _project(w_qkv, 0, x, qkv_ptr, layer0, p, QKV, H, H, SA, RA, False, FIX)
    elif ONLY == 1:
        _project(w_o, 0, _query(qkv_ptr, Q), o_ptr, layer0, p, H, Q, Q, SB, RB, False, FIX)
    elif ONLY == 2:
        x = _normed(o_ptr, res_a, res_b, nw_post, layer0, p, eps, H, FIX)
        _project(w_gu, 0, x, gu_ptr, layer0, p, GU, H, H, SC, RC, False, FIX)
    elif ONLY == 3:
        _project(w_down, 0, _silu_mul(gu_ptr, INTER, IP, FIX), d_ptr, layer0, p, H, INTER, IP, SD, RD, False, FIX)
    elif PREFETCH == 2:
        _two_ahead(
            d_ptr, res_a, res_b, qkv_ptr, o_ptr, gu_ptr, bar_ptr,
            w_qkv, w_o, w_gu, w_down, nw_in, nw_post, eps, n_layers, p, G,
            H, Q, QKV, INTER, IP, SA, RA, SB, RB, SC, RC, SD, RD, FIX,
        )  # fmt: skip
    else:
        arrivals = 0
        wa = _tile(w_qkv, 0, p, 0, QKV, H, H, SA, RA)
        for layer in range(n_layers):
            x = _normed(d_ptr, res_b, res_a, nw_in, layer, p, eps, H, FIX)
            _project(w_qkv, wa, x, qkv_ptr, layer, p, QKV, H, H, SA, RA, True, FIX)
            _arrive(bar_ptr)
            wb = _tile(w_o, layer, p, 0, H, Q, Q, SB, RB) if PREFETCH else 0
            arrivals += G
            _wait(bar_ptr, arrivals)
            _project(w_o, wb, _query(qkv_ptr, Q), o_ptr, layer, p, H, Q, Q, SB, RB, PREFETCH, FIX)
            _arrive(bar_ptr)
            wc = _tile(w_gu, layer, p, 0, GU, H, H, SC, RC) if PREFETCH else 0
            arrivals += G
            _wait(bar_ptr, arrivals)
            x = _normed(o_ptr, res_a, res_b, nw_post, layer, p, eps, H, FIX)
            _project(w_gu, wc, x, gu_ptr, layer, p, GU, H, H, SC, RC, PREFETCH, FIX)
            _arrive(bar_ptr)
            wd = _tile(w_down, layer, p, 0, H, INTER, IP, SD, RD) if PREFETCH else 0
            arrivals += G
            _wait(bar_ptr, arrivals)
            x = _silu_mul(gu_ptr, INTER, IP, FIX)
            _project(w_down, wd, x, d_ptr, layer, p, H, INTER, IP, SD, RD, PREFETCH, FIX)
            _arrive(bar_ptr)
            # the next layer's first q|k|v chunk (requested in any case: the loop carries it)
            wa = _tile(w_qkv, (layer + 1) % n_layers, p, 0, QKV, H, H, SA, RA)
            arrivals += G
            _wait(bar_ptr, arrivals)
