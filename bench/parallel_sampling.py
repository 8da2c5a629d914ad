"""Parallel sampling on copy-on-write blocks vs separate requests: --num-prompts prompts with
SamplingParams(n=--n) against num_prompts * n requests of the same prompts (each prompt
--n times). Completion i of a prompt is seeded seed + i in both modes (SamplingParams.child),
so both do the same work and would give the same tokens on exact arithmetic. Reports per
mode: seconds, output tok/s, the peak of device KV blocks in use (read after every engine
step), copy-on-write copies, prompt tokens from the prefix cache, preemptions, and how many
completions equal the other mode's.

    python bench/parallel_sampling.py --out bench/results/parallel_sampling_h200.md
    python bench/parallel_sampling.py --model tiny --device cpu --num-prompts 4 --n 3 --prompt-len 40 --output-len 8

Both modes run on one engine (prefix caching on, as the engine's default: the separate
requests share full prompt blocks through it, as vLLM v1 serves n > 1), each after
reset_prefix_cache, so neither finds the other's prompts cached.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_sync, environment, make_llm, write_result  # noqa: E402


def make_prompts(args, vocab_size: int) -> list[list[int]]:
    """Random token ids, lengths in [prompt_len / 2, prompt_len] (the last block mostly partial)."""
    rng = random.Random(args.seed)
    high = min(10000, vocab_size)
    return [
        [rng.randrange(high) for _ in range(rng.randint(max(2, args.prompt_len // 2), args.prompt_len))]
        for _ in range(args.num_prompts)
    ]


def sampling(args, seed: int, n: int = 1):
    from scheduler_svc import SamplingParams

    return SamplingParams(temperature=args.temperature, seed=seed, n=n, max_tokens=args.output_len, ignore_eos=True)


def run_mode(args, llm, prompts: list[list[int]], parallel: bool) -> dict:
    """One timed run: add every request, step to the end, watch the blocks in use."""
    engine = llm.engine
    engine.reset_prefix_cache()
    copies = [0]
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        copies[0] += len(out.step.copies)
        return out

    engine.scheduler.schedule = counting
    engine.stream_outputs = False  # finished requests only, as LLM.generate runs it
    stats, kv = engine.scheduler.stats, engine.kv
    preemptions, hits = stats.num_preemptions, kv.num_prefix_hits
    sync = device_sync(args.device)
    sync()
    t = time.perf_counter()
    ids = []
    for p, prompt in enumerate(prompts):
        seed = args.seed + 1000 * p
        if parallel:
            ids.append([engine.add_request(prompt, sampling(args, seed, args.n))])
        else:
            ids.append([engine.add_request(prompt, sampling(args, seed + i)) for i in range(args.n)])
    finished, peak = {}, 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            peak = max(peak, kv.device.num_used_blocks)
        sync()
    finally:
        del engine.scheduler.schedule
        engine.stream_outputs = True
    seconds = time.perf_counter() - t
    # Completion i of prompt p, in the same order in both modes.
    tokens = [c.token_ids for rids in ids for rid in rids for c in finished[rid].outputs]
    return {
        "mode": f"{args.num_prompts} prompts x n={args.n}" if parallel else f"{args.num_prompts * args.n} requests",
        "seconds": seconds,
        "output_tokens": sum(map(len, tokens)),
        "peak_blocks": peak,
        "copies": copies[0],
        "hit_tokens": kv.num_prefix_hits - hits,
        "preemptions": stats.num_preemptions - preemptions,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", help="a named config (random weights) or a model directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=1024, help="longest prompt (the shortest is half)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-gpu-blocks", type=int, default=None, help="the device pool; default: measured")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default=None, help="write the result table here (markdown)")
    args = ap.parse_args()
    llm, _ = make_llm(
        args.model,
        args.device,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    prompts = make_prompts(args, llm.engine.model_config.vocab_size)
    from scheduler_svc import SamplingParams

    # Warm-up (kernels compile, CUDA graphs, allocator growth): both modes' shapes, shortened.
    warm = argparse.Namespace(**{**vars(args), "output_len": 4})
    run_mode(warm, llm, prompts, True)
    run_mode(warm, llm, prompts, False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    env = environment()
    parallel, separate = run_mode(args, llm, prompts, True), run_mode(args, llm, prompts, False)
    same = sum(a == b for a, b in zip(parallel["tokens"], separate["tokens"]))
    lines = [
        f"{args.num_prompts} prompts of {args.prompt_len // 2}-{args.prompt_len} tokens, {args.n} completions "
        f"each, {args.output_len} output tokens each (ignore_eos), temperature {args.temperature}; "
        f"device pool {llm.engine.kv.device.num_blocks} blocks of {llm.engine.kv.block_size} tokens",
        "",
        "| mode | seconds | output tok/s | peak KV blocks in use | copy-on-write copies | prompt tokens from cache "
        "| preemptions |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['mode']} | {r['seconds']:.2f} | {r['output_tokens'] / r['seconds']:,.0f} | {r['peak_blocks']:,} | "
            f"{r['copies']:,} | {r['hit_tokens']:,} | {r['preemptions']} |"
            for r in (parallel, separate)
        ),
        "",
        f"throughput n={args.n} / separate: {separate['seconds'] / parallel['seconds']:.2f}x; "
        f"peak blocks separate / n={args.n}: {separate['peak_blocks'] / max(1, parallel['peak_blocks']):.2f}x",
        f"completions equal in both modes: {same} of {len(parallel['tokens'])}",
    ]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Parallel sampling (fork + copy-on-write) vs separate requests", env, "\n".join(lines))


if __name__ == "__main__":
    main()
