"""Incremental detokenization: text deltas that never split a multi-byte character and keep
the spacing the prompt context implies (the same approach as vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass

# Context tokens decoded before the new ones, so a leading-space marker renders correctly.
_CONTEXT = 6


@dataclass(slots=True)
class DetokenizerState:
    prefix_offset: int
    read_offset: int
    text: str = ""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens

    def start(self, num_prompt_tokens: int) -> DetokenizerState:
        return DetokenizerState(max(0, num_prompt_tokens - _CONTEXT), num_prompt_tokens)

    def step(self, state: DetokenizerState, token_ids: list[int]) -> str:
        """Return the text delta for tokens appended since the last call."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(token_ids[state.prefix_offset : state.read_offset])
        new_text = decode(token_ids[state.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character (or nothing printable yet): wait for more
        delta = new_text[len(prefix_text) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        state.text += delta
        return delta
