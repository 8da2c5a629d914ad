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

from bench.experiments import EXPERIMENTS  # noqa: E402


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="report", help="folder for the JSON and PNG files (default: report)")
    ap.add_argument("--only", choices=EXPERIMENTS, action="append", help="run only this experiment (repeatable; default: all)")
    ap.add_argument("--model", default=None,
                    help="load/steps: the bundled model (default), 'qwen3-0.6b' or 'tiny' (random weights) or a local model directory; "
                         "memory/heatmap always use the bundled model on the CPU")
    ap.add_argument("--device", default="cpu", help="load/steps device: cpu (default) or cuda")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workloads (default: 0)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: fastest for the tiny bundled model)")


def run(args: argparse.Namespace) -> dict:
    import torch

    from bench.common import environment

    torch.set_num_threads(args.threads)
    env = environment()
    env["torch_threads"] = args.threads
    flags = [f"--out {args.out}"] + [f"--only {n}" for n in args.only or []]
    flags += [f"--{k} {v}" for k, v in (("model", args.model), ("device", args.device), ("seed", args.seed), ("threads", args.threads))
              if v not in (None, "cpu", 0, 1)]
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
        elif name == "load":
            from bench.experiments import load

            results[name] = load.run(out, model=args.model, device=args.device, seed=args.seed, env=env)
        elif name == "steps":
            from bench.experiments import steps

            results[name] = steps.run(out, model=args.model, device=args.device, seed=args.seed, env=env)
        print(f"{name}: {out / (name + '.json')}, {out / (name + '.png')} ({time.perf_counter() - t:.1f} s)", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    if importlib.util.find_spec("matplotlib") is None:  # before any work: the plots come last
        sys.exit("bench.experiments: the plots need matplotlib, which is not installed: pip install -e .[bench]")
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
