"""Greedy parity of the optimized path (Triton kernels + CUDA graphs) against the plain path
(torch reference kernels, eager) on the same weights (where the optimized model folded its
norm weights into the projections, the plain one gets them folded too), on the GPU: the
first 32 greedy tokens of 8 prompts, one at a time, must agree, or differ only where the
plain path's top-2 logit gap is a near-tie (below 1e-2), or where each path's token is the
other's second choice (a top-2 swap: the criterion of vLLM's check_logprobs_close with two
logprobs); likewise 48 prompts stepped together (decode batches of 48: split-K, the fused
gate|up, the deferred norms). A MISMATCH is a divergence that is neither.

Each divergence is also put to an fp32 reference: the plain path in fp32 on the same 16-bit
weights (upcast exactly), given the tokens both paths agreed on, scores the two candidate
tokens; its margin says which path's token the exact function prefers, and by how much. When
the 16-bit paths diverge at bf16 noise, the reference sides with the optimized path about as
often as with the plain one."""

from __future__ import annotations

import contextlib
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_runner  # noqa: E402

Top2 = tuple[float, tuple[int, int]]  # a step's top-2 logit gap and the two token ids


def greedy_with_gaps(
    runner, prompts: list[list[int]], max_tokens: int, batched: bool = False
) -> list[tuple[list[int], list[Top2]]]:
    """Step the runner directly, one sequence at a time (batch-1 decode) or, batched, all of
    them in every step (decode batches of len(prompts)), and record, per generated token, the
    top-2 logit gap of its logits and the two tokens."""
    from contracts.step import SeqStep, StepInput
    from scheduler_svc import SamplingParams

    results = []
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    gaps_hook = {}

    def record(logits):
        values, ids = torch.topk(logits.float(), 2, dim=-1)
        gaps_hook["gap"] = list(zip((values[:, 0] - values[:, 1]).tolist(), map(tuple, ids.tolist())))

    with _logits_seen(runner, record):
        if batched:
            return _greedy_batched(runner, prompts, max_tokens, params, gaps_hook)
        for i, (prompt, table) in enumerate(zip(prompts, _tables(prompts, max_tokens, runner.block_size))):
            seq_id, tokens, gaps = f"p{i}", list(prompt), []
            step = SeqStep(seq_id, list(prompt), 0, True, 0, table, params, list(prompt))
            for _ in range(max_tokens):
                out = runner.step(StepInput(seqs=[step]))
                tok = out.sampled[0].token_id
                gaps.append(gaps_hook["gap"][0])
                step = SeqStep(seq_id, [tok], len(tokens), True)
                tokens.append(tok)
            runner.step(StepInput(finished=[seq_id]))
            results.append((tokens[len(prompt) :], gaps))
    return results


@contextlib.contextmanager
def _logits_seen(runner, record):
    """Within the block, record(logits) sees the fp32 logits of every step the runner samples
    (LlamaForCausalLM.compute_logits hooked). Decode steps sampled inside the graphs never call
    compute_logits on the host, so the runner samples after the graphs meanwhile (the same LM
    head and argmax; that the graphs' sampling draws as the runner's does is
    tests/scheduler/test_engine_gpu.py's)."""
    model, graphs = runner.model, runner.graphs
    orig = model.compute_logits
    sample_graphs = graphs.sample_graphs if graphs is not None else None

    def hooked(hidden):
        logits = orig(hidden)
        record(logits)
        return logits

    model.compute_logits = hooked
    if graphs is not None:
        graphs.sample_graphs = {}
    try:
        yield
    finally:
        model.compute_logits = orig
        if graphs is not None:
            graphs.sample_graphs = sample_graphs


def _tables(prompts: list[list[int]], max_tokens: int, block_size: int) -> list[list[int]]:
    """Each prompt's own blocks (room for the prompt and max_tokens), shuffled."""
    tables, first = [], 0
    for i, prompt in enumerate(prompts):
        n_blocks = -(-(len(prompt) + max_tokens) // block_size)
        table = list(range(first, first + n_blocks))
        random.Random(i).shuffle(table)
        tables.append(table)
        first += n_blocks
    return tables


def _greedy_batched(runner, prompts, max_tokens, params, gaps_hook) -> list[tuple[list[int], list[Top2]]]:
    from contracts.step import SeqStep, StepInput
    from model_svc.step_batch import longest_first

    tables = _tables(prompts, max_tokens, runner.block_size)
    steps = [SeqStep(f"p{i}", list(p), 0, True, 0, tables[i], params, list(p)) for i, p in enumerate(prompts)]
    tokens = [list(p) for p in prompts]
    gaps: list[list[Top2]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        out = runner.step(StepInput(seqs=steps))
        by_seq = {s.seq_id: s.token_id for s in out.sampled}
        rows = {s.seq_id: r for r, s in enumerate(longest_first(steps))}  # the runner's row order
        for i, step in enumerate(steps):
            gaps[i].append(gaps_hook["gap"][rows[step.seq_id]])
            tokens[i].append(by_seq[step.seq_id])
        steps = [SeqStep(f"p{i}", [t[-1]], len(t) - 1, True) for i, t in enumerate(tokens)]
    runner.step(StepInput(finished=[f"p{i}" for i in range(len(prompts))]))
    return [(t[len(p) :], g) for t, p, g in zip(tokens, prompts, gaps)]


def check_parity(
    model: str,
    device: str,
    dtype: str | None,
    near_tie: float,
    num_prompts: int = 8,
    max_tokens: int = 32,
    batched_prompts: int = 48,
) -> list[str]:
    """The 8 prompts one at a time (batch-1 decode), then batched_prompts prompts stepped
    together (decode batches of tens of rows: split-K, the fused gate|up, the deferred norms);
    0 skips the batched part."""
    from bench.common import model_dir_for
    from model_svc.config import ModelConfig

    longest = (
        ModelConfig.from_pretrained(model_dir_for(model)[0]).max_position_embeddings - max_tokens
    )  # prompt + output fit
    rng = random.Random(0)
    lengths = [min(n, longest) for n in (5, 17, 31, 64, 100, 129, 250, 511)[:num_prompts]]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    report, margins = _compare(model, device, dtype, prompts, max_tokens, near_tie, batched=False)
    if batched_prompts:
        batch = [
            [rng.randrange(3, 500) for _ in range(min(rng.randrange(5, 300), longest))] for _ in range(batched_prompts)
        ]
        rows, batched_margins = _compare(model, device, dtype, batch, max_tokens, near_tie, batched=True)
        margins += batched_margins
        counts = {what: sum(what in r for r in rows) for what in ("equal", "near-tie", "top-2 swap", "MISMATCH")}
        report.append(
            f"{batched_prompts} prompts stepped together: all {max_tokens} tokens equal for {counts['equal']}; "
            f"first divergence at a near-tie for {counts['near-tie']}, at a top-2 swap for {counts['top-2 swap']}; "
            f"MISMATCH for {counts['MISMATCH']}"
        )
        report += [r for r in rows if "equal" not in r and "near-tie" not in r]
    if margins:
        report.append(
            f"fp32 reference at all {len(margins)} divergences: the optimized path's token ahead at "
            f"{sum(m > 0 for m in margins)}, the plain path's at {sum(m < 0 for m in margins)}; the two candidates "
            f"at most {max(abs(m) for m in margins):.2e} apart (median "
            f"{sorted(map(abs, margins))[len(margins) // 2]:.2e})"
        )
    return report


def _compare(model, device, dtype, prompts, max_tokens, near_tie, batched: bool) -> tuple[list[str], list[float]]:
    """The optimized runner's greedy tokens against the plain one's, a line per prompt, and the
    fp32 reference's margin at each divergence (optimized token minus plain token; none for
    a plain path that is not 16-bit)."""
    blocks = sum(-(-(len(p) + max_tokens) // 16) for p in prompts) + 16  # _tables' blocks
    _, fast = build_runner(
        model, device, dtype, num_device_blocks=blocks, max_num_seqs=max(8, len(prompts) if batched else 8)
    )
    got = greedy_with_gaps(fast, prompts, max_tokens, batched)
    folded = fast.model.model.norms_folded
    del fast
    _, plain = build_runner(model, device, dtype, num_device_blocks=blocks, kernel_backend="torch", enforce_eager=True)
    plain_dtype = plain.dtype
    if folded:  # the same weights as the optimized model holds (its norm weights folded into q|k|v, gate|up)
        plain.model.fold_norm_weights(force=True)
    want = greedy_with_gaps(plain, prompts, max_tokens, batched)
    del plain
    torch.cuda.empty_cache()
    report, divergences = [], []
    for i, ((a, fast_top2), (b, plain_top2)) in enumerate(zip(got, want)):
        diverge = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diverge is None:
            report.append(f"prompt {i} (len {len(prompts[i])}): all {max_tokens} tokens equal")
            continue
        gap, plain_ids = plain_top2[diverge]
        if gap < near_tie:
            status = "near-tie"
        elif a[diverge] in plain_ids and b[diverge] in fast_top2[diverge][1]:
            status = "top-2 swap"  # each path's token is the other's second choice (vLLM's check_logprobs_close, top 2)
        else:
            status = "MISMATCH"
        report.append(
            f"prompt {i} (len {len(prompts[i])}): first divergence at token {diverge}, top-2 gap {gap:.2e}: {status}"
        )
        divergences.append((len(report) - 1, prompts[i] + a[:diverge], a[diverge], b[diverge]))
    margins = []
    if divergences and dtype_is_16bit(plain_dtype):
        margins = reference_margins(model, device, dtype, folded, [(p, x, y) for _, p, x, y in divergences])
        for (line, *_), margin in zip(divergences, margins):
            side = "optimized" if margin > 0 else "plain" if margin < 0 else "neither"
            report[line] += f"; fp32 reference: {side} token ahead by {abs(margin):.2e}"
    return report, margins


def dtype_is_16bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def reference_margins(
    model: str, device: str, dtype: str | None, folded: bool, cases: list[tuple[list[int], int, int]]
) -> list[float]:
    """For each (tokens, x, y): the fp32 logit of x minus that of y at the position after
    `tokens`, from the plain path in fp32 on the model's 16-bit weights (norm weights folded as
    the optimized model's are, then upcast, which is exact)."""
    from contracts.step import SeqStep, StepInput
    from model_svc.runner import ModelRunner
    from scheduler_svc import SamplingParams

    blocks = max(-(-len(t) // 16) for t, _, _ in cases) + 1
    path, plain = build_runner(
        model, device, dtype, num_device_blocks=blocks, kernel_backend="torch", enforce_eager=True
    )
    weights = plain.model
    del plain
    if folded:
        weights.fold_norm_weights(force=True)
    ref = ModelRunner(
        path,
        device=device,
        dtype=torch.float32,
        model=weights.float(),
        kernel_backend="torch",
        enforce_eager=True,
        num_device_blocks=blocks,
    )
    seen = []
    margins = []
    with _logits_seen(ref, seen.append):
        for tokens, x, y in cases:
            step = SeqStep(
                "ref",
                list(tokens),
                0,
                True,
                0,
                list(range(-(-len(tokens) // 16))),
                SamplingParams(temperature=0, max_tokens=1),
                list(tokens),
            )
            ref.step(StepInput(seqs=[step]))
            ref.step(StepInput(finished=["ref"]))
            logits = seen[-1][-1].float()
            margins.append((logits[x] - logits[y]).item())
    del ref, weights, seen
    torch.cuda.empty_cache()
    return margins


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=None, help="also write the report as a result file (markdown)")
    ap.add_argument(
        "--prefill-p-terms",
        type=int,
        choices=[1, 2],
        default=None,
        help="experiment: prefill attention's P @ V with P as 1 or 2 bf16 terms (default: the kernel's)",
    )
    args = ap.parse_args()
    if args.prefill_p_terms is not None:
        import dataclasses

        from pico_kernels import triton_prefill

        default = triton_prefill.default_prefill_config
        triton_prefill.default_prefill_config = lambda *a: dataclasses.replace(
            default(*a), split_p=args.prefill_p_terms == 2
        )
    from bench.common import environment, write_result

    env = environment()
    lines = check_parity(args.model, args.device, args.dtype, near_tie=1e-2)
    print("\n".join(lines))
    if args.out:
        write_result(
            args.out,
            "Greedy parity, optimized vs plain path, with an fp32 reference",
            env,
            "\n".join(f"- {line}" for line in lines),
        )
