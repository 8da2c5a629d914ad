"""A hybrid sliding-window model against the same model with every layer full, at long
contexts: Qwen3-0.6B's shape with random bf16 weights, every other layer sliding-window
attention (window 1024, in KV-cache groups) vs none. Per context length: the KV blocks and
bytes per request the KV-cache manager holds at the decode's peak, prefill time, and decode
throughput of a batch of requests with that many prompt tokens.

    python bench/hybrid.py [--model qwen3-0.6b] [--contexts 8192 16384 32768] [--batch 8]
                           [--out bench/results/hybrid_h200.md]
    python bench/hybrid.py --model tiny --contexts 64 128 --batch 2 --output-len 4   # on a CPU

--model names a base config of bench.common (its "-hybrid" sibling is the sliding one).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CONFIGS, device_sync, environment, make_llm, write_result  # noqa: E402
from contracts.kv_groups import kv_groups  # noqa: E402
from model_svc.kv_cache import KVCachePools  # noqa: E402

BLOCK_SIZE = 16


def run(args, model: str, context: int) -> dict:
    """One engine for one (model, context): a warm-up, then the batch's prefill (one token
    out) and, from the prefix cache, its decode of args.output_len tokens."""
    from scheduler_svc import SamplingParams

    rng = random.Random(context)
    vocab = CONFIGS[model]["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(args.batch)]
    blocks_per_request = -(-(context + args.output_len) // BLOCK_SIZE)
    # The same bytes for both: the all-full pool's layer-blocks over this model's layers per block.
    config = CONFIGS[model]
    windows = [
        config.get("sliding_window", 0) if t == "sliding_attention" else 0 for t in config.get("layer_types", [])
    ]
    groups = kv_groups(windows, config["num_hidden_layers"])
    pool_layer_blocks = (args.batch * blocks_per_request + 64) * config["num_hidden_layers"]
    llm, _ = make_llm(
        model,
        args.device,
        num_gpu_blocks=pool_layer_blocks // groups.group_size,
        enable_prefix_caching=True,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=context + args.output_len + 1,
    )
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # compile / warm-up
    sync = device_sync(args.device)
    sync()
    start = time.perf_counter()
    # The prompts prefilled (two tokens out), which puts their blocks in the prefix cache.
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    sync()
    prefill_s = time.perf_counter() - start
    # The prompts again: every full prompt block comes from the cache, so what is timed is
    # the decode (and one partial block of prefill per request).
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    peak_used, num_tokens = 0, 0
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            num_tokens += len(out.token_ids) if out.finished else 0
        peak_used = max(peak_used, engine.kv.device.num_used_blocks)
    sync()
    decode_s = time.perf_counter() - start
    engine.kv.check_invariants()
    runner = engine.model
    block_bytes = KVCachePools.bytes_per_block(runner.config, BLOCK_SIZE, runner.kv_dtype, runner.kv_groups)
    return {
        "model": model,
        "context": context,
        "kv_groups": len(groups.windows),
        "kv_blocks_per_request": peak_used / args.batch,
        "kv_mib_per_request": peak_used * block_bytes / args.batch / 2**20,
        "prefill_s": prefill_s,
        "decode_tok_s": num_tokens / decode_s,
        "decode_s": decode_s,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| context | model | KV groups | KV blocks / request | KV MiB / request | vs all-full "
        "| prefill s | decode tok/s | vs all-full |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    full = {r["context"]: r for r in rows if not r["model"].endswith("-hybrid")}
    for r in rows:
        base = full[r["context"]]
        ratio = r["decode_tok_s"] / base["decode_tok_s"]
        mem = r["kv_mib_per_request"] / base["kv_mib_per_request"]
        lines.append(
            f"| {r['context']} | {r['model']} | {r['kv_groups']} | {r['kv_blocks_per_request']:.1f} "
            f"| {r['kv_mib_per_request']:.1f} | {mem:.3f}x | {r['prefill_s']:.2f} "
            f"| {r['decode_tok_s']:.1f} | {ratio:.3f}x |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=[m for m in CONFIGS if f"{m}-hybrid" in CONFIGS])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for context in args.contexts:
        for model in (args.model, f"{args.model}-hybrid"):
            rows.append(run(args, model, context))
            print(rows[-1], flush=True)
    body = table(rows)
    print(body)
    if args.out:
        hybrid = CONFIGS[f"{args.model}-hybrid"]
        note = (
            f"Batch {args.batch}, {args.output_len} tokens out; the hybrid model slides "
            f"{hybrid['layer_types'].count('sliding_attention')} of {len(hybrid['layer_types'])} layers "
            f"(window {hybrid['sliding_window']}) in KV-cache groups. KV blocks per request: the KV-cache "
            "manager's device blocks in use at the decode's peak, over the batch (a block of the hybrid "
            "holds half the layers of an all-full block: KV MiB compares the same bytes). Both pools "
            "have the same bytes.\n\n"
        )
        write_result(args.out, "Hybrid sliding-window model vs all-full attention", environment(), note + body)
    return rows


if __name__ == "__main__":
    main()
