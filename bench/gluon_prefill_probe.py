"""The Hopper prefill probe (bench/gluon_prefill_kernel.py) against the Triton kernel, on a GPU.

    python bench/gluon_prefill_probe.py [--rep MS] [--out bench/results/gluon_prefill_h100.md]

Checks it against the torch reference on ragged batches (cached prefixes, shuffled pages,
GQA, head_dim 64 and 128, bf16 and fp16), then times both kernels at the prefill shapes of
bench/attention.py (a 4k prompt with 0 and 3k cached, 32 query and 8 KV heads, D 128, 16-token
pages), a batch of eight 512-token prompts and a 16k prompt: the probe with three K stages, and
as controls with two, and with the overlap of the softmax and the P V product off. Timing as
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
from pico_kernels.reference import paged_prefill_attention_ref  # noqa: E402
from pico_kernels.triton_prefill import default_prefill_config, prefill_with_config  # noqa: E402

PAGE = 16
TRITON = default_prefill_config(torch.bfloat16, 128)  # the Triton kernel's default 128 x 128 tiles


def ragged(q_lens, cached, hq, hkv, d, dtype, gen):
    """A shuffled page pool holding the batch's sequences, their new tokens' queries."""
    seq_lens = [q + c for q, c in zip(q_lens, cached)]
    blocks = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    k = torch.randn((num_blocks, PAGE, hkv, d), dtype=dtype, device="cuda", generator=gen)
    v = torch.randn((num_blocks, PAGE, hkv, d), dtype=dtype, device="cuda", generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros((len(q_lens), max(blocks)), dtype=torch.int32, device="cuda")
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[at : at + n]
        at += n
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
    lines = ["| new tokens | cached | Hq / Hkv | D | dtype | rel err Hopper (3 / 2 K stages) | rel err Triton "
             "| max abs diff | ok |", "| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for q_lens, cached, hq, hkv, d, dtype in cases:
        q, k, v, table, cu, lens = ragged(q_lens, cached, hq, hkv, d, dtype, gen)
        scale = d**-0.5
        ref = paged_prefill_attention_ref(q.float(), k.float(), v.float(), table, cu, lens, scale)
        outs = [gluon_prefill.prefill(q, k, v, table, cu, lens, scale, torch.full_like(q, float("nan")), k_stages=ks)
                for ks in (3, 2)]  # fmt: skip
        base = prefill_with_config(q, k, v, table, cu, lens, scale, TRITON)
        errs, base_err = [rel_err(out, ref) for out in outs], rel_err(base, ref)
        diff = max(float((out.float() - ref).abs().max()) for out in outs)
        ok = max(errs) <= 1.5 * base_err + 1e-3 and all(torch.isfinite(out).all().item() for out in outs)
        lines.append(f"| {q_lens} | {cached} | {hq} / {hkv} | {d} | {str(dtype)[6:]} | {errs[0]:.2e} / {errs[1]:.2e} "
                     f"| {base_err:.2e} | {diff:.2e} | {'yes' if ok else '**no**'} |")  # fmt: skip
    return lines


def timing(gen, rep: int) -> list[str]:
    head = "| case | Triton ms | TFLOP/s | Hopper ms | TFLOP/s | 2 K stages ms | TFLOP/s | no overlap ms | TFLOP/s |"
    lines = [head + " Hopper / Triton |", "| --- |" + " ---: |" * 9]
    cases = [("4096-token prompt, 0 cached", [4096], [0]), ("4096-token prompt, 3072 cached", [1024], [3072]),
             ("8 x 512-token prompts, 0 cached", [512] * 8, [0] * 8),
             ("16384-token prompt, 0 cached", [16384], [0])]  # fmt: skip
    for name, q_lens, cached in cases:
        q, k, v, table, cu, lens = ragged(q_lens, cached, 32, 8, 128, torch.bfloat16, gen)
        scale = 128**-0.5
        flops = sum(causal_flops(ql, ql + c) for ql, c in zip(q_lens, cached))
        out = torch.empty_like(q)
        fns = [partial(prefill_with_config, q, k, v, table, cu, lens, scale, TRITON, out),
               partial(gluon_prefill.prefill, q, k, v, table, cu, lens, scale, out),
               partial(gluon_prefill.prefill, q, k, v, table, cu, lens, scale, out, k_stages=2),
               partial(gluon_prefill.prefill, q, k, v, table, cu, lens, scale, out, overlap=False)]  # fmt: skip
        ms = [bench_ms(fn, rep) for fn in fns]
        tf = [flops / t / 1e9 for t in ms]
        cells = " | ".join(f"{t:.3f} | {f:.0f}" for t, f in zip(ms, tf))
        lines.append(f"| {name} | {cells} | {ms[0] / ms[1]:.2f}x |")
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
        "# Prefill attention: the Hopper kernel against the Triton kernel",
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
