"""Shared pieces: building an engine for an experiment, a length distribution, percentiles,
progress bars."""

from __future__ import annotations

import math
import sys

import numpy as np


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    """Long-tailed lengths (the shape of chat prompt/response lengths), clipped to [lo, hi]."""
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def make_workload(
    n: int,
    max_model_len: int,
    vocab_size: int,
    seed: int = 0,
    prompt_median: float | None = None,
    output_median: float | None = None,
) -> tuple[list[list[int]], list[int]]:
    """n random-token prompts and their output lengths; prompt + output <= max_model_len.

    Defaults scale a chat-like distribution to the context: prompt median max_model_len / 8
    (sigma 0.8), output median max_model_len / 5 (sigma 0.7)."""
    rng = np.random.default_rng(seed)
    prompt_median = prompt_median or max_model_len / 8
    output_median = output_median or max_model_len / 5
    prompt_lens = lognormal_lengths(rng, n, prompt_median, 0.8, 4, max_model_len // 2)
    output_lens = lognormal_lengths(rng, n, output_median, 0.7, 2, max_model_len)
    output_lens = np.minimum(output_lens, max_model_len - 1 - prompt_lens)
    # Token ids away from the special ones (0..2) so no prompt looks like bos/eos.
    prompts = [[int(t) for t in rng.integers(3, vocab_size, p)] for p in prompt_lens]
    return prompts, [int(o) for o in output_lens]


def sampling(max_tokens: int):
    from scheduler_svc import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def build_engine(
    model: str | None = None,
    device: str = "cpu",
    *,
    num_gpu_blocks: int | None = None,
    num_cpu_blocks: int | None = None,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    dtype: str | None = None,
):
    """An LLMEngine in this process: the bundled model (model None or "bundled"), a named
    random-weight config ("qwen3-0.6b", "tiny"), or a local model directory. Token-id prompts only."""
    from contracts.service_config import BUNDLED_MODEL
    from scheduler_svc.config import EngineConfig
    from scheduler_svc.engine import LLMEngine

    common = dict(
        device=device,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=num_cpu_blocks,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        skip_tokenizer_init=True,
    )
    if model in (None, "", "bundled", BUNDLED_MODEL):
        return LLMEngine(EngineConfig(model=BUNDLED_MODEL, **common))
    from bench.common import build_runner

    path, runner = build_runner(
        model,
        device,
        dtype,
        block_size=block_size,
        num_device_blocks=num_gpu_blocks,
        num_host_blocks=num_cpu_blocks or 0,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    return LLMEngine(EngineConfig(model=path, **common), model=runner)


def progress(total: int, desc: str, unit: str = "req"):
    """A tqdm bar on stderr for a run of minutes; off where stderr is not a terminal (logs)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)


def num_finished(outputs) -> int:
    return sum(1 for o in outputs if o.finished)


def model_label(model: str | None) -> str:
    return "stories260k (bundled)" if model in (None, "", "bundled") else model


def pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def mean(values) -> float:
    return float(np.mean(np.asarray(values, dtype=float))) if len(values) else float("nan")
