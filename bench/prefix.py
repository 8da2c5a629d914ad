"""Prefix caching on vs off (BENCHMARKS.md section 4): a 1,024-token shared prefix plus 64
distinct 32-token suffixes, 128 output tokens each. After an untimed batch of the same shape
with another prefix (one-time warm-up costs), one request warms the prefix (as a system prompt
would be); then the 64 arrive together. Reports TTFT p50/p99 and throughput of each of
--repeats runs per mode (each with its own prefix), and the ratios of the medians: a cached
run lasts a quarter of a second, so one run's figure moves by several per cent with the host.

    python bench/prefix.py [--model qwen3-0.6b] [--out bench/results/prefix_h200.md]
    python bench/prefix.py --profile   # where the timed runs' time goes instead of the table
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_overlap_flag, device_sync, environment, make_llm, percentile, write_result  # noqa: E402
from bench.throughput import RunCounters  # noqa: E402
from contracts import phase_times  # noqa: E402


def run(args, caching: bool, profile: str | None = None) -> list[dict]:
    """One engine, warmed up, then args.repeats timed runs, each with its own prefix and
    suffixes (so a run finds only its own prefix cached)."""
    from scheduler_svc import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.output_len)
    llm, _ = make_llm(
        args.model,
        args.device,
        enable_prefix_caching=caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.overlap,
    )
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))  # compile / warm-up
    # Warm-up at full size with an unrelated prefix (no hits for the timed runs): the first
    # batch of a shape pays one-time costs (allocator growth, pinned staging buffers) that a
    # serving engine has behind it; they are not what caching changes.
    llm.generate(make_prompts(args, rng), params)
    counters = RunCounters()
    return [
        timed_run(args, llm, make_prompts(args, rng), params, caching, profile, counters) for _ in range(args.repeats)
    ]


def make_prompts(args, rng: random.Random) -> list[list[int]]:
    """A fresh shared prefix, then num_requests + 1 prompts of it plus a distinct suffix."""
    prefix = [rng.randrange(10000) for _ in range(args.prefix_len)]
    return [prefix + [rng.randrange(10000) for _ in range(args.suffix_len)] for _ in range(args.num_requests + 1)]


def timed_run(
    args, llm, prompts: list[list[int]], params, caching: bool, profile: str | None, counters: RunCounters
) -> dict:
    llm.generate(prompts[:1], params)  # the first user of the shared prefix
    hits_before = llm.engine.kv.num_prefix_hits
    engine = llm.engine
    sync = device_sync(args.device)
    sync()
    prof = first_steps = None
    if profile == "host":  # the Python functions of the first two step() calls (they make the TTFT)
        first_steps = cProfile.Profile()
        first_steps.enable()
    elif profile == "device":
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else []
        )
        prof = torch.profiler.profile(activities=acts)
        prof.__enter__()
    phase_times.reset()
    steps_before = engine.scheduler.stats.num_steps
    counted = counters.snapshot()
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts[1:]]
    added = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    step_ends: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = now
                tokens += len(out.token_ids)
        step_ends.append(time.perf_counter())
        if len(step_ends) == 1 and phase_times.ENABLED and prof is None and first_steps is None:
            print(f"== caching {'on' if caching else 'off'}: phase timers of the first step")
            print(*phase_times.table(phase_times.snapshot(), 1), sep="\n")
            phase_times.reset()
        if first_steps is not None and len(step_ends) in (2, 60):
            first_steps.disable()
            what = "the first two step() calls" if len(step_ends) == 2 else "step() calls 11-60 (decode)"
            print(f"\n== caching {'on' if caching else 'off'}: {what} under cProfile")
            pstats.Stats(first_steps).sort_stats("cumulative" if len(step_ends) == 2 else "tottime").print_stats(30)
        if first_steps is not None and len(step_ends) == 10:
            first_steps = cProfile.Profile()
            first_steps.enable()
    sync()
    seconds = time.perf_counter() - start
    ttft = [(first[i] - start) * 1e3 for i in ids]
    after = counters.snapshot()
    during = {k: after[k] - counted[k] for k in after}
    if prof is None and first_steps is None and phase_times.ENABLED:
        print(
            f"== caching {'on' if caching else 'off'}: phase timers of the later {len(step_ends) - 1} steps, "
            f"{seconds * 1e3:.1f} ms; "
            f"{len(ids)} add_request calls {(added - start) * 1e3:.2f} ms; first step() calls, ms: "
            + ", ".join(f"{(b - a) * 1e3:.2f}" for a, b in zip([added, *step_ends], step_ends[:4]))
        )
        print(*phase_times.table(phase_times.snapshot(), len(step_ends) - 1), sep="\n")
    if prof is not None:
        prof.__exit__(None, None, None)
        report_profile(
            prof, caching, seconds, start, added, step_ends, engine.scheduler.stats.num_steps - steps_before, len(ids)
        )
    return {
        "caching": caching,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "hit_tokens": engine.kv.num_prefix_hits - hits_before,
        "overlap": engine.async_scheduling,
        "during": during,
    }


def report_profile(
    prof,
    caching: bool,
    seconds: float,
    start: float,
    added: float,
    step_ends: list[float],
    num_steps: int,
    num_requests: int,
) -> None:
    """Where a timed run's time went: the engine.step() calls' wall times (the first ones, which
    make the TTFT, one by one), the device's busy time and its kernels, and the phase timers
    when PICOVLLM_PHASE_TIMES is set."""
    walls = [(b - a) * 1e3 for a, b in zip([added, *step_ends], step_ends)]
    rest = sorted(walls[4:]) or [0.0]
    print(
        f"\n== caching {'on' if caching else 'off'}: {seconds * 1e3:.1f} ms wall (profiler on), {num_steps} steps; "
        f"{num_requests} add_request calls: {(added - start) * 1e3:.2f} ms"
    )
    print(
        "first step() calls, ms: "
        + ", ".join(f"{w:.2f}" for w in walls[:4])
        + f"; the rest: median {rest[len(rest) // 2]:.3f}, max {rest[-1]:.3f}, sum {sum(walls[4:]):.1f}"
    )
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in events)
    print(
        f"device busy {busy_us / 1e3:.1f} ms of {seconds * 1e3:.1f} ({busy_us / 1e6 / seconds:.0%}); "
        f"per step {busy_us / max(1, num_steps) / 1e3:.3f} ms"
    )
    print(f"{'ms total':>9} {'calls':>7}  kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / 1e3:9.2f} {e.count:7d}  {e.key[:110]}")
    host = sorted(
        (e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: -e.self_cpu_time_total,
    )[:12]
    print(f"{'host ms':>9} {'calls':>7}  op (self time)")
    for e in host:
        print(f"{e.self_cpu_time_total / 1e3:9.2f} {e.count:7d}  {e.key[:110]}")
    if phase_times.ENABLED:
        print(*phase_times.table(phase_times.snapshot(), num_steps), sep="\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    add_overlap_flag(ap)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs of each mode (each its own prefix); the ratios use the medians",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="instead of the table: step wall times, device kernels and host ops of both timed runs, "
        "then the first two steps and fifty decode steps of each under cProfile",
    )
    args = ap.parse_args()
    if args.profile:
        args.repeats = 1
        for kind in ("device", "host"):
            run(args, True, profile=kind)
            run(args, False, profile=kind)
        return
    env = environment()
    ons, offs = run(args, True), run(args, False)
    on, off = median_run(ons), median_run(offs)
    lines = [
        "| prefix caching | run | seconds | output tok/s | TTFT p50 ms | TTFT p99 ms | prompt tokens from cache |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {'on' if r['caching'] else 'off'} | {i + 1} | {r['seconds']:.3f} | {r['tok_s']:,.0f} | "
            f"{r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | {r['hit_tokens']} |"
            for rs in (ons, offs)
            for i, r in enumerate(rs)
        ),
        "",
        f"medians of {args.repeats} runs each: throughput on {on['tok_s']:,.0f}, off {off['tok_s']:,.0f} tok/s; "
        f"TTFT p50 on {on['ttft_p50']:.1f}, off {off['ttft_p50']:.1f} ms",
        f"throughput on/off: {on['tok_s'] / off['tok_s']:.2f}x (target >= 3x); TTFT p50 off/on: "
        f"{off['ttft_p50'] / on['ttft_p50']:.2f}x (target >= 5x)",
        f"overlapped scheduling: {on['overlap']}",
        f"during the timed runs: on: {RunCounters.total(r['during'] for r in ons)}; off: "
        f"{RunCounters.total(r['during'] for r in offs)}",
    ]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Prefix caching on vs off", env, "\n".join(lines))


def median_run(runs: list[dict]) -> dict:
    """The median of each figure over the runs (throughput and TTFT separately)."""
    return {
        **runs[0],
        "tok_s": percentile([r["tok_s"] for r in runs], 50),
        "ttft_p50": percentile([r["ttft_p50"] for r in runs], 50),
    }


if __name__ == "__main__":
    main()
