"""Prompt token ids: checked against the vocabulary in C loops, packed once for the prefix
cache's hashes."""

from __future__ import annotations

import operator
from array import array

import numpy as np


def is_token(t, vocab: int) -> bool:
    try:
        return 0 <= operator.index(t) < vocab
    except TypeError:
        return False


def checked_ids(prompt: list | tuple, vocab: int) -> tuple[list[int], bytes] | None:
    """The prompt's token ids as a list of Python ints and as int64 bytes, when every one is an
    integer in [0, vocab); else None. The check is C loops: the int64
    array conversion (which refuses anything without __index__: floats, strings, None) and
    numpy's min and max; the list comes back from the array, so integer types such as numpy's
    become plain ints. The bytes are what the prefix-cache lookup hashes (64 prompts of 1,056
    tokens that arrive together: about 1 ms of their first step if made again there)."""
    try:
        packed = array("q", prompt)
    except (TypeError, OverflowError):
        return None
    values = np.frombuffer(packed, dtype=np.int64)
    if values.min() < 0 or values.max() >= vocab:
        return None
    return packed.tolist(), packed.tobytes()
