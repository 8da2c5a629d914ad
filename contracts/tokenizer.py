"""The tokenizer of a model directory, without torch.

transformers imports torch whenever torch is installed, and the scheduler needs only
encode and decode: loading a tokenizer through transformers cost the torch-free scheduler
process a few hundred MB (docs/ARCHITECTURE.md has the figures). This loads the directory's
tokenizer.json with Hugging Face's `tokenizers` library (the engine behind transformers' fast
tokenizers) and adds what transformers' fast tokenizer takes from tokenizer_config.json: the
named special tokens, `clean_up_tokenization_spaces` and the chat template. As in transformers
5, tokenizer.json's post-processor alone decides which special tokens encode() adds (the
config's add_bos_token / add_eos_token do not). The ids and texts equal transformers' for the
same files (tests/contracts/test_tokenizer.py compares them).

Every model family the project loads ships a tokenizer.json; a directory with only a slow
tokenizer (tokenizer.model, vocab.json + merges.txt) is refused with the one call that
writes one.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

# The named special tokens, as transformers names them (its special_tokens_map).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' clean_up_tokenization: the spaces a WordPiece decoder leaves before punctuation.
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class Tokenizer:
    """encode / decode as transformers' fast tokenizer does for the same directory."""

    def __init__(self, backend: Backend, config: dict[str, Any], chat_template: str | None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))}
        # As transformers' fast tokenizer: every named special token is a special added token
        # (skipped by decode(skip_special_tokens=True)), added to the vocabulary if missing.
        backend.add_special_tokens(
            [AddedToken(text, special=True, normalized=False) for text in self.special_tokens.values()]
        )
        self.bos_token_id = self._id("bos_token")
        self.eos_token_id = self._id("eos_token")
        # transformers skips the clean-up for BPE models, where it would eat real spaces.
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and type(backend.model).__name__ != "BPE"

    def _id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self._cleaned(text) if self._clean_up else text

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        """decode() of each sequence, in one call: the backend decodes them in Rust, in
        parallel, without holding the interpreter lock."""
        texts = self.backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
        return [self._cleaned(t) for t in texts] if self._clean_up else texts

    @staticmethod
    def _cleaned(text: str) -> str:
        for before, after in _CLEANUPS:
            text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (where transformers 4.43+ saves it), else the config's template (a
    list of named ones: the one named "default")."""
    file = directory / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model directory `path` (local files only)."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory not found: {str(path)!r}")
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {str(path)!r}: write one with transformers, once: "
            f"AutoTokenizer.from_pretrained({str(path)!r}).save_pretrained({str(path)!r})"
        )
    # special_tokens_map.json is the older place for the named tokens; tokenizer_config.json wins.
    config = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
    return Tokenizer(Backend.from_file(str(file)), config, _chat_template(directory, config))


def load_tokenizer_soon(path: str | Path) -> Future[Tokenizer]:
    """load_tokenizer on a thread of its own: the parse of tokenizer.json (Rust) releases the
    GIL, so it runs beside the caller's own start-up work (loading the model's weights)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    try:
        return pool.submit(load_tokenizer, path)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the load
