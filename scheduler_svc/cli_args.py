"""What every subcommand module of the CLI shares: the one-line error, the help formatter,
and the flag groups more than one subcommand takes. The subcommand modules (serve_cli,
client, bench_cli) import this, and cli imports them.
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A user-facing error: printed as one line."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help, unless the help states its default itself
    (a default of None always needs words: "measured", "none", "the model's limit")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def add_log_flags(p: argparse.ArgumentParser, top: bool = False) -> None:
    """-v and --log-level, accepted before the subcommand (`top`) and after it. After it they
    default to SUPPRESS: a subcommand's own default would overwrite a flag given before it."""
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="log progress (INFO) to stderr (default: warnings and errors only)",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=None if top else argparse.SUPPRESS,
        help="log level on stderr; wins over -v (default: WARNING, or INFO with -v)",
    )


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 = greedy (default: 0, greedy, on the command line; "
        "SamplingParams and the gRPC API default to 1.0 as vLLM does)",
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the most likely tokens up to this total probability; 1 = off",
    )
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 = off")
    g.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than this fraction of the most likely one; 0 = off",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of this request's random draws (default: none, a new draw each run)",
    )
    g.add_argument(
        "--stop", action="append", default=[], help="stop when this string is generated (repeatable; default: none)"
    )
    g.add_argument(
        "--stop-token-id",
        dest="stop_token_ids",
        type=int,
        action="append",
        default=[],
        help="stop when this token id is generated (repeatable; default: none)",
    )
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 discourages tokens of the prompt and the output; 1 = off",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted from the logits of tokens already generated; 0 = off",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted once per earlier occurrence in the output; 0 = off",
    )
    g.add_argument(
        "--logprobs", type=int, default=None, help="top-n log probabilities per generated token (default: none)"
    )


SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
)


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags (add_sampling_flags) as SamplingParams' keyword arguments."""
    return {name: getattr(args, name) for name in SAMPLING_FIELDS}
