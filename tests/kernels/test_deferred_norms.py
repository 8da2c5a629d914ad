"""The deferred norms (LlamaDecoderLayer.forward_deferred): a tiny bf16 Qwen3 on the Triton
ops (the interpreter on the CPU) folds its norm weights into q|k|v and gate|up at load, and a
decode step of tens of sequences then runs without norm launches. Its hidden states match the
same folded model's classic path (the norms as kernels) to bf16 roundings, and the folded
model computes the unfolded one's function."""

from __future__ import annotations

import pytest
import torch

import pico_kernels.triton_linear as triton_linear
from model_svc.config import ModelConfig
from model_svc.loader import build_random_model
from pico_kernels.ops import REFERENCE_OPS
from pico_kernels.triton_ops import TRITON_OPS
from tests.model.paged_sim import PagedSim

CONFIG = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=1,
    eos_token_id=2,
)
NUM_SEQS = 36  # a decode batch the deferred path takes (33-64 rows)


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.from_hf_config(CONFIG)


def test_fold_norm_weights(config, device):
    folded = build_random_model(config, torch.bfloat16, device, seed=3, ops=TRITON_OPS, std=0.1)
    plain = build_random_model(config, torch.bfloat16, device, seed=3, ops=REFERENCE_OPS, std=0.1)
    assert folded.model.norms_folded and not plain.model.norms_folded
    assert not build_random_model(config, torch.float32, device, ops=TRITON_OPS).model.norms_folded  # fp32: no deferral
    for ours, theirs in zip(folded.model.layers, plain.model.layers):
        for norm, proj, plain_norm, plain_proj in (
            (ours.input_layernorm, ours.self_attn.qkv_proj, theirs.input_layernorm, theirs.self_attn.qkv_proj),
            (
                ours.post_attention_layernorm,
                ours.mlp.gate_up_proj,
                theirs.post_attention_layernorm,
                theirs.mlp.gate_up_proj,
            ),
        ):
            assert torch.equal(norm.weight, torch.ones_like(norm.weight))
            assert not torch.equal(plain_norm.weight, torch.ones_like(plain_norm.weight))
            assert torch.equal(proj.weight, (plain_proj.weight.float() * plain_norm.weight.float()).to(torch.bfloat16))
    qkv = folded.model.layers[0].self_attn.qkv_proj.weight.clone()
    assert folded.fold_norm_weights() and torch.equal(
        folded.model.layers[0].self_attn.qkv_proj.weight, qkv
    )  # once only
    assert plain.fold_norm_weights(force=True)  # a reference model given the same weights
    for ours, theirs in zip(folded.parameters(), plain.parameters()):
        assert torch.equal(ours, theirs)
    assert not plain.model.defers_norms(
        torch.zeros((40, config.hidden_size), dtype=torch.bfloat16, device=device)
    )  # torch ops


@torch.no_grad()
def _decode_step(model, device, deferred: bool) -> torch.Tensor:
    """One decode step of NUM_SEQS sequences over 10 tokens each of (random) cache, one block
    a sequence (one decode split); its hidden states."""
    model.model.norms_folded = deferred
    sim = PagedSim(
        model.config.num_hidden_layers,
        model.config.num_key_value_heads,
        model.config.head_dim,
        num_blocks=NUM_SEQS + 4,
        block_size=16,
        dtype=torch.bfloat16,
        device=str(device),
        seed=1,
    )
    for i in range(NUM_SEQS):
        sim.block_tables[i] = [sim.free_blocks.pop()]
        sim.seq_lens[i] = 10
    tokens = torch.randint(3, model.config.vocab_size, (NUM_SEQS,), generator=torch.Generator().manual_seed(5)).tolist()
    ids, positions, attn = sim.step([(i, [t]) for i, t in enumerate(tokens)])
    return model(ids, positions, sim.kv_caches, attn)


def test_deferred_decode_matches_the_classic_path(config, device, monkeypatch):
    model = build_random_model(config, torch.bfloat16, device, seed=3, ops=TRITON_OPS, std=0.1)
    calls = []
    add_residual = triton_linear.splitk_add_residual
    monkeypatch.setattr(
        triton_linear, "splitk_add_residual", lambda *a, **k: calls.append(a[0].shape[0]) or add_residual(*a, **k)
    )
    classic = _decode_step(model, device, deferred=False)
    assert calls == []
    deferred = _decode_step(model, device, deferred=True)
    assert calls == [NUM_SEQS] * (2 * config.num_hidden_layers)  # o and down of each layer
    assert torch.isfinite(deferred.float()).all()
    # The same function; each deferred norm rounds its product once, where the classic path
    # rounds the normalised rows and then the product.
    err = (deferred.float() - classic.float()).abs()
    scale = classic.float().abs().amax()
    assert err.amax() <= 0.05 * scale and err.mean() <= 0.005 * scale, (err.amax(), err.mean(), scale)
