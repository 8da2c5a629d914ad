"""Run the experiments and write their JSON + PNG files into one folder.

python -m bench.experiments.run [--out report] [--only memory] [--model tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler_svc.bench_cli import EXPERIMENTS, add_experiment_arguments  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    import torch

    from bench.common import environment

    torch.set_num_threads(args.threads)
    env = environment()
    env["torch_threads"] = args.threads
    flags = [f"--out {args.out}"] + [f"--only {n}" for n in args.only or []]
    flags += [
        f"--{k} {v}"
        for k, v in (("model", args.model), ("device", args.device), ("seed", args.seed), ("threads", args.threads))
        if v not in (None, "cpu", 0, 1)
    ]
    env["command"] = " ".join(["picovllm bench experiments", *flags])
    out = Path(args.out)
    selected = args.only or list(EXPERIMENTS)
    results, trace = {}, None
    for name in EXPERIMENTS:
        if name not in selected:
            continue
        t = time.perf_counter()
        if name == "memory":
            from bench.experiments import memory

            results[name], trace = memory.run(out, seed=args.seed, env=env, return_trace=True)
        elif name == "heatmap":
            from bench.experiments import heatmap

            results[name] = heatmap.run(out, seed=args.seed, env=env, trace=trace)
        elif name == "memory_hybrid":
            from bench.experiments import memory_hybrid

            results[name] = memory_hybrid.run(out, seed=args.seed, env=env)
        elif name == "load":
            from bench.experiments import load

            results[name] = load.run(out, model=args.model, device=args.device, seed=args.seed, env=env)
        elif name == "steps":
            from bench.experiments import steps

            results[name] = steps.run(out, model=args.model, device=args.device, seed=args.seed, env=env)
        print(
            f"{name}: {out / (name + '.json')}, {out / (name + '.png')} ({time.perf_counter() - t:.1f} s)", flush=True
        )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_experiment_arguments(ap)
    if importlib.util.find_spec("matplotlib") is None:  # before any work: the plots come last
        sys.exit("bench.experiments: the plots need matplotlib, which is not installed: pip install -e .[bench]")
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
