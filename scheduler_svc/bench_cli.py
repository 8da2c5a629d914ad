"""`picovllm bench experiments|throughput`: the benchmarks of the repository's bench/ folder.

bench/ is not an installed package: it is found beside this package in a source checkout and
loaded only when a bench command runs (an installed copy says, in one line, that it needs a
checkout). The experiments' flags live here, so the CLI's parser never loads bench/.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from scheduler_svc.cli_args import UsageError, add_log_flags

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "bench"
EXPERIMENTS = ("memory", "heatmap", "memory_hybrid", "load", "steps")


def add_experiment_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of `bench experiments` (and of `python -m bench.experiments.run`)."""
    ap.add_argument("--out", default="report", help="folder for the JSON and PNG files (default: report)")
    ap.add_argument(
        "--only", choices=EXPERIMENTS, action="append", help="run only this experiment (repeatable; default: all)"
    )
    ap.add_argument(
        "--model",
        default=None,
        help="load/steps: the bundled model (default), 'qwen3-0.6b' or 'tiny' (random weights) "
        "or a local model directory; memory/heatmap always use the bundled model on the CPU, "
        "memory_hybrid a random hybrid sliding-window model on the CPU",
    )
    ap.add_argument("--device", default="cpu", help="load/steps device: cpu (default) or cuda")
    ap.add_argument("--seed", type=int, default=0, help="seed of the workloads (default: 0)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: fastest for the tiny bundled model)"
    )


def _bench_root() -> Path:
    if not (BENCH_DIR / "__init__.py").is_file():
        raise UsageError(
            f"`picovllm bench` needs a source checkout of pico-vllm: its bench/ folder is not at {BENCH_DIR}"
        )
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return REPO_ROOT


def cmd_experiments(args: argparse.Namespace) -> int:
    _bench_root()
    # Before any work: the plots are written last, after minutes of running.
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            "bench experiments draws its plots with matplotlib, which is not installed: pip install -e .[bench]"
        )
    run = importlib.import_module("bench.experiments.run")
    run.run(args)
    return 0


def cmd_throughput(args: argparse.Namespace) -> int:
    root = _bench_root()
    path = root / "bench" / "throughput.py"
    spec = importlib.util.spec_from_file_location("bench.throughput", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no benchmark at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rest = list(args.bench_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    saved = sys.argv
    sys.argv = [str(path.relative_to(root)), *rest]
    try:
        module.main()
    finally:
        sys.argv = saved
    return 0


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks and the reported experiments (from a source checkout)",
        description="Benchmarks of the bench/ folder of a source checkout.",
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    exp = sub.add_parser(
        "experiments",
        help="memory, block heatmap, load sweep and step profile: JSON + PNG into --out",
        description="Run the experiments the project reports and write <name>.json and <name>.png for each "
        "into --out. Needs matplotlib (pip install -e .[bench]).",
    )
    add_log_flags(exp)
    add_experiment_arguments(exp)
    exp.set_defaults(func=cmd_experiments)

    thr = sub.add_parser(
        "throughput",
        help="offline throughput (bench/throughput.py); its flags follow (see: bench throughput --help)",
        add_help=False,
        prefix_chars="+",
    )  # every flag after `throughput` goes to the script
    thr.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for bench/throughput.py (try --help)")
    thr.set_defaults(func=cmd_throughput)
