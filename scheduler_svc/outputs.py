"""What the engine hands back: one RequestOutput per request per step it changed in.

A request of n > 1 completions carries them all in `completions` (vLLM's `outputs`), each
with its own text, ids, deltas and finish reason; the RequestOutput's own text, token ids,
deltas and finish reason are the first completion's, and `finished` means every one is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_token_ids: list[int] = field(default_factory=list)  # new since the last output
    delta_text: str = ""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated id so far
    text: str  # the generated text so far (stop string excluded)
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    finished: bool
    delta_token_ids: list[int] = field(default_factory=list)  # new since the last output
    delta_text: str = ""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None  # per generated token: id -> logprob
    error: Exception | None = None  # the failure that ended this request alone (finish_reason "abort")
    completions: list[CompletionOutput] | None = None  # n > 1: every completion, in index order

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM-style view: the completions (one for a request of n = 1)."""
        if self.completions is not None:
            return self.completions
        return [
            CompletionOutput(
                0,
                self.text,
                self.token_ids,
                self.finish_reason,
                self.stop_reason,
                self.logprobs,
                self.delta_token_ids,
                self.delta_text,
            )
        ]
