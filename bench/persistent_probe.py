"""Does one persistent launch beat the chain of four gemv launches a decoder layer, at batch 1?

bench/persistent_kernel.py runs the four projections of all 28 layers of Qwen3-0.6B (random
bf16 weights, 881 MB a step, from HBM) in one launch of G resident programs with a grid
barrier between phases; the chain is the model's kernels, rms_norm_gemv / gemv / rms_norm_gemv
/ gemv(silu_mul) a layer, 112 launches in a CUDA graph with programmatic dependent launch.
Both take the same input row and must give the same output (up to the order of fp32 sums).
Attention is left out of both (phase B projects the query itself), so the figures are the
projections' share of the step.

    python bench/persistent_probe.py check                      # the CPU (interpreter) check
    python bench/persistent_probe.py gpu [--out results.md]     # on a GPU: the timings
    python bench/persistent_probe.py phases [--out results.md]  # on a Hopper GPU: a phase's parts

The GPU run first times a kernel that does nothing but the barriers (its count also checks
that a scalar atomic counts once a program), then each (programs, warps, prefetch) variant in
a child process of its own (one that does not finish is reported, not waited on); every child
also times the chain, so each row compares figures of one process. Where more than one
program shares an SM, the compile caps the registers a thread at what lets them all be
resident (the regs column then reads at most the cap; spills are the price). Prefetch 3 and
up is bench/persistent_tma_kernel.py's Gluon launch (Hopper only) with 2 ** (prefetch - 3)
boxes a stage: warps are its consumer's, beside one producer warp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, environment, ulps, write_result  # noqa: E402
from bench.persistent_kernel import _arrive, _wait, layers_kernel  # noqa: E402
from pico_kernels.triton_common import cdiv, fix_bf16_rounding, next_pow2  # noqa: E402

QWEN3 = dict(L=28, H=1024, Q=2048, QKV=4096, INTER=3072)  # Qwen3-0.6B's layers
TINY = dict(L=2, H=64, Q=128, QKV=256, INTER=96)  # an intermediate size that is no power of two
VARIANTS = [(256, 4, 1), (256, 4, 2), (128, 4, 3), (128, 4, 4), (128, 4, 5), (64, 4, 5)]
# prefetch values from TMA on name bench/persistent_tma_kernel.py's Gluon launch (Hopper), with
# 2 ** (prefetch - TMA) boxes a stage; its ring holds TMA_BOXES [8, 256] boxes (192 KB)
TMA = 3
TMA_BOXES = 48
EPS = 1e-6
CHUNK_ELEMS = 128  # weight elements a thread loads in one chunk of rows


@triton.jit
def barrier_kernel(bar_ptr, out_ptr, n):
    """n grid barriers and nothing else; out[p] = the count program p saw at the last one."""
    G = tl.num_programs(0)
    for i in range(n):
        _arrive(bar_ptr)
        _wait(bar_ptr, (i + 1) * G)
    tl.store(out_ptr + tl.program_id(0), tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu"))


def make_weights(s: dict, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    L, H, Q, QKV, INTER = s["L"], s["H"], s["Q"], s["QKV"], s["INTER"]
    return dict(
        w_qkv=randn(L, QKV, H, scale=H**-0.5),
        w_o=randn(L, H, Q, scale=Q**-0.5),
        w_gu=randn(L, 2 * INTER, H, scale=H**-0.5),
        w_down=randn(L, H, INTER, scale=INTER**-0.5),
        nw_in=1.0 + randn(L, H, scale=0.1),
        nw_post=1.0 + randn(L, H, scale=0.1),
        d0=randn(1, H),
    )


def chain(w: dict, s: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's kernels a layer: (the last down output, the residual)."""
    from pico_kernels.triton_linear import gemv, rms_norm_gemv

    d, res = w["d0"], None
    for layer in range(s["L"]):
        qkv, res = rms_norm_gemv(d, res, w["nw_in"][layer], EPS, w["w_qkv"][layer])
        o = gemv(qkv[:, : s["Q"]], w["w_o"][layer])
        gu, res = rms_norm_gemv(o, res, w["nw_post"][layer], EPS, w["w_gu"][layer])
        d = gemv(gu, w["w_down"][layer], silu_mul=True)
    return d, res


class Persistent:
    """The buffers and launch of layers_kernel for G programs."""

    def __init__(self, w: dict, s: dict, programs: int, warps: int, prefetch: int, maxnreg: int | None = None):
        self.w, self.s, self.G, self.prefetch = w, s, programs, prefetch
        self.options = dict(num_warps=warps) | (dict(maxnreg=maxnreg) if maxnreg else {})
        dev, H = w["d0"].device, s["H"]
        new = lambda n: torch.zeros((1, n), device=dev, dtype=torch.bfloat16)  # noqa: E731
        self.d, self.res_a, self.res_b = new(H), new(H), new(H)
        self.qkv, self.o, self.gu = new(s["QKV"]), new(H), new(2 * s["INTER"])
        self.bar = torch.zeros(1, device=dev, dtype=torch.int32)
        shares = [cdiv(n, programs) for n in (s["QKV"], H, 2 * s["INTER"], H)]
        ks = [H, s["Q"], H, next_pow2(s["INTER"])]
        # rows a chunk: a power of two that divides the share, at most CHUNK_ELEMS a thread;
        # with PREFETCH 2 the whole share, padded to its power of two
        if prefetch == 2:
            chunk = [next_pow2(share) for share in shares]
        else:
            chunk = [min(share & -share, CHUNK_ELEMS * 32 * warps // k) for share, k in zip(shares, ks)]
        self.meta = dict(
            H=H, Q=s["Q"], QKV=s["QKV"], INTER=s["INTER"], IP=ks[3],
            SA=shares[0], RA=chunk[0], SB=shares[1], RB=chunk[1], SC=shares[2], RC=chunk[2], SD=shares[3], RD=chunk[3],
            PREFETCH=prefetch, FIX=fix_bf16_rounding(torch.bfloat16),
        )  # fmt: skip

    def reset(self) -> None:
        self.d.copy_(self.w["d0"])
        self.res_b.zero_()
        self.bar.zero_()

    def args(self, layer0: int, n_layers: int) -> tuple:
        w = self.w
        return (
            self.d, self.res_a, self.res_b, self.qkv, self.o, self.gu, self.bar,
            w["w_qkv"], w["w_o"], w["w_gu"], w["w_down"], w["nw_in"], w["nw_post"], EPS, layer0, n_layers,
        )  # fmt: skip

    def launch(self, only: int = -1, layer0: int = 0) -> None:
        layers_kernel[(self.G,)](*self.args(layer0, self.s["L"]), **self.meta, ONLY=only, **self.options)

    def run_phases(self) -> None:
        """Phase by phase, one launch each (the interpreter's way: no barrier to cross)."""
        self.reset()
        for layer in range(self.s["L"]):
            for phase in range(4):
                self.launch(only=phase, layer0=layer)

    def compiled(self):
        kernel = layers_kernel.warmup(*self.args(0, self.s["L"]), **self.meta, ONLY=-1, **self.options, grid=(self.G,))
        kernel._init_handles()  # loads it: the register and spill counts come with the load
        return kernel


def check(programs: tuple[int, ...] = (3, 5)) -> list[tuple[str, float, float]]:
    """In the interpreter at TINY's shapes, against the chain: phase by phase for each program
    count, and the whole launch, barriers included, for one program at each PREFETCH (one
    program crosses each barrier by its own arrival). (what ran, max ulps of the output, of
    the residual) each."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    w = make_weights(TINY, "cpu")
    ref_d, ref_res = chain(w, TINY)
    found = []
    for g in programs:
        p = Persistent(w, TINY, g, 4, 1)
        p.run_phases()
        found.append((f"G={g} phase by phase", ulps(p.d, ref_d), ulps(p.res_b, ref_res)))
    for prefetch in (0, 1, 2):
        p = Persistent(w, TINY, 1, 4, prefetch)
        p.reset()
        p.launch()
        found.append((f"G=1 one launch, PREFETCH {prefetch}", ulps(p.d, ref_d), ulps(p.res_b, ref_res)))
    for what, ulps_d, ulps_res in found:
        print(f"{what}: max ulps d {ulps_d:.1f}, residual {ulps_res:.1f}")
    return found


def resident_programs(kernel, warps: int, device: torch.device) -> int:
    """How many programs of the compiled kernel the GPU holds at once (registers, shared
    memory, warps): a grid barrier needs every program resident."""
    props = torch.cuda.get_device_properties(device)
    regs_per_warp = cdiv(kernel.n_regs * 32, 256) * 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * warps)
    by_warps = props.max_threads_per_multi_processor // (32 * warps)
    shared = kernel.metadata.shared
    by_shared = props.shared_memory_per_multiprocessor // shared if shared else by_warps
    return min(by_regs, by_warps, by_shared) * props.multi_processor_count


def register_cap(programs: int, warps: int, device: torch.device) -> int | None:
    """The registers a thread may take for all programs to be resident (None: no cap below the
    255 that a thread can address)."""
    props = torch.cuda.get_device_properties(device)
    per_sm = cdiv(programs, props.multi_processor_count)
    cap = props.regs_per_multiprocessor // (per_sm * warps * 32) // 8 * 8
    return cap if cap < 255 else None


def graph_us(step, reset, steps: int = 10, replays: int = 20, repeats: int = 3) -> float:
    """Median over repeats of the device time of one (reset, step) pair in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        reset()
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            reset()
            step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (steps * replays))
    return sorted(times)[len(times) // 2]


def tma_launcher(p: Persistent, work: int = 2):
    """The launch of the Gluon kernel over p's buffers and weights (p's shares and prefetch)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from bench.persistent_tma_kernel import KB, RB, tma_layers_kernel

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    stacked = [p.w[k].view(-1, p.w[k].shape[-1]) for k in ("w_qkv", "w_o", "w_gu", "w_down")]
    descs = [TensorDescriptor.from_tensor(t, [RB.value, KB.value], layout) for t in stacked]
    args = (p.d, p.res_a, p.res_b, p.qkv, p.o, p.gu, p.bar, *descs, p.w["nw_in"], p.w["nw_post"], EPS, p.s["L"])
    meta = {k: p.meta[k] for k in ("H", "Q", "QKV", "INTER", "IP", "SA", "SB", "SC", "SD")}
    boxes = 2 ** (p.prefetch - TMA)
    return lambda: tma_layers_kernel[(p.G,)](
        *args, **meta, STAGES=TMA_BOXES // boxes, BOXES=boxes, WORK=work, num_warps=p.options["num_warps"]
    )


def variant(programs: int, warps: int, prefetch: int) -> dict:
    """One child's row: compile, check residency, check the output, time it and the chain."""
    os.environ["PICOVLLM_PDL"] = "1"
    w = make_weights(QWEN3, "cuda")
    ref_d, ref_res = chain(w, QWEN3)
    row = dict(G=programs, warps=warps, prefetch=prefetch)
    if prefetch >= TMA:  # one program an SM (its shared memory), so all resident where G <= SMs
        p = Persistent(w, QWEN3, programs, warps, prefetch)
        launch = tma_launcher(p)
        row["resident"] = torch.cuda.get_device_properties(ref_d.device).multi_processor_count
    else:
        p = Persistent(w, QWEN3, programs, warps, prefetch, register_cap(programs, warps, ref_d.device))
        launch = p.launch
        kernel = p.compiled()
        row |= dict(regs=kernel.n_regs, spills=kernel.n_spills)
        row["resident"] = resident_programs(kernel, warps, ref_d.device)
    chain_reset = lambda: p.bar.zero_()  # noqa: E731  (the same small memsets as the kernel's reset)
    row["chain_us"] = graph_us(lambda: chain(w, QWEN3), lambda: (p.d.copy_(w["d0"]), p.res_b.zero_(), chain_reset()))
    row["reset_us"] = graph_us(lambda: None, p.reset)
    if row["resident"] < programs:
        return row | dict(note="not all programs resident: not launched")
    p.reset()
    launch()
    torch.cuda.synchronize()
    row["ulps_d"], row["ulps_res"] = ulps(p.d, ref_d), ulps(p.res_b, ref_res)
    row["barriers_seen"] = p.bar.item()
    row["persistent_us"] = graph_us(launch, p.reset)
    return row


def barrier_us(programs: int, warps: int, n: int = 112) -> tuple[float, bool]:
    bar = torch.zeros(1, device="cuda", dtype=torch.int32)
    out = torch.zeros(programs, device="cuda", dtype=torch.int32)
    launch = lambda: barrier_kernel[(programs,)](bar, out, n, num_warps=warps)  # noqa: E731
    bar.zero_()
    launch()
    torch.cuda.synchronize()
    counted_once = bool((out == n * programs).all().item())
    return graph_us(launch, bar.zero_), counted_once


def gpu(out: str | None) -> None:
    env = environment()
    bw = copy_bandwidth(torch.device("cuda"))
    weight_bytes = 2 * QWEN3["L"] * QWEN3["H"] * (QWEN3["QKV"] + QWEN3["Q"] + 3 * QWEN3["INTER"])
    lines = [
        f"Weights a step: {weight_bytes / 1e6:.0f} MB; copy bandwidth {bw / 1e12:.2f} TB/s (read + written), "
        f"so the weights take {weight_bytes / bw * 1e6:.0f} us at it.",
        "",
        "Barriers alone (112 a step, one launch):",
        "",
    ]
    for programs, warps in sorted({(g, wp) for g, wp, pf in VARIANTS if pf < TMA}):
        us, once = barrier_us(programs, warps)
        lines.append(f"- {programs} programs x {warps} warps: {us:.1f} us ({us / 112:.2f} us a barrier); "
                     f"each program counted once: {once}")  # fmt: skip
        print(lines[-1], flush=True)
    lines += [
        "",
        "| programs | warps | prefetch | regs | spills | resident | chain us | persistent us | "
        "reset us | chain / persistent (reset off) | max ulps d / residual | barrier count |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for programs, warps, prefetch in VARIANTS:
        cmd = [sys.executable, __file__, "variant", str(programs), str(warps), str(prefetch)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            rows = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(rows[-1]) if rows else dict(note=f"exit {done.returncode}: {done.stderr[-300:]!r}")
        except subprocess.TimeoutExpired:
            row = dict(note="did not finish in 120 s")
        print(row, flush=True)
        g = lambda k, f="{:.1f}", row=row: f.format(row[k]) if k in row else "-"  # noqa: E731
        ratio = "-"
        if "persistent_us" in row:
            ratio = f"{(row['chain_us'] - row['reset_us']) / (row['persistent_us'] - row['reset_us']):.2f}x"
        lines.append(
            f"| {programs} | {warps} | {prefetch} | {g('regs', '{}')} | {g('spills', '{}')} | {g('resident', '{}')} | "
            f"{g('chain_us')} | {g('persistent_us')} | {g('reset_us')} | {ratio} | "
            f"{g('ulps_d')} / {g('ulps_res')} | {g('barriers_seen', '{}')} |"
        )
        if "note" in row:
            lines.append(f"|  |  |  |  |  |  |  |  |  |  | {row['note']} |  |")
    print("\n".join(lines))
    if out:
        write_result(out, "One persistent launch for all layers' projections vs the gemv chain (batch 1)", env,
                     "\n".join(lines))  # fmt: skip


def phases(out: str | None, programs: int = 128) -> None:
    """Where a phase of the Gluon launch goes (one box a stage): timed crossing the barriers
    only (WORK 0), also putting each phase's input row (1), and whole (2), beside the chain."""
    os.environ["PICOVLLM_PDL"] = "1"
    env = environment()
    w = make_weights(QWEN3, "cuda")
    p = Persistent(w, QWEN3, programs, 4, TMA)
    chain_us = graph_us(lambda: chain(w, QWEN3), lambda: (p.d.copy_(w["d0"]), p.res_b.zero_(), p.bar.zero_()))
    reset_us = graph_us(lambda: None, p.reset)
    lines = [
        f"{programs} programs, 4 consumer warps and a producer warp each, one [8, 256] box a stage; "
        f"112 phases a step; the chain of gemv launches {chain_us:.1f} us, the reset {reset_us:.1f} us.",
        "",
        "| work a phase | us a step (reset off) | us a phase |",
        "| --- | ---: | ---: |",
    ]
    what = ["the grid barrier only", "+ the input row read, normed and put", "+ the products (the whole launch)"]
    for work in (0, 1, 2):
        us = graph_us(tma_launcher(p, work), p.reset) - reset_us
        lines.append(f"| {what[work]} | {us:.1f} | {us / 112:.2f} |")
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if out:
        write_result(out, "Where a phase of the persistent Gluon launch goes (batch 1)", env, "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["check", "gpu", "variant", "phases"])
    ap.add_argument("params", nargs="*", type=int, help="variant: programs warps prefetch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.mode == "check":
        check()
    elif args.mode == "gpu":
        gpu(args.out)
    elif args.mode == "phases":
        phases(args.out)
    else:
        print(json.dumps(variant(*args.params)), flush=True)


if __name__ == "__main__":
    main()
