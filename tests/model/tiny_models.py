"""Tiny random-weight Hugging Face models for parity tests against transformers.

make_tiny_hf_model(tmpdir, "qwen3") writes a directory that both transformers and our
loader read: config.json, model.safetensors and the bundled stories260k tokenizer (its
512-token vocab matches vocab_size=512). Weights come from transformers' own init under
torch.manual_seed(seed), with a larger initializer_range than usual (so attention is far from
uniform) and random norm weights and biases (so q/k norm and q/k/v bias are exercised).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from model_svc.loader import BUNDLED_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")

TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: two q heads per kv head
    head_dim=64,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(use_sliding_window=False),
}


def tiny_hf_config(family: str, **overrides: Any) -> Any:
    """The transformers config object of a tiny model of this family."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if family not in classes:
        raise ValueError(f"no tiny model for family {family!r}; known: {', '.join(classes)}")
    return classes[family](**{**TINY_DEFAULTS, **FAMILY_DEFAULTS[family], **overrides})


@torch.no_grad()
def tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A transformers *ForCausalLM (fp32, eval) with random weights, norms and biases."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.3 * torch.randn_like(param))
        elif name.endswith(".bias"):
            param.copy_(0.3 * torch.randn_like(param))
    return model.eval()


def make_tiny_hf_model(tmpdir: str | Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random model of `family` ("llama", "mistral", "qwen2", "qwen3") with the
    bundled tokenizer into tmpdir/tiny-<family>; returns that directory."""
    path = Path(tmpdir) / f"tiny-{family}"
    model = tiny_hf_model(family, seed=seed, **overrides)
    model.save_pretrained(str(path))
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL_DIR / name, path / name)
    return path
