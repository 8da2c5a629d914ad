"""Our model code against transformers' modeling classes (fp32, CPU), through the torch
reference kernels and a real paged cache with shuffled blocks."""

from __future__ import annotations

import json

import pytest
import torch

from model_svc.loader import BUNDLED_MODEL_DIR, load_model
from pico_kernels.ops import REFERENCE_OPS
from tests.model.paged_sim import PagedSim
from tests.model.tiny_models import make_tiny_hf_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def _sim(config, block_size: int = 16) -> PagedSim:
    return PagedSim(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, block_size=block_size)


@torch.no_grad()
def _forward(model, sim: PagedSim, new_tokens: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
    """One step; returns each sequence's logits (n_new, V)."""
    ids, positions, attn = sim.step(new_tokens)
    logits = model.compute_logits(model(ids, positions, sim.kv_caches, attn))
    return list(logits.split([len(t) for _, t in new_tokens]))


@torch.no_grad()
def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:  # (L, V)
    return hf_model(torch.tensor([tokens])).logits[0].float()


# ---- the bundled stories260k (real weights) ----


@pytest.fixture(scope="module")
def stories():
    model, config = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32, REFERENCE_OPS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(BUNDLED_MODEL_DIR), dtype=torch.float32).eval()
    reference = json.loads((BUNDLED_MODEL_DIR / "reference_greedy.json").read_text())["results"]
    return model, config, hf, reference


def test_stories_prefill_matches_hf(stories):
    model, config, hf, reference = stories
    seqs = [r["full_token_ids"] for r in reference]  # 45-53 tokens: 3-4 blocks of 16 each
    ours = _forward(model, _sim(config), list(enumerate(seqs)))
    for tokens, logits in zip(seqs, ours):
        torch.testing.assert_close(logits, _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_stories_first_step_top5(stories):
    model, config, _, reference = stories
    prompts = [r["prompt_token_ids"] for r in reference]
    ours = _forward(model, _sim(config), list(enumerate(prompts)))
    for r, logits in zip(reference, ours):
        top = logits[-1].topk(5)
        assert top.indices.tolist() == r["first_step_top5"]["token_ids"]
        torch.testing.assert_close(top.values, torch.tensor(r["first_step_top5"]["logits"]), atol=1e-3, rtol=0)


def test_stories_decode_steps_match_hf(stories):
    model, config, hf, reference = stories
    sim = _sim(config, block_size=4)  # decode crosses block boundaries often
    prompts = [r["prompt_token_ids"] for r in reference]
    ours = _forward(model, sim, list(enumerate(prompts)))
    steps = 10
    hf_full = [_hf_logits(hf, r["prompt_token_ids"] + r["new_token_ids"][:steps]) for r in reference]
    for step in range(steps):
        for i, r in enumerate(reference):
            pos = len(r["prompt_token_ids"]) + step - 1
            torch.testing.assert_close(ours[i][-1], hf_full[i][pos], atol=ATOL, rtol=0)
            assert ours[i][-1].argmax().item() == r["new_token_ids"][step]  # greedy as the oracle
        ours = _forward(model, sim, [(i, [r["new_token_ids"][step]]) for i, r in enumerate(reference)])


# ---- tiny random models of every family ----

LLAMA3_ROPE = dict(
    rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
    )
)
VARIANTS = {
    "llama": ("llama", {}),
    "llama-llama3-rope": ("llama", LLAMA3_ROPE),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"num_hidden_layers": 3}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    model, config = load_model(path, "cpu", torch.float32, REFERENCE_OPS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (37, 21, 300)]
    return model, config, hf, seqs


def test_tiny_flags(tiny):
    _, config, hf, _ = tiny
    assert config.family == hf.config.model_type
    assert config.attention_bias == (config.family == "qwen2")
    assert config.qk_norm == (config.family == "qwen3")
    assert config.num_key_value_heads < config.num_attention_heads and config.head_dim == 64


def test_tiny_prefill_matches_hf(tiny):
    model, config, hf, seqs = tiny
    ours = _forward(model, _sim(config), list(enumerate(seqs)))
    for tokens, logits in zip(seqs, ours):
        torch.testing.assert_close(logits, _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_tiny_chunked_prefill_and_decode_match_hf(tiny):
    model, config, hf, seqs = tiny
    a, b = seqs[0], seqs[1]
    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    sim = _sim(config)
    (first,) = _forward(model, sim, [(0, a[:20])])
    torch.testing.assert_close(first, ref_a[:20], atol=ATOL, rtol=0)
    # Second chunk of a attends to its cached first chunk; b's whole prompt rides along.
    second, whole_b = _forward(model, sim, [(0, a[20:35]), (1, b[:-3])])
    torch.testing.assert_close(second, ref_a[20:35], atol=ATOL, rtol=0)
    torch.testing.assert_close(whole_b, ref_b[:-3], atol=ATOL, rtol=0)
    for step in range(2):  # decode path: one new token each
        out_a, out_b = _forward(model, sim, [(0, [a[35 + step]]), (1, [b[-3 + step]])])
        torch.testing.assert_close(out_a[0], ref_a[35 + step], atol=ATOL, rtol=0)
        torch.testing.assert_close(out_b[0], ref_b[len(b) - 3 + step], atol=ATOL, rtol=0)


@torch.no_grad()
def test_tiny_profiling_forward_without_cache(tiny):
    """No cache tensors (the profiling run): plain causal attention per sequence."""
    model, config, hf, seqs = tiny
    ids, positions, attn = _sim(config).step(list(enumerate(seqs[:2])))
    empty = torch.empty(0)
    for kv_caches in (None, [(empty, empty)] * config.num_hidden_layers):
        logits = model.compute_logits(model(ids, positions, kv_caches, attn))
        for tokens, part in zip(seqs, logits.split([len(s) for s in seqs[:2]])):
            torch.testing.assert_close(part, _hf_logits(hf, tokens), atol=ATOL, rtol=0)
