"""Start-up to first token: `LLM(model=dir)` with every default in a fresh process, as a user
starts it, and where the time goes.

Each run is a new process (spawned, so the interpreter's start and the imports count). It
times the phases of `LLM()` by wrapping the runner's start-up steps in that process only
(product code unchanged): importing the package (torch, triton, transformers), loading the
weights onto the device (CUDA's context included), sizing the KV pool (one profiling forward,
its kernels compiled first), compiling the other Triton kernels side by side (from a rehearsal
of the graphs' work, prefills and sampling), capturing the CUDA graphs, the rest of `LLM()`
(tokenizer, scheduler), and then the first generate (one tiny prompt, 1 token). Triton's
compiles are counted by its post-compile hook.

Cold: Triton's cache in a fresh empty directory (a new machine, or a new Triton version).
Warm: the same directory again, as every later start finds it. The weights' files are in the
OS page cache in both (written just before, as a downloaded model is after its first start).

    python bench/startup.py --model qwen3-0.6b --warm-runs 2 --out bench/results/startup_h200.md
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import environment, in_fresh_process, write_result  # noqa: E402

PHASES = (
    ("import", "start the interpreter, import the package (torch, triton)"),
    ("load_model", "weights onto the device (CUDA context included)"),
    ("build_pools", "KV pool sizing (one profiling forward)"),
    ("compile_kernels", "Triton kernels, side by side (the graphs' work rehearsed, prefills, sampling)"),
    ("capture_graphs", "CUDA graphs (decode buckets, piecewise prefill)"),
    ("rest", "the rest of LLM() (tokenizer, scheduler)"),
    ("first_token", "first generate (tiny prompt, 1 token)"),
)


def _timed(spans: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spans[name] = spans.get(name, 0.0) + time.perf_counter() - t

    return wrapper


def _child(model_dir: str, spawned_at: float, profile: bool, conn) -> None:
    """One start in this fresh process: phase seconds, Triton compiles, and the total."""
    compiles = [0]
    from triton import knobs

    def hook(*args, **kwargs):
        compiles[0] += 1

    knobs.runtime.jit_post_compile_hook = hook
    import model_svc.runner as runner_mod
    from contracts.sampling_params import SamplingParams
    from scheduler_svc.llm import LLM

    spans: dict[str, float] = {"import": time.time() - spawned_at}
    runner_mod.load_model = _timed(spans, "load_model", runner_mod.load_model)
    runner_mod.compile_kernels = _timed(spans, "compile_kernels", runner_mod.compile_kernels)
    cls = runner_mod.ModelRunner
    cls._build_pools = _timed(spans, "build_pools", cls._build_pools)
    cls._capture_graphs = _timed(spans, "capture_graphs", cls._capture_graphs)
    profiler = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    llm = LLM(model=model_dir)
    llm_s = time.perf_counter() - t
    top = ""
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        top = text.getvalue()
    spans["rest"] = llm_s - sum(
        spans.get(k, 0.0) for k in ("load_model", "build_pools", "compile_kernels", "capture_graphs")
    )
    t = time.perf_counter()
    llm.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    spans["first_token"] = time.perf_counter() - t
    total = time.time() - spawned_at
    conn.send({"spans": spans, "compiles": compiles[0], "total": total, "profile": top})
    conn.close()
    os._exit(0)  # skip the interpreter's teardown: not part of a start


def one_start(model_dir: str, cache_dir: str, profile: bool = False) -> dict:
    os.environ["TRITON_CACHE_DIR"] = cache_dir  # the child's
    return in_fresh_process("start-up run", _child, model_dir, time.time(), profile)


def table(runs: list[tuple[str, dict]]) -> str:
    head = "| phase | " + " | ".join(label for label, _ in runs) + " |"
    lines = [head, "| --- |" + " ---: |" * len(runs)]
    for key, what in PHASES:
        lines.append(f"| {key}: {what} | " + " | ".join(f"{r['spans'].get(key, 0.0):.2f}" for _, r in runs) + " |")
    lines.append(
        "| **total, spawn to first token (s)** | " + " | ".join(f"**{r['total']:.2f}**" for _, r in runs) + " |"
    )
    lines.append("| Triton compiles | " + " | ".join(str(r["compiles"]) for _, r in runs) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default="qwen3-0.6b", help="a named config (random weights, Qwen2 tokenizer) or a directory"
    )
    ap.add_argument("--warm-runs", type=int, default=2, help="starts with the cache the cold start filled")
    ap.add_argument("--cold-runs", type=int, default=1, help="starts with an empty Triton cache (0: none)")
    ap.add_argument(
        "--triton-cache",
        default=None,
        help="the Triton cache directory of the warm starts (default: the one the cold start filled)",
    )
    ap.add_argument("--profile", default=None, help="write the last start's cProfile of LLM() (cumulative) here")
    ap.add_argument("--out", default=None, help="write the result here (markdown)")
    args = ap.parse_args()

    from bench.serve import prepare_model

    model_dir, tmp = prepare_model(args.model)
    scratch = tempfile.mkdtemp(prefix="picovllm-triton-cache-")
    runs = []
    for i in range(args.cold_runs):
        runs.append((f"cold {i + 1} (empty Triton cache)", one_start(model_dir, os.path.join(scratch, str(i)))))
        print(f"cold {i + 1}: {runs[-1][1]['total']:.2f} s", flush=True)
    cache = args.triton_cache or os.path.join(scratch, str(max(args.cold_runs - 1, 0)))
    for i in range(args.warm_runs):
        last = i == args.warm_runs - 1
        runs.append((f"warm {i + 1}", one_start(model_dir, cache, profile=bool(args.profile) and last)))
        print(f"warm {i + 1}: {runs[-1][1]['total']:.2f} s", flush=True)
    if args.profile:
        Path(args.profile).write_text(runs[-1][1]["profile"])
    body = table(runs)
    print(body)
    if args.out:
        note = (
            f"\n\n`LLM(model=dir)` with defaults, model `{args.model}`, each start a fresh spawned process; "
            "seconds per phase (bench/startup.py's docstring says what each covers).\n"
        )
        write_result(args.out, "Start-up to first token", environment(), body + note)
    for path in (tmp, scratch):
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
