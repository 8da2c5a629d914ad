"""`picovllm`: generate (embedded), serve, client, bench.

Errors a user can fix (a missing model directory, a bad flag value, a port that is taken)
print one line and exit with status 2; they never print a traceback.

Temperature: `generate` and `client` default to 0 (greedy: the same text every run, what one
wants from a command line); `SamplingParams` and the gRPC API default to 1.0, as vLLM does.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

from contracts.sampling_params import SamplingParams
from scheduler_svc import bench_cli, client, serve_cli
from scheduler_svc.cli_args import HelpFormatter, UsageError, add_log_flags, add_sampling_flags, sampling_kwargs


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(**sampling_kwargs(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


MODEL_HELP = (
    "a local Hugging Face model directory, or a repo id (org/name) already in the local Hugging Face cache; "
    "never downloaded"
)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    from contracts.engine_fields import KV_CACHE_DTYPES
    from contracts.service_config import BUNDLED_MODEL

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=BUNDLED_MODEL, help=MODEL_HELP + " (default: the bundled stories260k)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    g.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu)"
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; fp8: float8_e4m3fn, half the bytes a token (not bit-exact) (default: auto)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two)")
    g.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="device KV pool size in blocks (default: measured from free memory)",
    )
    g.add_argument(
        "--num-cpu-blocks",
        type=int,
        default=None,
        help="host (swap) KV pool size in blocks (default: 1 GiB of blocks, at most 4x the device pool)",
    )
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one step at most")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens in one step at most, prompt chunks included (default: 16384 on a GPU of 70+ GiB, else 8192)",
    )
    g.add_argument(
        "--preemption-mode",
        default="swap",
        choices=["swap", "recompute"],
        help="what a preempted request does with its KV blocks: swap them to the host pool, or drop and recompute them",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off (default: on)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (default: off, graphs on cuda)")
    g.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: 1 for a model under 100M parameters, else one per core)",
    )
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="split the model over this many devices (one process each)"
    )


def engine_config_from_args(args: argparse.Namespace):
    from scheduler_svc.config import EngineConfig

    try:
        return EngineConfig(
            model=args.model,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            num_cpu_blocks=args.num_cpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            preemption_mode=args.preemption_mode,
            enable_prefix_caching=not args.no_prefix_caching,
            device=args.device,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=args.enforce_eager,
            torch_threads=args.torch_threads,
            tensor_parallel_size=args.tensor_parallel_size,
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
    """Every parser of the CLI (subcommands inherit the class): one-line errors, and help
    that states each flag's default."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, not usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def package_version() -> str:
    try:
        return metadata.version("pico-vllm")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(version unknown: not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="picovllm", description="pico-vllm: a small LLM inference server with a paged KV cache")
    parser.add_argument(
        "--version", action="version", version=f"picovllm {package_version()}", help="print the version and exit"
    )
    add_log_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text in this process (no server needed)",
        description="Generate text in this process: no server, no Redis, no GPU needed. "
        "Greedy unless --temperature is given.",
    )
    gen.add_argument("prompt", help="the prompt text")
    add_log_flags(gen)
    add_engine_flags(gen)
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    for module in (serve_cli, client, bench_cli):  # subcommands that live beside the code they drive
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or ("INFO" if args.verbose else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except UsageError as exc:
        print(f"picovllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
