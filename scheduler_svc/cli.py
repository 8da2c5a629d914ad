"""`picovllm`: generate (embedded), serve, client, bench.

Errors a user can fix (a missing model directory, a bad flag value) print one line and exit
with status 2; they never print a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from scheduler_svc.sampling_params import SamplingParams


class UsageError(Exception):
    """A user-facing error: printed as one line."""


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per generated token")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
            max_tokens=args.max_tokens, stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, logprobs=args.logprobs,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    from scheduler_svc.config import BUNDLED_MODEL

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=BUNDLED_MODEL, help="local Hugging Face model directory (default: the bundled stories260k)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="device pool size in blocks")
    g.add_argument("--num-cpu-blocks", type=int, default=None, help="host (swap) pool size in blocks")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--preemption-mode", default="swap", choices=["swap", "recompute"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--num-scheduler-steps", type=int, default=1, help="decode steps per schedule (multi-step)")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 for a model under 100M parameters, else one per core)")


def engine_config_from_args(args: argparse.Namespace):
    from scheduler_svc.config import EngineConfig

    try:
        return EngineConfig(
            model=args.model, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=args.num_cpu_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, preemption_mode=args.preemption_mode,
            enable_prefix_caching=not args.no_prefix_caching, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
            num_scheduler_steps=args.num_scheduler_steps, torch_threads=args.torch_threads,
        )
    except (ValueError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    config = engine_config_from_args(args)
    from scheduler_svc.engine import LLMEngine

    try:
        engine = LLMEngine(config)
        request_id = engine.add_request(args.prompt, params)
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise UsageError(str(exc)) from None
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == request_id:
                out.write(o.delta_text)
                out.flush()
                final = o
    out.write("\n")
    if args.verbose and final is not None:
        print(f"[{len(final.token_ids)} tokens, finish_reason={final.finish_reason}]", file=sys.stderr)
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="picovllm", description="pico-vllm: a small LLM inference server with a paged KV cache")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text in this process (no server needed)")
    gen.add_argument("prompt", help="the prompt text")
    add_engine_flags(gen)
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    for register in _plugins():
        register(sub)
    return parser


def _plugins():
    """Subcommands that live beside the code they drive (serve, client, bench)."""
    registrars = []
    for module, attr in (("scheduler_svc.serve_cli", "register"), ("scheduler_svc.client", "register"), ("scheduler_svc.bench_cli", "register")):
        try:
            mod = __import__(module, fromlist=[attr])
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        registrars.append(getattr(mod, attr))
    return registrars


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except UsageError as exc:
        print(f"picovllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Through the package module, so plugins' `UsageError` is the same class as main()'s.
    from scheduler_svc.cli import main as _main

    sys.exit(_main())
