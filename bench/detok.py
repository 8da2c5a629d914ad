"""Detokenization's cost to the engine, on the CPU: the engine over a model that costs
nothing (bench/null_model.py's NullRunner), so the host's per-step work is all there is, on
nano-vllm's workload (bench/throughput.py's make_workload), with three tokenizers:

- `qwen2`: the real Qwen2 tokenizer (tests/fixtures/qwen2_tokenizer/, 151,936 ids);
- `none`: skip_tokenizer_init (no text at all: the ceiling);
- `bytes`: a byte-level BPE of 256 ids and no merges, whose decode of ids past its
  vocabulary gives no text, so each request's undecoded window grows with its output (the
  slow case of a tokenizer that does not cover the model's vocabulary).

    python bench/detok.py                                  # 256 requests up to 1024 + 1024 tokens
    python bench/detok.py --num-seqs 16 --max-len 128      # a quick try

Prints engine tok/s for each (best of --repeats interleaved runs) and its ratio to `none`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import QWEN2_TOKENIZER, environment, model_dir_for, write_result  # noqa: E402
from bench.null_model import NullRunner  # noqa: E402
from bench.throughput import make_workload  # noqa: E402

TOKENIZERS = ("qwen2", "none", "bytes")


def byte_level_tokenizer(directory: str | Path):
    """A byte-level BPE tokenizer of 256 ids (one per byte, no merges), written to
    `directory`/tokenizer.json and loaded as the engine loads a model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from contracts.tokenizer import load_tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(Path(directory, "tokenizer.json")))
    return load_tokenizer(directory)


def tokenizer_for(name: str, scratch: str):
    """The tokenizer a run uses (None: skip_tokenizer_init)."""
    from contracts.tokenizer import load_tokenizer

    if name == "qwen2":
        return load_tokenizer(QWEN2_TOKENIZER)
    return byte_level_tokenizer(scratch) if name == "bytes" else None


def make_engine(name: str, async_scheduling: bool = True):
    """An LLM over the null model with the named tokenizer, warmed up with two tiny requests."""
    from scheduler_svc import SamplingParams
    from scheduler_svc.config import EngineConfig
    from scheduler_svc.engine import LLMEngine
    from scheduler_svc.llm import LLM

    model_dir, _ = model_dir_for("qwen3-0.6b")
    tokenizer = tokenizer_for(name, tempfile.mkdtemp(prefix="picovllm-bytes-"))
    config = EngineConfig(
        model=model_dir,
        device="cpu",
        skip_tokenizer_init=tokenizer is None,
        max_num_batched_tokens=16384,
        async_scheduling=async_scheduling,
    )
    llm = LLM.from_engine(LLMEngine(config, model=NullRunner(model_dir, 0.0, 20000), tokenizer=tokenizer))
    llm.generate([[1, 2, 3, 4], list(range(5, 40))], SamplingParams(max_tokens=8, ignore_eos=True))
    return llm


def timed(llm, prompts, params) -> tuple[int, float]:
    """Output tokens and seconds of one generate of the workload."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs), seconds


def run(names: list[str], num_seqs: int, max_len: int, repeats: int) -> dict[str, tuple[int, float]]:
    """Each tokenizer's best (fewest seconds) of `repeats` runs, the runs interleaved so that
    a machine whose load changes weighs on every tokenizer alike."""
    prompts, params = make_workload(num_seqs, max_len, max_len)
    engines = {name: make_engine(name) for name in names}
    best: dict[str, tuple[int, float]] = {}
    for _ in range(repeats):
        for name, llm in engines.items():
            n, seconds = timed(llm, prompts, params)
            if name not in best or seconds < best[name][1]:
                best[name] = (n, seconds)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256, help="requests in the workload")
    ap.add_argument("--max-len", type=int, default=1024, help="max input and output length")
    ap.add_argument("--tokenizers", default=",".join(TOKENIZERS), help="which runs, comma-separated")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (the best is reported)")
    ap.add_argument(
        "--batch-min-windows",
        type=int,
        default=None,
        help="steps with fewer windows decode one call each (default: scheduler_svc.detokenizer's)",
    )
    ap.add_argument("--out", default=None, help="write a markdown result here (default: print only)")
    args = ap.parse_args()
    if args.batch_min_windows is not None:
        from scheduler_svc import detokenizer

        detokenizer.BATCH_MIN_WINDOWS = args.batch_min_windows
    results = run(args.tokenizers.split(","), args.num_seqs, args.max_len, args.repeats)
    base = results.get("none")
    lines = ["| tokenizer | output tokens | seconds | engine tok/s | vs none |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, (n, s) in results.items():
        ratio = f"{n / s / (base[0] / base[1]):.1%}" if base else ""
        lines.append(f"| {name} | {n} | {s:.2f} | {n / s:,.0f} | {ratio} |")
    lines += [
        "",
        f"best of {args.repeats} interleaved runs each; engine over bench/null_model.py's NullRunner (0 ms steps)",
    ]
    print("\n".join(lines))
    if args.out:
        write_result(args.out, "Detokenization on the engine's path (null model, CPU)", environment(), "\n".join(lines))


if __name__ == "__main__":
    main()
