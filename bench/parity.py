"""Greedy parity of the optimized path (Triton kernels + CUDA graphs) against the plain path
(torch reference kernels, eager), on the GPU: the first 32 greedy tokens of 8 prompts must
agree, or differ only where the plain path's top-2 logit gap is a near-tie."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_runner  # noqa: E402


def greedy_with_gaps(runner, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Step the runner directly (one sequence at a time is enough here) and record, per
    generated token, the top-2 logit gap of the plain logits."""
    from model_svc.step import SeqStep, StepInput
    from scheduler_svc import SamplingParams

    bs = runner.block_size
    results = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    gaps_hook = {}
    orig = runner.model.compute_logits

    def hooked(hidden):
        logits = orig(hidden)  # fp32 (see LlamaForCausalLM.compute_logits)
        top2 = torch.topk(logits.float(), 2, dim=-1).values
        gaps_hook["gap"] = (top2[:, 0] - top2[:, 1]).tolist()
        return logits

    runner.model.compute_logits = hooked
    try:
        for i, prompt in enumerate(prompts):
            seq_id, tokens, gaps = f"p{i}", list(prompt), []
            n_blocks = -(-(len(prompt) + max_tokens) // bs)
            table = list(range(i * n_blocks, (i + 1) * n_blocks))
            random.Random(i).shuffle(table)
            step = SeqStep(seq_id, list(prompt), 0, True, 0, table, params, list(prompt))
            for _ in range(max_tokens):
                out = runner.step(StepInput(seqs=[step]))
                tok = out.sampled[0].token_id
                gaps.append(gaps_hook["gap"][0])
                step = SeqStep(seq_id, [tok], len(tokens), True)
                tokens.append(tok)
            runner.step(StepInput(finished=[seq_id]))
            results.append((tokens[len(prompt):], gaps))
    finally:
        runner.model.compute_logits = orig
    return results


def check_parity(model: str, device: str, dtype: str | None, near_tie: float, num_prompts: int = 8, max_tokens: int = 32) -> list[str]:
    rng = random.Random(0)
    lengths = [5, 17, 31, 64, 100, 129, 250, 511][:num_prompts]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    blocks = num_prompts * (-(-(max(lengths) + max_tokens) // 16)) + 16
    _, fast = build_runner(model, device, dtype, num_device_blocks=blocks, max_num_seqs=8)
    got = greedy_with_gaps(fast, prompts, max_tokens)
    del fast
    _, plain = build_runner(model, device, dtype, num_device_blocks=blocks, kernel_backend="torch", enforce_eager=True)
    want = greedy_with_gaps(plain, prompts, max_tokens)
    del plain
    torch.cuda.empty_cache()
    report = []
    for i, ((a, _), (b, gaps)) in enumerate(zip(got, want)):
        diverge = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diverge is None:
            report.append(f"prompt {i} (len {lengths[i]}): all {max_tokens} tokens equal")
        else:
            gap = gaps[diverge]
            status = "near-tie" if gap < near_tie else "MISMATCH"
            report.append(f"prompt {i} (len {lengths[i]}): first divergence at token {diverge}, top-2 gap {gap:.2e}: {status}")
    return report


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prefill-p-terms", type=int, choices=[1, 2], default=None,
                    help="experiment: prefill attention's P @ V with P as 1 or 2 bf16 terms (default: the kernel's)")
    args = ap.parse_args()
    if args.prefill_p_terms is not None:
        import dataclasses

        from kernels import triton_prefill

        default = triton_prefill.default_prefill_config
        triton_prefill.default_prefill_config = lambda *a: dataclasses.replace(default(*a), split_p=args.prefill_p_terms == 2)
    print("\n".join(check_parity(args.model, args.device, args.dtype, near_tie=1e-2)))
