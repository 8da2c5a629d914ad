"""Batched sampling on the device, with vLLM semantics.

One step: raw logprobs (if asked) -> penalties -> greedy argmax | temperature -> min-p ->
top-k -> top-p -> exponential-race sampling. Per-request knobs arrive as SamplingParams-like
objects (duck-typed: model_svc does not import the scheduler) and become (B,) tensors once per
step in SamplingBatch.build. A seeded request draws its noise from its own torch.Generator,
so its tokens do not depend on what else is in the batch.

A batch that fails is sampled again row by row, and the first row that fails alone is named
(SequenceFailed, with the row's sequence id), so that the scheduler fails that sequence only;
row_problem checks a sequence's knobs against the vocabulary when it arrives, before it is
ever in a batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from contracts.errors import SequenceFailed
from model_svc.transfer import to_device

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as in vLLM)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """One per seeded request, kept by the caller across steps."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


def row_problem(params: Any, vocab_size: int) -> str | None:
    """Why a sequence's knobs cannot be sampled with this vocabulary (None: they can)."""
    if params.logprobs is not None and not 0 <= params.logprobs <= vocab_size:
        return f"logprobs {params.logprobs} is not in [0, {vocab_size}] (the vocabulary size)"
    seed = getattr(params, "seed", None)
    if seed is not None and not -(1 << 63) <= seed < (1 << 64):
        return f"seed {seed} is not a 64-bit integer"
    return None


def is_greedy(params: Any) -> bool:
    """A row that takes the argmax: temperature ~ 0 or top_k == 1 (vLLM's rule)."""
    return params.temperature < _SAMPLING_EPS or params.top_k == 1


def plain_row(params: Any) -> tuple[float, bool] | None:
    """(temperature, greedy) of a row that the one-pass kernel can sample whatever its batch
    holds (Sampler's fused path, and the decode graphs' sampling): greedy, or temperature
    alone (no top-k, top-p, min-p or seed); no penalties or logprobs either way. None for any
    other row. A greedy row's temperature is 1.0, as SamplingBatch keeps it."""
    if (
        params.logprobs is not None
        or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    ):
        return None
    if is_greedy(params):
        return 1.0, True
    if params.top_k > 0 or params.top_p != 1.0 or params.min_p != 0.0 or getattr(params, "seed", None) is not None:
        return None
    return float(params.temperature), False


def _pad(rows: Sequence[Sequence[int]], device: torch.device | str, pinned: bool) -> torch.Tensor:
    """(B, L) int64, padded with -1."""
    padded = np.full((len(rows), max((len(r) for r in rows), default=0)), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return to_device(padded, None, device, pinned)


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling knobs for one step; a field is None when no row uses that feature."""

    temperature: torch.Tensor  # (B,) fp32; 1.0 on greedy rows
    greedy: torch.Tensor  # (B,) bool: temperature ~ 0 or top_k == 1
    all_greedy: bool
    top_k: torch.Tensor | None  # (B,) int64; <= 0 means off
    top_p: torch.Tensor | None  # (B,) fp32; 1.0 means off
    min_p: torch.Tensor | None  # (B,) fp32; 0.0 means off
    repetition_penalty: torch.Tensor | None  # (B,) fp32
    presence_penalty: torch.Tensor | None  # (B,) fp32
    frequency_penalty: torch.Tensor | None  # (B,) fp32
    prompt_tokens: torch.Tensor | None  # (B, Lp) int64 padded with -1 (repetition penalty only)
    output_tokens: torch.Tensor | None  # (B, Lo) int64 padded with -1 (any penalty)
    generators: list[torch.Generator | None]  # per row; None on greedy rows (they draw no noise)
    num_logprobs: list[int | None]  # per row: top-n logprobs asked for (None = none)
    max_num_logprobs: int | None  # max over rows; None when no row asked
    plain: bool = False  # every row greedy or temperature alone (plain_row): the one-pass kernel can sample them

    @classmethod
    def build(
        cls,
        params_list: Sequence[Any],
        prompt_token_ids_list: Sequence[Sequence[int]] | None,
        output_token_ids_list: Sequence[Sequence[int]] | None,
        generators: Sequence[torch.Generator | None] | None,
        device: torch.device | str,
        pinned: bool = False,
    ) -> SamplingBatch:
        num_rows = len(params_list)
        greedy_rows = [is_greedy(p) for p in params_list]
        random_params = [p for p, g in zip(params_list, greedy_rows) if not g]

        def column(name: str, off: float, rows: Sequence[Any] = random_params) -> torch.Tensor | None:
            """(B,) fp32 of one knob, or None when every row in `rows` leaves it off."""
            if all(getattr(p, name) == off for p in rows):
                return None
            return to_device([float(getattr(p, name)) for p in params_list], torch.float32, device, pinned)

        rep = column("repetition_penalty", 1.0, params_list)
        pres = column("presence_penalty", 0.0, params_list)
        freq = column("frequency_penalty", 0.0, params_list)
        prompt_tokens = output_tokens = None
        if rep is not None or pres is not None or freq is not None:
            if output_token_ids_list is None or (rep is not None and prompt_token_ids_list is None):
                raise ValueError("penalties need the prompt and output token ids of every row")
            output_tokens = _pad(output_token_ids_list, device, pinned)
            if rep is not None:
                prompt_tokens = _pad(prompt_token_ids_list, device, pinned)  # type: ignore[arg-type]
        top_k = None
        if any(p.top_k > 0 for p in random_params):
            top_k = to_device([p.top_k for p in params_list], torch.int64, device, pinned)
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params_list, greedy_rows)]
        num_logprobs = [p.logprobs for p in params_list]
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            temperature=to_device(temps, torch.float32, device, pinned),
            greedy=to_device(greedy_rows, torch.bool, device, pinned),
            all_greedy=all(greedy_rows),
            top_k=top_k,
            top_p=column("top_p", 1.0),
            min_p=column("min_p", 0.0),
            repetition_penalty=rep,
            presence_penalty=pres,
            frequency_penalty=freq,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            generators=[None if g else gen for g, gen in zip(greedy_rows, generators or [None] * num_rows)],
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
            plain=all(plain_row(p) is not None for p in params_list),
        )

    def row(self, i: int) -> SamplingBatch:
        """Row i alone, as a batch of one."""
        cut = {
            f.name: getattr(self, f.name)[i : i + 1]
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), (torch.Tensor, list))
        }
        n = self.num_logprobs[i]
        return dataclasses.replace(self, **cut, all_greedy=bool(self.greedy[i]), max_num_logprobs=n, plain=False)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64
    # Logprobs of the raw model logits (vLLM's default), only when some row asked:
    logprobs: torch.Tensor | None = None  # (B,) fp32: the sampled token's logprob
    top_token_ids: torch.Tensor | None = None  # (B, max_n) int64; row b uses its first n_b
    top_logprobs: torch.Tensor | None = None  # (B, max_n) fp32, descending


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, L) ids padded with -1 -> (B, V) occurrence counts (the padding goes to a dropped bin)."""
    index = torch.where(tokens < 0, vocab_size, tokens)
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (HF/vLLM: over prompt + output, logit > 0 -> /p else *p), then frequency and
    presence (OpenAI: over output tokens only). logits (B, V) fp32 -> new tensor."""
    vocab_size = logits.shape[1]
    assert batch.output_tokens is not None, "a batch with a penalty carries the output history"
    output_counts = _token_counts(batch.output_tokens, vocab_size)
    if batch.repetition_penalty is not None:
        assert batch.prompt_tokens is not None, "a repetition penalty carries the prompts too"
        seen = (_token_counts(batch.prompt_tokens, vocab_size) > 0) | (output_counts > 0)  # (B, V)
        penalty = torch.where(seen, batch.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * output_counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (output_counts > 0).float()
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose prob is below min_p * the row's max prob."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep the k largest logits (ties at the k-th kept), then the smallest nucleus whose
    probability reaches p. k <= 0 or p == 1 mean off for that row."""
    vocab_size = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # (B, V) ascending
    if k is not None:
        k = torch.where(k <= 0, vocab_size, k.clamp(max=vocab_size))
        kth = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))  # (B, 1): the k-th largest
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # ascending cumulative mass
        drop = cum <= 1 - p[:, None]
        drop[:, -1] = False  # the top token always stays
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(1, logits_idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Exponential race: argmax(probs / E) with E ~ Exp(1) samples from probs (B, V). Rows with
    a generator draw their noise from it; the others share one batched draw."""
    q = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < probs.shape[0]:
        q.exponential_()
    for i in seeded:
        q[i].exponential_(generator=generators[i])
    return probs.div_(q.clamp_(min=1e-20)).argmax(dim=-1)


class Sampler:
    """sampler(logits (B, V), batch) -> SamplerOutput.

    fused: a one-pass kernel for plain temperature sampling (pico_kernels.triton_sample), used for
    batches whose sampled rows need nothing else: no top-k/top-p/min-p, penalties, logprobs
    or seeded generators. Its noise comes from Philox keyed by a per-step seed drawn from
    torch's global generator at construction, so unseeded sampling differs from the torch
    path's draws but not in distribution. If the kernel fails (a compiler problem on some
    device), the sampler logs it once and keeps to the torch path."""

    def __init__(self, fused: Callable[..., torch.Tensor] | None = None) -> None:
        self.fused = fused
        self._seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if fused is not None else 0
        self._calls = 0

    def next_seed(self) -> int:
        """The one-pass kernel's Philox key for its next step (the decode graphs' sampling
        takes it from here too, so both paths draw the same sequence of keys)."""
        self._calls += 1
        return (self._seed + self._calls * 0x9E3779B1) & 0x7FFFFFFF

    @staticmethod
    def _fused_ok(batch: SamplingBatch) -> bool:
        """The one-pass kernel can sample this batch (when there is one)."""
        return batch.plain and not batch.all_greedy and all(g is None for g in batch.generators)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, seqs: Sequence[Any] | None = None) -> SamplerOutput:
        """Sample every row. seqs: the rows' sequences (with a seq_id); when the batch fails,
        SequenceFailed names the first one that fails alone (the batch's own error when none
        does, or without seqs)."""
        try:
            return self._sample_batch(logits, batch)
        except Exception as exc:
            for i, seq in enumerate(seqs or ()):
                try:
                    self._sample_batch(logits[i : i + 1], batch.row(i))
                except Exception as row_exc:  # noqa: BLE001 - named in SequenceFailed
                    raise SequenceFailed(seq.seq_id, f"sampling failed: {row_exc!r}") from row_exc
            raise exc

    def _sample_batch(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if self.fused is not None and self._fused_ok(batch):
            seed = self.next_seed()
            try:
                return SamplerOutput(token_ids=self.fused(logits, batch.temperature, batch.greedy, seed))
            except Exception:  # noqa: BLE001 - a kernel that cannot run here: fall back for good
                logger.warning("fused sampling kernel failed; using the torch sampler from now on", exc_info=True)
                self.fused = None
        raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32) if batch.max_num_logprobs is not None else None
        logits = logits.float()
        if batch.output_tokens is not None:
            logits = apply_penalties(logits, batch)
        token_ids = logits.argmax(dim=-1)
        if not batch.all_greedy:
            token_ids = torch.where(batch.greedy, token_ids, self._sample(logits, batch))
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            self._add_logprobs(out, raw_logprobs, batch.max_num_logprobs or 0)
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # (B,)
        logits = logits / batch.temperature[:, None]
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        return random_sample(logits.softmax(dim=-1), batch.generators)

    @staticmethod
    def _add_logprobs(out: SamplerOutput, logprobs: torch.Tensor, max_n: int) -> None:
        sampled = logprobs.gather(1, out.token_ids.unsqueeze(1))  # (B, 1)
        out.logprobs = sampled.squeeze(1)
        out.top_logprobs, out.top_token_ids = logprobs.topk(min(max_n, logprobs.shape[-1]), dim=-1)
