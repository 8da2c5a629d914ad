"""Per-step profile: the distribution of batched tokens per step and where a step's time goes.

The engine's phases are timed by wrapping them on this engine instance only (perf_counter):
schedule (Scheduler.schedule), model (the model runner's step), output (Scheduler.update and
the engine's output processing: stop checks, detokenization, RequestOutputs); "other" is the
rest of LLMEngine.step. The workload is a batch with chat-like lengths, all arriving at once,
with a token budget per step small enough that prefill chunks mix with decodes.
"""

from __future__ import annotations

import time

import numpy as np

from bench.experiments.common import (
    build_engine,
    make_workload,
    mean,
    model_label,
    num_finished,
    pct,
    progress,
    sampling,
)

PHASES = ("schedule", "model", "output", "other")


def _timed(fn, bucket: dict, key: str, sync=None):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync is not None:
                sync()
            bucket[key] = bucket.get(key, 0.0) + time.perf_counter() - t

    return wrapper


def profile(engine, prompts, output_lens, device: str = "cpu") -> dict:
    sync = None
    if str(device).startswith("cuda"):
        import torch

        sync = torch.cuda.synchronize
    cur: dict[str, float] = {}
    batched: list[int] = []
    sched = engine.scheduler
    orig_schedule = sched.schedule

    def schedule():
        out = orig_schedule()
        batched.append(out.num_batched_tokens)
        return out

    sched.schedule = _timed(schedule, cur, "schedule")
    sched.update = _timed(sched.update, cur, "output")
    engine._process = _timed(engine._process, cur, "output")
    engine.model.step = _timed(engine.model.step, cur, "model", sync)
    rows = {p: [] for p in PHASES}
    kept = []
    bar = progress(len(prompts), "steps")
    try:
        for prompt, n in zip(prompts, output_lens):
            engine.add_request(prompt, sampling(n))
        while engine.has_unfinished():
            cur.clear()
            n_before = len(batched)
            t = time.perf_counter()
            outs = engine.step()
            total = time.perf_counter() - t
            bar.update(num_finished(outs))
            if "model" not in cur:  # nothing to run this step
                continue
            kept.append(batched[n_before])
            for p in ("schedule", "model", "output"):
                rows[p].append(cur.get(p, 0.0) * 1e3)
            rows["other"].append(max(0.0, total * 1e3 - sum(rows[p][-1] for p in ("schedule", "model", "output"))))
    finally:
        for obj, name in ((sched, "schedule"), (sched, "update"), (engine, "_process"), (engine.model, "step")):
            obj.__dict__.pop(name, None)
        bar.close()
    return {"batched_tokens": kept, **{f"{p}_ms": [round(x, 4) for x in rows[p]] for p in PHASES}}


def run(
    out_dir,
    *,
    model: str | None = None,
    device: str = "cpu",
    num_requests: int | None = None,
    seed: int = 0,
    env: dict | None = None,
    max_num_batched_tokens: int | None = None,
) -> dict:
    from bench.experiments import plots

    on_gpu = str(device).startswith("cuda")
    num_requests = num_requests or (256 if on_gpu else 64)
    budget = max_num_batched_tokens or (2048 if on_gpu else 512)
    engine = build_engine(
        model, device, num_gpu_blocks=None if on_gpu else 512, max_num_seqs=256, max_num_batched_tokens=budget
    )
    max_len = min(engine.max_model_len, 1024 if on_gpu else 512)
    prompts, output_lens = make_workload(num_requests, max_len, engine.model_config.vocab_size, seed)
    profile(engine, prompts[:4], [4] * 4, device)  # warm-up
    per_step = profile(engine, prompts, output_lens, device)
    bt = per_step["batched_tokens"]
    result = {
        "experiment": "steps",
        "model": model_label(model),
        "device": str(device),
        "seed": seed,
        "environment": env or {},
        "num_requests": num_requests,
        "max_num_batched_tokens": budget,
        "steps": len(bt),
        "batched_tokens": {"mean": mean(bt), "p50": pct(bt, 50), "p95": pct(bt, 95), "max": int(max(bt, default=0))},
        "breakdown_ms": {
            p: {
                "mean": mean(per_step[f"{p}_ms"]),
                "p50": pct(per_step[f"{p}_ms"], 50),
                "p99": pct(per_step[f"{p}_ms"], 99),
                "total": float(np.sum(per_step[f"{p}_ms"])),
            }
            for p in PHASES
        },
        "per_step": per_step,
    }
    plots.write_json(out_dir, "steps", result)
    plots.plot_steps(result, out_dir)
    return result
