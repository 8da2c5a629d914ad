"""Incremental detokenization: text deltas that never split a multi-byte character and keep
the spacing the prompt context implies (the same approach as vLLM's).

`IncrementalDetokenizer.step_batch` detokenizes the new tokens of every request of one
engine step together: a large step's windows in one call of the tokenizer's `decode_batch`
where it has one (Hugging Face's `tokenizers` runs it in Rust, on its thread pool, without
the interpreter lock), one decode per request rather than two, none for a request whose new
ids cannot change its text (docs/ARCHITECTURE.md, "Detokenization"). A batch that raises is
decoded again window by window, so that a request whose ids cannot be decoded fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

# Context tokens decoded before the new ones, so a leading-space marker renders correctly.
_CONTEXT = 6
# Fewer windows than this in a step are decoded one call each: waking the tokenizer's thread
# pool costs more than it saves on a small batch (batch-1 decoding above all; bench/NOTES.md).
BATCH_MIN_WINDOWS = 64


@dataclass(slots=True)
class DetokenizerState:
    prefix_offset: int
    read_offset: int
    text: str = ""
    delta: str = ""  # the text the last step added
    prefix_text: str | None = None  # the text of ids[prefix_offset:read_offset], once decoded
    num_seen: int = 0  # the ids the last step covered

    def cut_at_stop(self, stop: list[str]) -> str | None:
        """The stop string that ends earliest in the text, found where it could end in the
        last delta, with the text cut before it; None if none occurs."""
        text = self.text
        # Each string is searched only where it could end in the new text: a long one
        # does not make every short one scan its window too.
        end = len(text) - len(self.delta) + 1
        hits = [(i, s) for s in stop if (i := text.find(s, max(0, end - len(s)))) >= 0]
        if not hits:
            return None
        idx, s = min(hits)
        self.text = text[:idx]
        return s


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # The text of single tokens, as decoded (a request that advances every step has its
        # last token alone as the next step's prefix window); at most one entry per id.
        self._single: dict[int, str] = {}
        # convert_ids_to_tokens(id) is None for an id that decode() drops (Hugging Face's
        # decode keeps only the ids it finds a token for); a tokenizer without it: every
        # request decodes every step.
        self._knows_vocabulary = hasattr(tokenizer, "convert_ids_to_tokens")
        self._absent: dict[int, bool] = {}

    def start(self, num_prompt_tokens: int) -> DetokenizerState:
        return DetokenizerState(max(0, num_prompt_tokens - _CONTEXT), num_prompt_tokens, num_seen=num_prompt_tokens)

    def step_batch(self, states: list[DetokenizerState], token_ids: list[list[int]]) -> list[Exception | None]:
        """Advance each request's state (states[i] over its ids token_ids[i]) by the tokens
        appended since its last step, setting its `delta`; for each, the exception its decode
        raised, or None (the others' deltas stand). One decode per request (its window from
        prefix_offset on), and its prefix window's too where neither the state nor the
        single-token table holds that text yet; none for a request whose new tokens are all
        outside the vocabulary (decode drops such ids wherever they stand, so its texts are
        those of its last step, which did not advance past them)."""
        errors: list[Exception | None] = [None] * len(states)
        live, windows = [], []
        for i, (state, ids) in enumerate(zip(states, token_ids)):
            seen, state.num_seen, state.delta = state.num_seen, len(ids), ""
            if self._knows_vocabulary and all(map(self._no_text, ids[seen:])):
                continue
            live.append(i)
            p, r = state.prefix_offset, state.read_offset
            if state.prefix_text is None and r - p == 1:
                state.prefix_text = self._single.get(ids[p])
            if state.prefix_text is None:
                windows.append(ids[p:r])
            windows.append(ids[p:])
        try:
            texts: list[str | Exception] = list(self._decode_batch(windows))
        except Exception:  # noqa: BLE001 - find whose ids broke it: they fail, not the batch
            texts = [self._decode_or_error(w) for w in windows]
        decoded = iter(texts)
        for i in live:
            state, ids = states[i], token_ids[i]
            if state.prefix_text is None:
                prefix = next(decoded)
                if isinstance(prefix, Exception):
                    next(decoded)
                    errors[i] = prefix
                    continue
                state.prefix_text = prefix
                if state.read_offset - state.prefix_offset == 1:
                    self._single[ids[state.prefix_offset]] = prefix
            errors[i] = self._advance(state, ids, next(decoded))
        return errors

    def _no_text(self, token_id: int) -> bool:
        """An id outside the tokenizer's vocabulary (decode drops it), from a table."""
        absent = self._absent.get(token_id)
        if absent is None:
            absent = self._absent[token_id] = self.tokenizer.convert_ids_to_tokens(token_id) is None
        return absent

    def _decode_batch(self, windows: list[list[int]]) -> list[str]:
        batch = getattr(self.tokenizer, "decode_batch", None)
        if batch is None or len(windows) < BATCH_MIN_WINDOWS:  # one call per window
            return [self.tokenizer.decode(w, skip_special_tokens=self.skip_special_tokens) for w in windows]
        return batch(windows, skip_special_tokens=self.skip_special_tokens)

    def _decode_or_error(self, window: list[int]) -> str | Exception:
        try:
            return self.tokenizer.decode(window, skip_special_tokens=self.skip_special_tokens)
        except Exception as exc:  # noqa: BLE001 - handed back as this request's failure
            return exc

    @staticmethod
    def _advance(state: DetokenizerState, token_ids: list[int], new_text: str | Exception) -> Exception | None:
        state.delta = ""
        if isinstance(new_text, Exception):
            return new_text
        prefix_text = cast(str, state.prefix_text)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character (or nothing printable yet): wait for more
        state.delta = new_text[len(prefix_text) :]
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        state.prefix_text = None  # a new prefix window
        state.text += state.delta
        return None


class Detokenizers:
    """The engine's detokenizers, one per value of skip_special_tokens, and its step over a
    batch of requests (None: no tokenizer, no text: every delta stays empty)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._by_skip = {skip: IncrementalDetokenizer(tokenizer, skip) for skip in (False, True)}

    def start(self, num_prompt_tokens: int) -> DetokenizerState:
        return self._by_skip[True].start(num_prompt_tokens)

    def step(
        self, states: list[DetokenizerState], token_ids: list[list[int]], skip: list[bool]
    ) -> list[Exception | None]:
        """IncrementalDetokenizer.step_batch over requests of either skip_special_tokens (a
        batch for each value that occurs)."""
        if self.tokenizer is None or not states:
            return [None] * len(states)
        if all(skip) or not any(skip):
            return self._by_skip[skip[0]].step_batch(states, token_ids)
        errors: list[Exception | None] = [None] * len(states)
        for value, detok in self._by_skip.items():
            idx = [i for i, s in enumerate(skip) if s == value]
            for i, error in zip(idx, detok.step_batch([states[i] for i in idx], [token_ids[i] for i in idx])):
                errors[i] = error
        return errors
