"""Memory: paged blocks vs a contiguous max_model_len reservation, on one real engine run.

The engine (bundled model, CPU) runs a batch of requests whose lengths follow a long-tailed
distribution, on a fixed KV budget (device blocks). After every step the KV manager's block
tables and the requests' computed-token counts are read:

- paged: requests resident (admitted, not swapped), KV bytes held per request, and the
  fragmentation proxy 1 - used_slots / (allocated_blocks * block_size);
- contiguous (analytical, same trace): every request reserves max_model_len slots, so the
  same budget admits budget_tokens // max_model_len requests and the same live requests
  would leave 1 - used_slots / (n_live * max_model_len) of their reservation empty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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


@dataclass
class Trace:
    """What one instrumented run saw, step by step."""

    block_size: int
    num_blocks: int
    max_model_len: int
    kv_bytes_per_token: int
    running: list[int] = field(default_factory=list)  # resident requests after the step
    waiting: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    used_slots: list[int] = field(default_factory=list)  # tokens with K/V in device blocks
    allocated_blocks: list[int] = field(default_factory=list)  # distinct device blocks in tables
    step_blocks: list[int] = field(default_factory=list)  # ... while the step runs (after its schedule)
    live_tokens: list[list[int]] = field(default_factory=list)  # per resident request: computed tokens
    batched_tokens: list[int] = field(default_factory=list)
    writes: list[dict[int, int]] = field(default_factory=list)  # per step: block id -> tokens written
    peak_blocks: dict[str, int] = field(default_factory=dict)  # per request: most blocks held
    final_tokens: dict[str, int] = field(default_factory=dict)  # per request: prompt + output
    wall_s: float = 0.0
    num_preemptions: int = 0


def record_run(engine, prompts: list[list[int]], output_lens: list[int]) -> Trace:
    """Run the requests to completion, reading the KV tables around every engine step."""
    from contracts.kv_groups import NO_BLOCK
    from kvcache_svc.block_pool import Tier

    kv, sched = engine.kv, engine.scheduler
    cfg = engine.model_config
    dtype_bytes = getattr(getattr(engine.model, "dtype", None), "itemsize", 4)
    trace = Trace(
        kv.block_size,
        kv.device.num_blocks,
        engine.max_model_len,
        cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes,
    )
    bs, groups = kv.block_size, kv.num_groups
    pending: dict[str, object] = {}

    def schedule_hook(orig=sched.schedule):
        out = orig()
        # Positions written this step, mapped through the tables the model step will use.
        written: dict[int, int] = {}
        for seq in out.step.seqs:
            table = kv.block_table(seq.seq_id)
            for pos in range(seq.start_pos, seq.start_pos + len(seq.token_ids)):
                for g in range(groups):  # the tables are group-minor (contracts.kv_groups)
                    block = table[pos // bs * groups + g]
                    written[block] = written.get(block, 0) + 1
        pending["writes"] = written
        pending["batched"] = out.num_batched_tokens
        held = (b for s in kv.seqs.values() if s.tier == Tier.DEVICE for b in s.block_ids if b != NO_BLOCK)
        pending["held"] = len(set(held))
        return out

    sched.schedule = schedule_hook
    for prompt, out_len in zip(prompts, output_lens):
        rid = engine.add_request(prompt, sampling(out_len))
        trace.final_tokens[rid] = len(prompt) + out_len
    t0 = time.perf_counter()
    bar = progress(len(prompts), "memory")
    try:
        while engine.has_unfinished():
            pending.clear()
            bar.update(num_finished(engine.step()))
            if "writes" not in pending:
                continue
            blocks: set[int] = set()
            lens = []
            for seq_id, seq in kv.seqs.items():
                if seq.tier != Tier.DEVICE:
                    continue
                live = [b for b in seq.block_ids if b != NO_BLOCK]
                blocks.update(live)
                trace.peak_blocks[seq_id] = max(trace.peak_blocks.get(seq_id, 0), len(live))
                req = engine.requests.get(seq_id)
                lens.append(req.num_computed_tokens if req is not None else 0)
            trace.running.append(len(sched.running))
            trace.waiting.append(len(sched.waiting))
            trace.swapped.append(len(sched.swapped))
            trace.used_slots.append(sum(lens))
            trace.allocated_blocks.append(len(blocks))
            trace.live_tokens.append(lens)
            trace.batched_tokens.append(pending["batched"])
            trace.step_blocks.append(pending["held"])
            trace.writes.append(pending["writes"])
    finally:
        del sched.schedule
        bar.close()
    trace.wall_s = time.perf_counter() - t0
    trace.num_preemptions = sched.stats.num_preemptions
    return trace


def traced_run(num_requests: int, num_gpu_blocks: int, seed: int, device: str) -> tuple[Trace, list[int], list[int]]:
    """The long-tailed workload through one instrumented engine on the bundled model, with a
    host tier four times the device's: the trace, the prompt lengths, the output lengths."""
    engine = build_engine(
        None,
        device,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=4 * num_gpu_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
    )
    prompts, output_lens = make_workload(num_requests, engine.max_model_len, engine.model_config.vocab_size, seed)
    return record_run(engine, prompts, output_lens), [len(p) for p in prompts], output_lens


def simulate_contiguous(prompt_lens: list[int], output_lens: list[int], slots: int) -> int:
    """Steps to finish the trace when at most `slots` requests are resident (FCFS), each
    taking one step of prefill and one step per further output token."""
    if slots < 1:
        return -1
    finish: list[int] = []  # finishing steps of the resident requests (a min-heap)
    import heapq

    step = 0
    for o in output_lens:
        if len(finish) >= slots:
            step = max(step, heapq.heappop(finish))
        heapq.heappush(finish, step + max(1, o))
    return max(finish) if finish else 0


def analyze(trace: Trace, prompt_lens: list[int], output_lens: list[int]) -> dict:
    bs, L = trace.block_size, trace.max_model_len
    budget_tokens = trace.num_blocks * bs
    contiguous_admitted = budget_tokens // L
    used = np.asarray(trace.used_slots, dtype=float)
    alloc = np.asarray(trace.allocated_blocks, dtype=float) * bs
    frag_paged = np.where(alloc > 0, 1.0 - used / np.maximum(alloc, 1), np.nan)
    n_live = np.asarray([len(x) for x in trace.live_tokens], dtype=float)
    frag_contig = np.where(n_live > 0, 1.0 - used / np.maximum(n_live * L, 1), np.nan)
    loaded = [r for r, w in zip(trace.running, trace.waiting) if w > 0]  # steps with a queue
    per_tok = trace.kv_bytes_per_token
    paged_bytes = [b * bs * per_tok for b in trace.peak_blocks.values()]
    exact_bytes = [n * per_tok for n in trace.final_tokens.values()]
    contig_bytes = [L * per_tok] * len(trace.final_tokens)
    return {
        "kv_budget": {
            "blocks": trace.num_blocks,
            "block_size": bs,
            "tokens": budget_tokens,
            "bytes": budget_tokens * per_tok,
            "kv_bytes_per_token": per_tok,
            "max_model_len": L,
        },
        "workload": {
            "num_requests": len(prompt_lens),
            "prompt_len_mean": mean(prompt_lens),
            "prompt_len_p95": pct(prompt_lens, 95),
            "output_len_mean": mean(output_lens),
            "output_len_p95": pct(output_lens, 95),
            "total_len_mean": mean(np.add(prompt_lens, output_lens)),
            "total_len_p95": pct(np.add(prompt_lens, output_lens), 95),
        },
        "admitted": {
            "paged_peak": int(max(trace.running, default=0)),
            "paged_mean_under_load": mean(loaded),
            "contiguous": int(contiguous_admitted),
        },
        "kv_bytes_per_request": {
            "paged": {"mean": mean(paged_bytes), "p95": pct(paged_bytes, 95)},
            "contiguous": {"mean": mean(contig_bytes), "p95": pct(contig_bytes, 95)},
            "exact_tokens": {"mean": mean(exact_bytes), "p95": pct(exact_bytes, 95)},
        },
        "fragmentation": {
            "paged_mean": float(np.nanmean(frag_paged)),
            "paged_max": float(np.nanmax(frag_paged)),
            "contiguous_mean": float(np.nanmean(frag_contig)),
            "contiguous_max": float(np.nanmax(frag_contig)),
            "paged_per_step": [round(float(x), 4) for x in frag_paged],
            "contiguous_per_step": [round(float(x), 4) for x in frag_contig],
        },
        "per_step": {
            "running": trace.running,
            "waiting": trace.waiting,
            "swapped": trace.swapped,
            "used_slots": trace.used_slots,
            "allocated_blocks": trace.allocated_blocks,
        },
        "steps": {
            "paged_measured": len(trace.running),
            "contiguous_simulated": simulate_contiguous(prompt_lens, output_lens, contiguous_admitted),
        },
        "num_preemptions": trace.num_preemptions,
        "wall_s": round(trace.wall_s, 2),
    }


def run(
    out_dir,
    *,
    num_requests: int = 160,
    num_gpu_blocks: int = 256,
    seed: int = 0,
    device: str = "cpu",
    env: dict | None = None,
    return_trace: bool = False,
):
    """The memory experiment on the bundled model (the CPU); writes memory.json and memory.png."""
    from bench.experiments import plots

    trace, prompt_lens, output_lens = traced_run(num_requests, num_gpu_blocks, seed, device)
    result = {
        "experiment": "memory",
        "model": model_label(None),
        "device": device,
        "seed": seed,
        "environment": env or {},
        **analyze(trace, prompt_lens, output_lens),
    }
    plots.write_json(out_dir, "memory", result)
    plots.plot_memory(result, out_dir)
    return (result, trace) if return_trace else result
