"""SamplingParams: the per-request knobs, named and validated as in vLLM; RequestLimits: the
server's caps on what one request may ask for, checked at admission, before any work.

The caps keep one request from costing the others: every stop string is searched after
every token of its request, the stop token ids are scanned per token, and the top-n
logprobs are computed for the whole batch at the largest n asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Sized
from dataclasses import dataclass, field, replace

_INT32_MAX = (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Caps on one request (vLLM's `max_logprobs` is 20 as well). Values are checked at
    admission against the model too: logprobs never above the vocabulary, stop token ids
    inside it. max_prompt_chars: None derives it from max_model_len (see prompt_chars)."""

    max_logprobs: int = 20
    max_n: int = 128  # completions of one request (each is a sequence of the running batch)
    max_stop_strings: int = 64
    max_stop_chars: int = 4096  # all stop strings of a request together
    max_stop_token_ids: int = 1024
    max_prompt_chars: int | None = None
    # The derived prompt cap: characters a token may stand for at most, for the purpose of
    # refusing text before it is tokenized (real tokenizers average 3-5 characters a token).
    chars_per_token: int = 16

    def __post_init__(self) -> None:
        for name in (
            "max_logprobs",
            "max_n",
            "max_stop_strings",
            "max_stop_chars",
            "max_stop_token_ids",
            "chars_per_token",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.max_prompt_chars is not None and (
            not isinstance(self.max_prompt_chars, int) or self.max_prompt_chars < 1
        ):
            raise ValueError(f"max_prompt_chars must be a positive integer or None, got {self.max_prompt_chars!r}")

    def prompt_chars(self, max_model_len: int) -> int:
        """The longest prompt text accepted, in characters."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max(1, max_model_len) * self.chars_per_token

    def check_prompt(self, prompt: str | Sequence[int], max_model_len: int) -> None:
        """A prompt's length before it is tokenized: characters of text, or token ids (given
        ids must leave room for one generated token). ValueError naming the prompt."""
        if isinstance(prompt, str):
            limit = self.prompt_chars(max_model_len)
            if not prompt:
                raise ValueError("prompt must not be empty")
            if len(prompt) > limit:
                raise ValueError(
                    f"prompt has {len(prompt)} characters; the limit is {limit} (max_model_len {max_model_len})"
                )
        elif isinstance(prompt, Sized) and len(prompt) >= max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens; the limit is {max_model_len - 1} (max_model_len {max_model_len})"
            )


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 means greedy. Invalid values raise ValueError naming the field.

    n > 1 asks for n completions of the prompt (parallel sampling): they share the prompt's
    KV-cache blocks, and completion i samples with `child(i)`'s parameters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    skip_special_tokens: bool = True
    n: int = 1  # completions of the prompt

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise bad("temperature", "must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= _INT32_MAX:
            raise bad("top_k", f"must be -1 (off) or a positive integer up to {_INT32_MAX}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", "must be a finite number > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be a non-negative integer or None")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        # Completion i is seeded with seed + i (child): every one must stay a 64-bit integer.
        if self.seed is not None and (
            not isinstance(self.seed, int) or not _INT64_MIN <= self.seed <= _INT64_MAX - (self.n - 1)
        ):
            raise bad("seed", f"must be a 64-bit signed integer (at most {_INT64_MAX} - (n - 1)) or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    def check_limits(self, limits: RequestLimits, vocab_size: int) -> None:
        """The server's caps and the model's vocabulary; ValueError naming the field."""

        def over(name: str, what: str, value: int, cap: int) -> None:
            if value > cap:
                raise ValueError(f"{name}: {what} {value} is over the limit of {cap}")

        over("n", "a count of", self.n, limits.max_n)
        if self.logprobs is not None:
            over("logprobs", "top-n of", self.logprobs, min(limits.max_logprobs, vocab_size))
        over("stop", "a count of", len(self.stop), limits.max_stop_strings)
        over("stop", "a total length of", sum(map(len, self.stop)), limits.max_stop_chars)
        over("stop_token_ids", "a count of", len(self.stop_token_ids), limits.max_stop_token_ids)
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be < the vocabulary size {vocab_size}, got {bad[:5]}")

    def child(self, index: int) -> SamplingParams:
        """The parameters completion `index` of n samples with: n = 1, and a seeded request's
        seed + index (vLLM's rule), so seeded runs give the same n completions every time and
        completion i equals an n = 1 request seeded with seed + i. Unseeded completions each
        draw from the shared generator, so they differ from one another."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Penalties read the token history, so the sampled tokens must be known per step."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
