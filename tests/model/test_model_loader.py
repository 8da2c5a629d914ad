"""Loader: errors, the name mapping, random models, and save/load round trips."""

from __future__ import annotations

import json

import pytest
import torch

from contracts.tokenizer import load_tokenizer
from model_svc.config import ModelConfig
from model_svc.loader import (
    BUNDLED_MODEL_DIR,
    build_random_model,
    iter_safetensors,
    load_model,
    load_weights,
    safetensors_files,
    save_model,
)
from model_svc.models import build_model
from pico_kernels.ops import REFERENCE_OPS
from tests.model.paged_sim import PagedSim
from tests.model.tiny_models import make_tiny_hf_model, tiny_hf_config

transformers = pytest.importorskip("transformers")


@torch.no_grad()
def _prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    c = model.config
    sim = PagedSim(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
    ids, positions, attn = sim.step([(0, tokens)])
    return model.compute_logits(model(ids, positions, sim.kv_caches, attn))


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model("does/not/exist", "cpu")


def test_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text((BUNDLED_MODEL_DIR / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path, "cpu")


def test_unknown_family_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(ValueError, match="'falcon'"):
        load_model(tmp_path, "cpu")


def test_incomplete_or_foreign_checkpoint():
    config = ModelConfig.from_pretrained(BUNDLED_MODEL_DIR)
    model = build_model(config, REFERENCE_OPS, torch.float32, "cpu")
    weights = list(iter_safetensors(safetensors_files(BUNDLED_MODEL_DIR)))
    with pytest.raises(ValueError, match="missing 1 tensors"):
        load_weights(model, [w for w in weights if w[0] != "model.layers.2.self_attn.k_proj.weight"])
    with pytest.raises(ValueError, match="unexpected checkpoint tensor 'model.layers.0.attn.c_attn.weight'"):
        load_weights(model, weights + [("model.layers.0.attn.c_attn.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="expected shape"):
        load_weights(model, [("model.norm.weight", torch.zeros(3))])


def test_merged_projections_hold_the_checkpoint_rows():
    model, _ = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32, REFERENCE_OPS)
    weights = dict(iter_safetensors(safetensors_files(BUNDLED_MODEL_DIR)))
    layer = model.model.layers[3]
    q, k, v = (weights[f"model.layers.3.self_attn.{n}_proj.weight"] for n in "qkv")
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, torch.cat([q, k, v]), rtol=0, atol=0)
    gate, up = (weights[f"model.layers.3.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, torch.cat([gate, up]), rtol=0, atol=0)
    assert model.lm_head is None  # tied: logits use the embedding matrix


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tiny_dir_tokenizer_is_the_bundled_one(tmp_path, family):
    tokenizer = load_tokenizer(make_tiny_hf_model(tmp_path, family))
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_build_random_model_is_seeded():
    config = ModelConfig.from_hf_config(tiny_hf_config("qwen3"))
    a = build_random_model(config, torch.float32, "cpu", seed=3)
    b = build_random_model(config, torch.float32, "cpu", seed=3)
    c = build_random_model(config, torch.float32, "cpu", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb) and not torch.equal(pa, pc), name
    norm = a.model.layers[0].self_attn.q_norm.weight
    assert 0.9 < norm.mean().item() < 1.1 and norm.std().item() > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_model_round_trip_and_hf_reads_it(tmp_path, family):
    overrides = {"tie_word_embeddings": True} if family == "llama" else {}
    config = ModelConfig.from_hf_config(tiny_hf_config(family, **overrides))
    model = build_random_model(config, torch.float32, "cpu", seed=1, std=0.1)
    save_model(model, tmp_path)
    loaded, loaded_config = load_model(tmp_path, "cpu", torch.float32, REFERENCE_OPS)
    assert loaded_config == config
    tokens = list(range(5, 45))
    expected = _prefill_logits(model, tokens)
    torch.testing.assert_close(_prefill_logits(loaded, tokens), expected, rtol=0, atol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([tokens])).logits[0], expected, rtol=0, atol=1e-4)


def test_bf16_model_runs_and_stays_close():
    model32, _ = load_model(BUNDLED_MODEL_DIR, "cpu", torch.float32, REFERENCE_OPS)
    model16, _ = load_model(BUNDLED_MODEL_DIR, "cpu", torch.bfloat16, REFERENCE_OPS)
    assert model16.model.embed_tokens.weight.dtype == torch.bfloat16
    tokens = [1, 403, 407, 261, 378]
    l32, l16 = _prefill_logits(model32, tokens), _prefill_logits(model16, tokens)
    assert l16.dtype == torch.float32  # logits from the fp32 accumulator, never rounded to bf16
    assert l16[-1].argmax() == l32[-1].argmax()
    assert (l16.float() - l32).abs().max().item() < 0.5


def test_cpu_threads_one_for_a_small_model_else_torch_default_or_requested():
    from model_svc.loader import SMALL_MODEL_PARAMS, cpu_threads

    small, _ = load_model(BUNDLED_MODEL_DIR)
    assert sum(p.numel() for p in small.parameters()) < SMALL_MODEL_PARAMS
    assert cpu_threads(small, None) == 1
    assert cpu_threads(small, 3) == 3
    big = torch.nn.Linear(SMALL_MODEL_PARAMS // 1000, 1000, bias=False, device="meta")
    assert cpu_threads(big, None) == torch.get_num_threads()


def test_runner_on_cpu_sets_the_thread_count():
    from model_svc.runner import ModelRunner

    before = torch.get_num_threads()
    try:
        ModelRunner(str(BUNDLED_MODEL_DIR), num_device_blocks=8, device="cpu", torch_threads=2)
        assert torch.get_num_threads() == 2
        ModelRunner(str(BUNDLED_MODEL_DIR), num_device_blocks=8, device="cpu")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
