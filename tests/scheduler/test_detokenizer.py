"""The batched incremental detokenizer gives, step by step, the deltas of the plain algorithm
(two decodes per request per step), through decode_batch and through one decode per window,
on the real Qwen2 tokenizer with multi-byte characters, special tokens, ids past the
vocabulary and both skip_special_tokens values in one batch; a request whose ids cannot be
decoded fails alone; a stop string is cut where it ends earliest."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from contracts.tokenizer import load_tokenizer
from scheduler_svc import detokenizer
from scheduler_svc.detokenizer import Detokenizers, DetokenizerState

QWEN2 = Path(__file__).resolve().parent.parent / "fixtures" / "qwen2_tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(QWEN2)


def plain_delta(tokenizer, skip: bool, state: DetokenizerState, ids: list[int]) -> str:
    """The reference: vLLM's incremental detokenization, one request at a time."""
    prefix_text = tokenizer.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip)
    new_text = tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip)
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""
    delta = new_text[len(prefix_text) :]
    state.prefix_offset, state.read_offset = state.read_offset, len(ids)
    state.text += delta
    return delta


@pytest.mark.parametrize("min_windows", [0, 10**9], ids=["decode_batch", "decode per window"])
def test_batched_deltas_equal_the_plain_algorithms(tokenizer, monkeypatch, min_windows):
    monkeypatch.setattr(detokenizer, "BATCH_MIN_WINDOWS", min_windows)
    rng = random.Random(0)
    text = "Hello wörld, 你好 🙂🙂 <|im_end|> naïve café — ok.\n\tend"
    pieces = tokenizer.encode(text) + [151643, 151644]  # multi-byte pieces and special tokens
    detok = Detokenizers(tokenizer)
    n = 12
    prompts = [[rng.randrange(3, 151643) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    skip = [i % 3 != 0 for i in range(n)]
    ids = [list(p) for p in prompts]
    ours = [detok.start(len(p)) for p in prompts]
    ref = [detok.start(len(p)) for p in prompts]
    for step in range(60):
        live = [i for i in range(n) if step < 20 + 3 * i]  # requests end at different steps
        for i in live:
            # Byte-level fragments of multi-byte characters, special tokens, random ids, ids past
            # the vocabulary (151,646 and up: decode drops them), runs of those in some requests.
            choice = rng.random() if i % 4 else rng.random() * 0.4 + 0.6
            if choice < 0.4:
                token = rng.choice(pieces)
            elif choice < 0.6:
                token = rng.randrange(128000, 151643)
            else:
                token = rng.randrange(151646, 151936) if choice < 0.9 else 9707
            ids[i].append(token)
        errors = detok.step([ours[i] for i in live], [ids[i] for i in live], [skip[i] for i in live])
        assert errors == [None] * len(live)
        for i in live:
            assert ours[i].delta == plain_delta(tokenizer, skip[i], ref[i], ids[i]), (step, i)
            assert ours[i].text == ref[i].text
    assert any("\ufffd" not in s.text and any(ord(c) > 0xFFFF for c in s.text) for s in ours)  # emoji came whole


class Fragile:
    """The Qwen2 tokenizer, except that id 7 cannot be decoded."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        if 7 in ids:
            raise ValueError("id 7 is broken")
        return self.tokenizer.decode(ids, skip_special_tokens)

    def decode_batch(self, windows, skip_special_tokens=False):
        return [self.decode(w, skip_special_tokens) for w in windows]


def test_a_request_whose_ids_do_not_decode_fails_alone(tokenizer):
    detok = Detokenizers(Fragile(tokenizer))
    ids = [[9707, 1879], [9707, 7], [1879, 9707]]
    states = [detok.start(2) for _ in ids]
    for i, token in enumerate((11, 1879, 11)):
        ids[i].append(token)
    errors = detok.step(states, ids, [True, True, True])
    assert errors[0] is None and errors[2] is None and isinstance(errors[1], ValueError)
    assert states[0].delta == tokenizer.decode([9707, 1879, 11])[len("Hello world") :] == ","
    assert states[2].delta == states[2].text == ","


def test_stop_string_is_cut_where_it_ends_earliest():
    state = DetokenizerState(0, 0, text="once upon a ti", delta="a ti")
    assert state.cut_at_stop(["time", "on a", "pon"]) == "on a"  # "pon" ends before the new text
    assert state.text == "once up"
    state = DetokenizerState(0, 0, text="abc", delta="c")
    assert state.cut_at_stop(["x", "bd"]) is None and state.text == "abc"
