"""What the engine hands back: one RequestOutput per request per step it changed in."""

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

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM-style view: one completion per request."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs)]
