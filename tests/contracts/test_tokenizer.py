"""contracts.tokenizer against transformers' fast tokenizer on the same files: the bundled
stories260k (SentencePiece BPE, BOS added) and the real Qwen2 tokenizer (byte-level BPE, 151,936
ids, special tokens in the text, a chat template), plus config entries (add_bos_token /
add_eos_token, which transformers 5 leaves to tokenizer.json; a special token missing from the
vocabulary, which it adds) and the errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from contracts.service_config import BUNDLED_MODEL
from contracts.tokenizer import load_tokenizer
from tests.services.conftest import REPO

QWEN2 = REPO / "tests" / "fixtures" / "qwen2_tokenizer"
TEXTS = [
    "Once upon a time",
    "  two  spaces  ",
    "Hello <s> world </s>",
    "こんにちは, world! 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "don't . stop , ok",
    "<|endoftext|>tail",
    "tabs\tand\nnew lines\n\n",
]


def _hf(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@pytest.mark.parametrize("directory", [BUNDLED_MODEL, QWEN2], ids=["stories260k", "qwen2"])
def test_same_ids_and_text_as_transformers(directory):
    ours, hf = load_tokenizer(directory), _hf(directory)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (
                    text,
                    skip,
                )
    ids = list(range(0, 600)) + [hf.vocab_size - 1]
    assert [ours.convert_ids_to_tokens(i) for i in ids] == [hf.convert_ids_to_tokens(i) for i in ids]
    assert ours.special_tokens == hf.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    assert ours.chat_template == hf.chat_template


def test_bundled_prompt_ids():
    assert load_tokenizer(BUNDLED_MODEL).encode("Once upon a time") == [1, 403, 407, 261, 378]


@pytest.mark.parametrize(
    "flags", [{"add_bos_token": False}, {"add_eos_token": True}, {"add_bos_token": True, "add_eos_token": True}]
)
def test_bos_eos_flags_as_transformers(tmp_path, flags):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(f"{BUNDLED_MODEL}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
    ours, hf = load_tokenizer(tmp_path), _hf(tmp_path)
    for text in TEXTS[:4]:
        assert ours.encode(text) == hf.encode(text), (flags, text)


def test_special_token_missing_from_the_vocabulary_is_added(tmp_path):
    shutil.copy(QWEN2 / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((QWEN2 / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<|my_pad|>"}))
    ours, hf = load_tokenizer(tmp_path), _hf(tmp_path)
    text = "a<|my_pad|>b"
    assert ours.encode(text) == hf.encode(text) and len(ours.encode(text)) == 3
    assert (
        ours.decode(ours.encode(text), skip_special_tokens=True)
        == hf.decode(hf.encode(text), skip_special_tokens=True)
        == "ab"
    )


def test_missing_directory_or_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_tokenizer(tmp_path / "nowhere")
    shutil.copy(f"{BUNDLED_MODEL}/tokenizer.model", tmp_path / "tokenizer.model")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json .*save_pretrained"):
        load_tokenizer(tmp_path)


def test_loading_and_using_it_imports_no_torch():
    code = (
        "import sys\nfrom contracts.tokenizer import load_tokenizer\n"
        f"t = load_tokenizer({str(QWEN2)!r})\nt.decode(t.encode('<|im_start|>hi'))\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_clean_up_spaces_on_a_wordpiece_model_as_transformers(tmp_path):
    """clean_up_tokenization_spaces: applied to a WordPiece model, as transformers does (and
    skipped for BPE, every family the project loads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["[UNK]", "hello", ",", "world", ".", "don", "'", "t", "!"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"clean_up_tokenization_spaces": True, "unk_token": "[UNK]", "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    ours, hf = load_tokenizer(tmp_path), _hf(tmp_path)
    for text in ("hello, world.", "don't!", "hello world"):
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids), text
    assert ours.decode(ours.encode("hello, world.")) == "hello, world."
