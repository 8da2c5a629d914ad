"""GPU time per kernel of one decode step at the headline batch (torch profiler), and the
batch-1 time per output token.

    python bench/profile_gpu.py --batch 256 --context 600

Sequences are set up directly in the model runner (random K/V in their blocks, no prefill),
then decode steps run eagerly under the profiler (kernels visible) and through the CUDA
graphs (timed with CUDA events).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import build_runner, device_sync  # noqa: E402


def setup_decode(runner, batch: int, context: int, temperature: float):
    from contracts.step import SeqStep
    from scheduler_svc import SamplingParams

    bs = runner.block_size
    per_seq = -(-(context + 64) // bs)
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)
    runner.pools.device_cache[:, :, : batch * per_seq].normal_()
    steps = []
    for b in range(batch):
        table = blocks[b * per_seq : (b + 1) * per_seq]
        params = SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True)
        steps.append(
            SeqStep(f"s{b}", [random.randrange(1000)], context - 1, True, 0, table, params, [1] * (context - 1))
        )
    return steps


def decode_steps(runner, steps, n: int) -> None:
    from contracts.step import SeqStep, StepInput

    for _ in range(n):
        out = runner.step(StepInput(seqs=steps))
        steps = [
            SeqStep(s.seq_id, [t.token_id], s.start_pos + len(s.token_ids), True) for s, t in zip(steps, out.sampled)
        ]
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the graph decode steps")
    ap.add_argument("--skip-eager", action="store_true")
    args = ap.parse_args()
    dev = args.device
    sync = device_sync(dev)
    per_seq = -(-(args.context + 64) // 16)
    if not args.skip_eager:
        eager_profile(args, dev, per_seq, sync)
    _, fast = build_runner(args.model, dev, None, num_device_blocks=args.batch * per_seq + 16, max_num_seqs=args.batch)
    graph_steps(args, fast, sync)


def eager_profile(args, dev, per_seq, sync) -> None:
    _, eager = build_runner(
        args.model, dev, None, num_device_blocks=args.batch * per_seq + 16, enforce_eager=True, max_num_seqs=args.batch
    )
    steps = setup_decode(eager, args.batch, args.context, args.temperature)
    steps = decode_steps(eager, steps, 3)
    sync()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
        + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    ) as prof:
        steps = decode_steps(eager, steps, 5)
        sync()
    print(f"== eager decode step, batch {args.batch}, context ~{args.context}: GPU time per kernel over 5 steps")
    print(
        prof.key_averages().table(sort_by="cuda_time_total" if dev == "cuda" else "cpu_time_total", row_limit=args.rows)
    )
    del eager, steps


def _event_ms(fn, n: int = 50) -> float:
    """Device time per call of fn, queued n times back to back (the host runs ahead)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def replay_ms(runner, batch: int) -> float:
    bucket = next(b for b in runner.graphs.buckets if b >= batch)
    return _event_ms(runner.graphs.graphs[(bucket, False)].replay)


def logits_sample_ms(runner, batch: int, temperature: float) -> float:
    from model_svc.sampler import SamplingBatch
    from scheduler_svc import SamplingParams

    hidden = torch.randn(batch, runner.model.config.hidden_size, device=runner.device, dtype=runner.dtype)
    params = [SamplingParams(temperature=temperature, max_tokens=8)] * batch
    sampling = SamplingBatch.build(params, None, None, None, runner.device)
    return _event_ms(lambda: runner.sampler(runner.model.compute_logits(hidden), sampling))


def graph_steps(args, fast, sync) -> None:
    for batch in (args.batch, 1):
        steps = setup_decode(fast, batch, args.context if batch > 1 else 512, args.temperature)
        steps = decode_steps(fast, steps, 3)
        sync()
        t = time.perf_counter()
        n = 50
        steps = decode_steps(fast, steps, n)
        sync()
        ms = (time.perf_counter() - t) / n * 1e3
        print(f"graph decode step, batch {batch}: {ms:.3f} ms/step wall (host included)")
        if torch.device(fast.device).type == "cuda":
            print(
                f"  device time alone: {replay_ms(fast, batch):.3f} ms per graph replay (the forward, back to back), "
                f"{logits_sample_ms(fast, batch, args.temperature):.3f} ms for logits + sampling"
            )
        if args.host_profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            steps = decode_steps(fast, steps, 10)
            sync()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumtime").print_stats(18)
        for s in steps:
            fast.seqs.pop(s.seq_id, None)


if __name__ == "__main__":
    main()
