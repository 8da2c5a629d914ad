"""A probe, not the model's path: bench/persistent_kernel.py's four projections of every layer at
one row in one persistent launch with grid barriers, in Gluon for Hopper, the weights streamed
into shared memory by TMA from a producer warp that runs ahead of the barriers.

In the Triton probe the weights of the next phase are requested into registers before each
wait, which holds at most one phase's share and loses to the chain of gemv launches. Here each
program (one an SM) splits its warps:

    producer (1 warp)     walks the program's weight boxes of every phase of every layer in
                          order, BOXES [RB, KB] boxes into each stage of a ring of STAGES,
                          waiting only for that stage to be freed: no phase writes weights, so
                          it runs up to STAGES stages ahead, through the grid barriers
    consumer (4 warps)    per phase: waits at the grid barrier, computes the phase's input
                          row into shared memory, then for each RB-row group of its share
                          multiplies the stages as they land, frees each, and stores the
                          group's outputs; arrives at the barrier

The phases and their rounding are the Triton probe's (A q|k|v of the normed residual, B o of
the query, C gate|up of the normed residual, D down of silu(gate) * up). Shares: every
phase's rows divide evenly over the G programs in groups of RB, and every K is a multiple of KB.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from pico_kernels.gluon_prefill import _barrier, _tma_load

RB = gl.constexpr(8)  # weight rows a box
KB = gl.constexpr(256)  # weight columns a box (512 bytes: an unswizzled box)
SPIN_LIMIT = gl.constexpr(1 << 22)


@gluon.constexpr_function
def _box_layout(num_warps):
    """A [RB, KB] box in registers: 8 contiguous values a thread, a row over a warp."""
    return gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _row_layout(num_warps):
    return gl.BlockedLayout([4], [32], [num_warps], [0])


@gluon.jit
def _stream(desc, ring, ready, empty, i, row0, ROWS: gl.constexpr, K: gl.constexpr):
    """The producer's stages of one phase: rows [row0, row0 + ROWS) of desc's weight, BOXES
    boxes of KB columns a stage; i counts stages over the launch."""
    STAGES: gl.constexpr = ready.shape[0]
    BOXES: gl.constexpr = ring.shape[0] // STAGES
    for g in range(ROWS // RB):
        for kb in range(K // (KB * BOXES)):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), BOXES * RB * KB * 2)
            for b in gl.static_range(BOXES):
                _tma_load(desc, [row0 + g * RB, (kb * BOXES + b) * KB], ready.index(s), ring.index(s * BOXES + b))
            i += 1
    return i


@gluon.jit
def _producer(
    dq, do, dgu, dd, ring, ready, empty, n_layers, p, SA: gl.constexpr, SB: gl.constexpr, SC: gl.constexpr,
    SD: gl.constexpr, H: gl.constexpr, Q: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr,
    WORK: gl.constexpr,
):  # fmt: skip
    i = 0
    for layer in range(n_layers if WORK == 2 else 0):
        i = _stream(dq, ring, ready, empty, i, layer * QKV + p * SA, SA, H)
        i = _stream(do, ring, ready, empty, i, layer * H + p * SB, SB, Q)
        i = _stream(dgu, ring, ready, empty, i, layer * 2 * INTER + p * SC, SC, H)
        i = _stream(dd, ring, ready, empty, i, layer * H + p * SD, SD, INTER)


@gluon.jit
def _project(ring, ready, empty, xbuf, out_ptr, i, row0, ROWS: gl.constexpr, K: gl.constexpr, num_warps: gl.constexpr):
    """The consumer's side of _stream: out[row0 + r] = W[r] . x for the program's ROWS rows, x
    the phase's input in xbuf; returns the stage count."""
    STAGES: gl.constexpr = ready.shape[0]
    BOXES: gl.constexpr = ring.shape[0] // STAGES
    box: gl.constexpr = _box_layout(num_warps)
    dt: gl.constexpr = out_ptr.dtype.element_ty
    for g in range(ROWS // RB):
        acc = gl.zeros([RB, KB], gl.float32, box)
        for kb in gl.static_range(K // (KB * BOXES)):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            for b in gl.static_range(BOXES):
                w = ring.index(s * BOXES + b).load(box).to(gl.float32)
                x = xbuf.slice((kb * BOXES + b) * KB, KB).load(gl.SliceLayout(0, box))
                acc += w * gl.expand_dims(x, 0)
            _barrier()  # every warp has read the stage
            mbarrier.arrive(empty.index(s), count=1)
            i += 1
        rows = row0 + g * RB + gl.arange(0, RB, layout=gl.SliceLayout(1, box))
        gl.store(out_ptr + rows, gl.sum(acc, 1).to(dt))
    return i


@gluon.jit
def _grid_barrier(bar_ptr, target):
    """Arrive, then spin until `target` arrivals (bounded, as in the Triton probe); the arrival's
    own count is the first look."""
    _barrier()
    seen = gl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") + 1
    tries = 0
    while (seen < target) & (tries < SPIN_LIMIT):
        seen = gl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        tries += 1
    _barrier()


@gluon.jit
def _put(xbuf, x):
    """The phase's input row into shared memory for every consumer warp."""
    xbuf.slice(0, x.shape[0]).store(x)
    _barrier()


@gluon.jit
def _normed(x_ptr, res_ptr, new_res_ptr, nw_ptr, layer, p, eps, H: gl.constexpr, num_warps: gl.constexpr):
    """RMSNorm(x + res) * w, rounded as the Triton probe's; program 0 writes x + res."""
    offs = gl.arange(0, H, layout=_row_layout(num_warps))
    dt: gl.constexpr = x_ptr.dtype.element_ty
    x = gl.load(x_ptr + offs, cache_modifier=".cg").to(gl.float32)
    h = (x + gl.load(res_ptr + offs, cache_modifier=".cg").to(gl.float32)).to(dt).to(gl.float32)
    gl.store(new_res_ptr + offs, h.to(dt), mask=(offs < H) & (p == 0))
    rstd = gl.rsqrt(gl.sum(h * h, axis=0) / H + eps)
    normed = (h * rstd).to(dt).to(gl.float32)
    w = gl.load(nw_ptr + layer * H + offs).to(gl.float32)
    return (w * normed).to(dt).to(gl.float32)


@gluon.jit
def _silu_mul(gu_ptr, INTER: gl.constexpr, IP: gl.constexpr, num_warps: gl.constexpr):
    offs = gl.arange(0, IP, layout=_row_layout(num_warps))
    dt: gl.constexpr = gu_ptr.dtype.element_ty
    gate = gl.load(gu_ptr + offs, mask=offs < INTER, other=0.0, cache_modifier=".cg").to(gl.float32)
    up = gl.load(gu_ptr + INTER + offs, mask=offs < INTER, other=0.0, cache_modifier=".cg").to(gl.float32)
    silu = (gate / (1.0 + gl.exp(-gate))).to(dt).to(gl.float32)
    return (silu * up).to(dt).to(gl.float32)


@gluon.jit
def _phase(ring, ready, empty, xbuf, x, out_ptr, i, row0, ROWS: gl.constexpr, K: gl.constexpr, bar_ptr, target,
           WORK: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """One phase of the consumer: its input row x put, its share projected, the barrier
    crossed; WORK 0 only crosses, 1 also puts the input (bench/persistent_probe.py phases)."""
    if WORK >= 1:
        _put(xbuf, x)
    if WORK == 2:
        i = _project(ring, ready, empty, xbuf, out_ptr, i, row0, ROWS, K, num_warps)
    _grid_barrier(bar_ptr, target)
    return i


@gluon.jit
def _consumer(
    d_ptr, res_a, res_b, qkv_ptr, o_ptr, gu_ptr, bar_ptr, nw_in, nw_post, eps, n_layers, ring, ready, empty, xbuf,
    p, G, SA: gl.constexpr, SB: gl.constexpr, SC: gl.constexpr, SD: gl.constexpr, H: gl.constexpr,
    Q: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, IP: gl.constexpr, WORK: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    i = 0
    t = 0  # arrivals at the grid barrier once the phase is crossed
    rows_l: gl.constexpr = _row_layout(num_warps)
    for layer in range(n_layers):
        x = _normed(d_ptr, res_b, res_a, nw_in, layer, p, eps, H, num_warps)
        t += G
        i = _phase(ring, ready, empty, xbuf, x, qkv_ptr, i, p * SA, SA, H, bar_ptr, t, WORK, num_warps)
        x = gl.load(qkv_ptr + gl.arange(0, Q, layout=rows_l), cache_modifier=".cg").to(gl.float32)
        t += G
        i = _phase(ring, ready, empty, xbuf, x, o_ptr, i, p * SB, SB, Q, bar_ptr, t, WORK, num_warps)
        x = _normed(o_ptr, res_a, res_b, nw_post, layer, p, eps, H, num_warps)
        t += G
        i = _phase(ring, ready, empty, xbuf, x, gu_ptr, i, p * SC, SC, H, bar_ptr, t, WORK, num_warps)
        x = _silu_mul(gu_ptr, INTER, IP, num_warps)
        t += G
        i = _phase(ring, ready, empty, xbuf, x, d_ptr, i, p * SD, SD, INTER, bar_ptr, t, WORK, num_warps)


@gluon.jit
def tma_layers_kernel(
    d_ptr, res_a, res_b, qkv_ptr, o_ptr, gu_ptr, bar_ptr, dq, do, dgu, dd, nw_in, nw_post, eps, n_layers,
    H: gl.constexpr, Q: gl.constexpr, QKV: gl.constexpr, INTER: gl.constexpr, IP: gl.constexpr,
    SA: gl.constexpr, SB: gl.constexpr, SC: gl.constexpr, SD: gl.constexpr, STAGES: gl.constexpr,
    BOXES: gl.constexpr, WORK: gl.constexpr = 2, num_warps: gl.constexpr = 4,
):  # fmt: skip
    """The buffers as the Triton probe's layers_kernel takes them; dq, do, dgu, dd: TMA
    descriptors over the stacked weights as (layers x N, K), [RB, KB] boxes; S*: each phase's
    rows a program (multiples of RB); STAGES stages of BOXES boxes each (BOXES dividing every
    K / KB); bar_ptr: an int32 counter, zero at the launch. WORK below 2 leaves the weights
    unread and the outputs unwritten, to time the rest of a phase."""
    p = gl.program_id(0)
    G = gl.num_programs(0)
    ring = gl.allocate_shared_memory(dq.dtype, [STAGES * BOXES, RB, KB], dq.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xbuf = gl.allocate_shared_memory(gl.float32, [IP], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize(
        [
            (_consumer, (d_ptr, res_a, res_b, qkv_ptr, o_ptr, gu_ptr, bar_ptr, nw_in, nw_post, eps, n_layers,
                         ring, ready, empty, xbuf, p, G, SA, SB, SC, SD, H, Q, QKV, INTER, IP, WORK, num_warps)),
            (_producer, (dq, do, dgu, dd, ring, ready, empty, n_layers, p, SA, SB, SC, SD, H, Q, QKV, INTER, WORK)),
        ],
        [1],
        [40],
    )  # fmt: skip
