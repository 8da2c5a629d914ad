"""`picovllm serve scheduler|kvcache|model|all`: run the gRPC services.

`all` starts the three as child processes on loopback (a one-machine deployment) and stops
them together: SIGTERM drains the scheduler first, then stops the other two.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# flag -> (section, key, type); flags override the environment and the YAML file.
FLAGS: dict[str, tuple[str, str, type]] = {
    "--scheduler-addr": ("scheduler", "address", str),
    "--kvcache-addr": ("kvcache", "address", str),
    "--model-addr": ("model", "address", str),
    "--redis-url": ("kvcache", "redis_url", str),
    "--deployment": ("kvcache", "deployment", str),
    "--metrics-port": ("scheduler", "metrics_port", int),
    "--max-waiting": ("scheduler", "max_waiting", int),
    "--max-num-seqs": ("scheduler", "max_num_seqs", int),
    "--max-num-batched-tokens": ("scheduler", "max_num_batched_tokens", int),
    "--max-model-len": ("scheduler", "max_model_len", int),
    "--preemption-mode": ("scheduler", "preemption_mode", str),
    "--num-scheduler-steps": ("scheduler", "num_scheduler_steps", int),
    "--drain-timeout": ("scheduler", "drain_timeout_s", float),
    "--model": ("model", "model", str),
    "--block-size": ("model", "block_size", int),
    "--num-gpu-blocks": ("model", "num_gpu_blocks", int),
    "--num-cpu-blocks": ("model", "num_cpu_blocks", int),
    "--device": ("model", "device", str),
    "--dtype": ("model", "dtype", str),
    "--torch-threads": ("model", "torch_threads", int),
}
KINDS = ("scheduler", "kvcache", "model", "all")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="run a gRPC service (scheduler, kvcache, model) or all three")
    p.add_argument("kind", choices=KINDS, help="which service; 'all' runs the three as processes on this machine")
    p.add_argument("--config", default=None, help="YAML file with scheduler/kvcache/model sections (or $PICOVLLM_CONFIG)")
    for flag, (section, key, typ) in FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=f"{section}.{key}")
    p.add_argument("--no-prefix-caching", action="store_true", help="scheduler.enable_prefix_caching = false")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="scheduler.async_scheduling: pipeline the model steps, two ahead (default: on when the model service runs on a GPU)")
    p.add_argument("--listen", default=None, help="bind this address instead of the service's own (e.g. 0.0.0.0:50052 in a container)")
    p.set_defaults(func=cmd_serve)


def config_from_args(args: argparse.Namespace):
    from scheduler_svc.service_config import load_config

    overrides: dict[str, dict] = {"scheduler": {}, "kvcache": {}, "model": {}}
    for flag, (section, key, _) in FLAGS.items():
        overrides[section][key] = getattr(args, flag[2:].replace("-", "_"))
    if args.no_prefix_caching:
        overrides["scheduler"]["enable_prefix_caching"] = False
    if args.async_scheduling is not None:
        overrides["scheduler"]["async_scheduling"] = args.async_scheduling
    return load_config(args.config, overrides)


def child_argv(args: argparse.Namespace, kind: str) -> list[str]:
    argv = [sys.executable, "-m", "scheduler_svc.cli"] + (["-v"] if args.verbose else []) + ["serve", kind]
    if args.config:
        argv += ["--config", args.config]
    for flag in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if args.async_scheduling is not None:
        argv.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    return argv


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:  # one line, exit status 2 (as the CLI's UsageError)
        print(f"picovllm: error: {exc}", file=sys.stderr)
        return 2
    dirs = {"model": [config.model.model], "scheduler": [config.tokenizer], "all": [config.model.model, config.tokenizer]}
    missing = [d for d in dirs.get(args.kind, []) if not Path(d).is_dir()]
    if missing:
        print(f"picovllm: error: model directory not found: {missing[0]}", file=sys.stderr)
        return 2
    if args.listen:
        if args.kind == "all":
            print("picovllm: error: --listen applies to one service, not 'all'", file=sys.stderr)
            return 2
        os.environ["PICOVLLM_LISTEN"] = args.listen
    if args.kind == "all":
        return serve_all(args)
    if args.kind == "kvcache":
        from kvcache_svc.server import serve

        asyncio.run(serve(config.kvcache))
    elif args.kind == "model":
        from model_svc.server import serve as serve_model

        asyncio.run(serve_model(config.model, config.scheduler.max_num_seqs))
    else:
        from scheduler_svc.server import serve as serve_scheduler

        asyncio.run(serve_scheduler(config))
    return 0


def serve_all(args: argparse.Namespace) -> int:
    """The three services as children; the first to exit (or a signal) stops the rest."""
    children = {kind: subprocess.Popen(child_argv(args, kind), preexec_fn=_die_with_parent) for kind in ("kvcache", "model", "scheduler")}
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    while not stopping:
        exited = [(k, p.returncode) for k, p in children.items() if p.poll() is not None]
        if exited:
            kind, code = exited[0]
            logger.error("%s service exited with %s; stopping the others", kind, code)
            break
        time.sleep(0.2)
    for kind in ("scheduler", "model", "kvcache"):  # the scheduler drains while its peers still run
        _stop(children[kind], timeout=60 if kind == "scheduler" else 15)
    return code


def _die_with_parent() -> None:
    """Linux: a child gets SIGTERM when `serve all` dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
