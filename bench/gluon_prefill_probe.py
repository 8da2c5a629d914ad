"""The Hopper prefill kernels (the probe bench/gluon_prefill_kernel.py, the default
pico_kernels.gluon_prefill and its controls) against the Triton kernel, on a GPU.

    python bench/gluon_prefill_probe.py [--rep MS] [--out bench/results/gluon_prefill_ws_h100.md]

Checks them against the torch reference on ragged batches (cached prefixes, shuffled pages,
GQA, head_dim 64 and 128, bf16 and fp16; every cache slot past a sequence's end, and every
spare page, NaN), then times them at the prefill shapes of bench/attention.py (a 4k prompt with
0 and 3k cached, 32 query and 8 KV heads, D 128, 16-token pages), a batch of eight 512-token
prompts and a 16k prompt: the first probe (the softmax beside P V, cp.async, two K stages), and
the warp-specialised kernel (a TMA producer warp, two consumer warpgroups on mbarriers taking
turns to issue their products) with its three stages, with two, and as controls without the
turns and with the overlap within a consumer off. Timing as
bench/attention.py: do_bench's median, a cold L2 each call.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402

from bench import gluon_prefill_kernel as gluon_prefill  # noqa: E402
from bench.attention import causal_flops  # noqa: E402
from bench.kernel_setup import bench_ms, rel_err  # noqa: E402
from pico_kernels import gluon_prefill as ws  # noqa: E402
from pico_kernels.reference import paged_prefill_attention_ref  # noqa: E402
from pico_kernels.triton_prefill import default_prefill_config, prefill_with_config  # noqa: E402

PAGE = 16
TRITON = default_prefill_config(torch.bfloat16, 128)  # the Triton kernel's default 128 x 128 tiles
# The probes, each a launch of (q, k, v, table, cu, lens, scale, out).
PROBES = {
    "cp.async": partial(gluon_prefill.prefill, k_stages=2),
    "WS": ws.paged_prefill,
    "WS 2 stages": partial(ws.paged_prefill, stages=2),
    "WS no ping-pong": partial(ws.paged_prefill, pingpong=False),
    "WS no overlap": partial(ws.paged_prefill, overlap=False),
}


def ragged(q_lens, cached, hq, hkv, d, dtype, gen):
    """A shuffled page pool holding the batch's sequences, their new tokens' queries; the
    slots past each sequence's end and the spare pages hold NaN, which no kernel may read."""
    seq_lens = [q + c for q, c in zip(q_lens, cached)]
    blocks = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    k = torch.full((num_blocks, PAGE, hkv, d), float("nan"), dtype=dtype, device="cuda")
    v = torch.full_like(k, float("nan"))
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros((len(q_lens), max(blocks)), dtype=torch.int32, device="cuda")
    at = 0
    for b, (n, length) in enumerate(zip(blocks, seq_lens)):
        table[b, :n] = perm[at : at + n]
        at += n
        pages = table[b, :n].long()
        for cache in (k, v):
            rows = torch.randn((n * PAGE, hkv, d), dtype=dtype, device="cuda", generator=gen)
            rows[length:] = float("nan")
            cache[pages] = rows.view(n, PAGE, hkv, d)
    q = torch.randn((sum(q_lens), hq, d), dtype=dtype, device="cuda", generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, k, v, table, cu, lens


def check(gen) -> list[str]:
    cases = [
        ([1], [0], 32, 8, 128, torch.bfloat16),
        ([5, 128, 129, 300], [17, 0, 300, 1000], 32, 8, 128, torch.bfloat16),
        ([700, 1, 64], [0, 4000, 63], 16, 2, 128, torch.float16),
        ([257, 33], [95, 1], 8, 8, 64, torch.bfloat16),
        ([2048], [2048], 32, 8, 128, torch.bfloat16),
    ]
    names = " / ".join(PROBES)
    lines = [f"| new tokens | cached | Hq / Hkv | D | dtype | rel err Triton | rel err {names} | max abs diff | ok |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for q_lens, cached, hq, hkv, d, dtype in cases:
        q, k, v, table, cu, lens = ragged(q_lens, cached, hq, hkv, d, dtype, gen)
        scale = d**-0.5
        ref = paged_prefill_attention_ref(q.float(), k.float(), v.float(), table, cu, lens, scale)
        base = prefill_with_config(q, k, v, table, cu, lens, scale, TRITON)
        outs = [fn(q, k, v, table, cu, lens, scale, torch.full_like(q, float("nan"))) for fn in PROBES.values()]
        errs, base_err = [rel_err(out, ref) for out in outs], rel_err(base, ref)
        diff = max(float((out.float() - ref).abs().max()) for out in outs)
        ok = max(errs) <= 1.5 * base_err + 1e-3 and all(torch.isfinite(out).all().item() for out in outs)
        cells = " / ".join(f"{e:.2e}" for e in errs)
        lines.append(f"| {q_lens} | {cached} | {hq} / {hkv} | {d} | {str(dtype)[6:]} | {base_err:.2e} | {cells} "
                     f"| {diff:.2e} | {'yes' if ok else '**no**'} |")  # fmt: skip
        print(lines[-1], flush=True)
    return lines


def timing(gen, rep: int) -> list[str]:
    head = "| case | Triton ms | TFLOP/s |" + "".join(f" {name} ms | TFLOP/s |" for name in PROBES)
    lines = [head + " best / Triton |", "| --- |" + " ---: |" * (2 * len(PROBES) + 3)]
    cases = [("4096-token prompt, 0 cached", [4096], [0]), ("4096-token prompt, 3072 cached", [1024], [3072]),
             ("8 x 512-token prompts, 0 cached", [512] * 8, [0] * 8),
             ("16384-token prompt, 0 cached", [16384], [0])]  # fmt: skip
    for name, q_lens, cached in cases:
        q, k, v, table, cu, lens = ragged(q_lens, cached, 32, 8, 128, torch.bfloat16, gen)
        scale = 128**-0.5
        flops = sum(causal_flops(ql, ql + c) for ql, c in zip(q_lens, cached))
        out = torch.empty_like(q)
        fns = [partial(prefill_with_config, q, k, v, table, cu, lens, scale, TRITON, out)]
        fns += [partial(fn, q, k, v, table, cu, lens, scale, out) for fn in PROBES.values()]
        ms = [bench_ms(fn, rep) for fn in fns]
        tf = [flops / t / 1e9 for t in ms]
        cells = " | ".join(f"{t:.3f} | {f:.0f}" for t, f in zip(ms, tf))
        lines.append(f"| {name} | {cells} | {ms[0] / min(ms[1:]):.2f}x |")
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rep", type=int, default=200)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    checks = check(gen)
    print("\n".join(checks), flush=True)
    times = timing(gen, args.rep)
    head = [
        "# Prefill attention: the Hopper probes against the Triton kernel",
        "",
        f"- date: {datetime.date.today()}, GPU: {torch.cuda.get_device_name()}",
        f"- torch {torch.__version__}, triton {triton.__version__}",
        f"- command: `python bench/gluon_prefill_probe.py {' '.join(sys.argv[1:])}`",
        "",
    ]
    text = "\n".join(head + ["## Against the torch reference", ""] + checks + ["", "## Timing", ""] + times) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0 if all("**no**" not in line for line in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
