"""Throughput vs latency: a request-rate sweep with Poisson arrivals, the engine in process.

A simulated arrival clock: requests are added once their arrival time is <= now, then the
engine steps; `now` is the wall time since the start, plus the idle gaps skipped when nothing
is running and the next arrival is in the future (so low rates do not sleep). Latencies are
measured on that clock: end-to-end (arrival -> last token), TTFT (arrival -> first token),
inter-token (gaps between a request's successive token outputs).

The rates are fractions of the engine's saturated capacity, measured first on the same
workload with every request arriving at once, so the sweep fits any model and device.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from bench.experiments.common import build_engine, make_workload, mean, model_label, pct, progress, sampling

RATE_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0, 1.25)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def serve(engine, prompts, output_lens, arrivals, device: str = "cpu") -> dict:
    """Run one arrival trace; returns per-request timings (seconds on the simulated clock)."""
    order = np.argsort(arrivals, kind="stable")
    t0, skipped, i = time.perf_counter(), 0.0, 0
    now = lambda: time.perf_counter() - t0 + skipped  # noqa: E731
    arrival_of, first, last, gaps, ntok = {}, {}, {}, [], {}
    while i < len(order) or engine.has_unfinished():
        if i < len(order) and not engine.has_unfinished() and arrivals[order[i]] > now():
            skipped += arrivals[order[i]] - now()  # idle: jump to the next arrival
        while i < len(order) and arrivals[order[i]] <= now():
            k = int(order[i])
            rid = engine.add_request(prompts[k], sampling(output_lens[k]))
            arrival_of[rid] = float(arrivals[k])
            i += 1
        if not engine.has_unfinished():
            continue
        outs = engine.step()
        _sync(device)
        t = now()
        for o in outs:
            if not o.delta_token_ids:
                continue
            rid = o.request_id
            if rid in last:
                gaps.append((t - last[rid]) / len(o.delta_token_ids))
            else:
                first[rid] = t
            last[rid] = t
            ntok[rid] = ntok.get(rid, 0) + len(o.delta_token_ids)
    end = now()
    e2e = [last[r] - a for r, a in arrival_of.items()]
    ttft = [first[r] - a for r, a in arrival_of.items()]
    span = end - float(np.min(arrivals))
    return {
        "e2e": {"mean": mean(e2e), "p50": pct(e2e, 50), "p99": pct(e2e, 99)},
        "ttft": {"mean": mean(ttft), "p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "itl": {"mean": mean(gaps), "p50": pct(gaps, 50), "p99": pct(gaps, 99)},
        "achieved_rps": len(e2e) / span,
        "output_tok_s": sum(ntok.values()) / span,
        "duration_s": span,
    }


def run(
    out_dir,
    *,
    model: str | None = None,
    device: str = "cpu",
    num_requests: int | None = None,
    seed: int = 0,
    env: dict | None = None,
    rate_fractions=RATE_FRACTIONS,
    num_gpu_blocks: int | None = None,
) -> dict:
    from bench.experiments import plots

    on_gpu = str(device).startswith("cuda")
    num_requests = num_requests or (256 if on_gpu else 48)
    engine = build_engine(
        model,
        device,
        num_gpu_blocks=num_gpu_blocks or (None if on_gpu else 512),
        max_num_seqs=256,
        max_num_batched_tokens=4096 if on_gpu else 1024,
    )
    max_len = min(engine.max_model_len, 1024 if on_gpu else 256)
    prompts, output_lens = make_workload(num_requests, max_len, engine.model_config.vocab_size, seed)
    serve(engine, prompts[:4], [4] * 4, np.zeros(4), device)  # warm-up
    # One tick per run of the whole workload (not per step: the runs are timed).
    bar = progress(1 + len(rate_fractions), "load", unit="run")
    capacity = serve(engine, prompts, output_lens, np.zeros(num_requests), device)["achieved_rps"]
    bar.update()
    rng = np.random.default_rng(seed + 1)
    points = []
    for frac in rate_fractions:
        rate = capacity * frac
        arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
        point = serve(engine, prompts, output_lens, arrivals, device)
        points.append({"rate_fraction": frac, "rate_rps": rate, **point})
        bar.update()
        bar.write(
            f"  load: {rate:7.2f} req/s offered -> {point['achieved_rps']:.2f} done/s, e2e mean "
            f"{point['e2e']['mean'] * 1e3:.0f} ms, "
            f"p99 {point['e2e']['p99'] * 1e3:.0f} ms, ttft {point['ttft']['mean'] * 1e3:.0f} ms, itl "
            f"{point['itl']['mean'] * 1e3:.1f} ms",
            file=sys.stdout,
        )
    bar.close()
    result = {
        "experiment": "load",
        "model": model_label(model),
        "device": str(device),
        "seed": seed,
        "environment": env or {},
        "num_requests": num_requests,
        "max_len": max_len,
        "capacity_rps": capacity,
        "workload": {"prompt_len_mean": mean([len(p) for p in prompts]), "output_len_mean": mean(output_lens)},
        "points": points,
    }
    plots.write_json(out_dir, "load", result)
    plots.plot_load(result, out_dir)
    return result
