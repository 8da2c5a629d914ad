"""Tensor parallelism: greedy parity and throughput of TP = 1, 2, 4 on the same weights.

    python bench/tp.py --out bench/results/tp_h200.md                    # Qwen3-0.6B shape, random bf16
    python bench/tp.py --model qwen3-8b --out bench/results/tp_8b_h200.md  # an 8B-class shape
    python bench/tp.py --model tiny --device cpu --tp 1,2 --num-seqs 8 --max-len 128   # the logic, on the CPU

A named config gets random weights written to a directory once (the ranks load from it), so
every TP size runs exactly the same model. Per TP size: the greedy tokens of a few prompts,
compared with the first size's (token for token; in bf16 the partial sums of a row-parallel
projection add in another order, so a divergence at a near tie is expected and shown), then
the headline workload (bench/throughput.py's: nano-vllm's random prompts and lengths) timed
after a warm-up. Each size's ranks are stopped before the next starts.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CONFIGS, environment, model_dir_for, write_result  # noqa: E402
from bench.throughput import make_workload, timed_generate  # noqa: E402

PARITY_PROMPTS = 8
PARITY_TOKENS = 64


def write_random_model(name: str, device: str, dtype: str | None) -> str:
    """A directory with the named config's random weights (built on `device`, saved in HF layout)."""
    from model_svc.config import ModelConfig
    from model_svc.loader import build_random_model, resolve_dtype, save_model
    from pico_kernels import select_ops

    path, _ = model_dir_for(name)
    dev = torch.device(device)
    config = ModelConfig.from_pretrained(path)
    model = build_random_model(config, resolve_dtype(dtype, dev), dev, ops=select_ops(dev))
    save_model(model, path)
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return path


def parity_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(5, 200, (PARITY_PROMPTS,))]


def compare(ref: list[list[int]], got: list[list[int]]) -> tuple[int, int, str]:
    """(tokens equal up to each prompt's first divergence, tokens in all, the first divergences)."""
    same, firsts = 0, []
    for i, (a, b) in enumerate(zip(ref, got)):
        n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += n
        if n < len(a):
            firsts.append(f"prompt {i} at token {n}")
    return same, sum(len(a) for a in ref), ", ".join(firsts) or "none"


def run_size(args, path: str, tp: int, prompts, params, probe) -> dict:
    from scheduler_svc import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(
        path,
        device=args.device,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        skip_tokenizer_init=True,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        torch_threads=1 if args.device == "cpu" else None,
    )
    start_s = time.perf_counter() - t
    try:
        greedy = SamplingParams(temperature=0, max_tokens=PARITY_TOKENS, ignore_eos=True)
        tokens = [o.token_ids for o in llm.generate(probe, greedy)]
        seconds, out_tokens, steps, _ = timed_generate(llm, prompts, params, args.device)
        return dict(tp=tp, start_s=start_s, tokens=tokens, seconds=seconds, out_tokens=out_tokens, steps=steps)
    finally:
        llm.engine.model.close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen3-0.6b", help=f"{', '.join(CONFIGS)} (random weights) or a local HF directory"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tp", default="1,2,4", help="the tensor-parallel sizes, the first the reference")
    ap.add_argument("--num-seqs", type=int, default=256, help="requests in the workload")
    ap.add_argument("--max-len", type=int, default=1024, help="max input and output length")
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="device KV pool (default: measured)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--out", default=None, help="write a markdown result here (default: print only)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    sizes = [int(x) for x in args.tp.split(",")]
    if args.device == "cuda" and max(sizes) > torch.cuda.device_count():
        sys.exit(f"--tp {args.tp} needs {max(sizes)} GPUs; this machine has {torch.cuda.device_count()}")
    named = args.model in CONFIGS
    path = write_random_model(args.model, args.device, args.dtype) if named else args.model
    from model_svc.config import ModelConfig

    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts, params = make_workload(args.num_seqs, args.max_len, args.max_len)
    probe = parity_prompts(min(vocab, 10000))
    try:
        results = [run_size(args, path, tp, prompts, params, probe) for tp in sizes]
    finally:
        if named and path.startswith(tempfile.gettempdir()):
            shutil.rmtree(path, ignore_errors=True)
    ref = results[0]
    rows = [
        "| TP | start-up s | output tokens | seconds | tok/s | steps | greedy tokens equal to TP="
        f"{ref['tp']} | first divergences |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        same, total, firsts = compare(ref["tokens"], r["tokens"])
        rows.append(
            f"| {r['tp']} | {r['start_s']:.1f} | {r['out_tokens']} | {r['seconds']:.2f} | "
            f"{r['out_tokens'] / r['seconds']:,.0f} | {r['steps']} | {same}/{total} | {firsts} |"
        )
    body = "\n".join(rows) + "\n"
    print(body)
    if args.out:
        title = f"Tensor parallelism: {args.model}, TP {args.tp}, {args.num_seqs} requests (max len {args.max_len})"
        write_result(args.out, title, environment(), body)


if __name__ == "__main__":
    main()
