"""The fused elementwise kernels (kernels.triton_fused) against their torch references, and a
tiny Qwen3 whose forward uses them against the same model on the torch ops.

Inputs are random (never zeros); q/k are strided head views of a fused qkv projection, as in
the model. Without CUDA the kernels run under the Triton interpreter (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels import REFERENCE_OPS, select_ops
from kernels.reference import qk_norm_rope_ref, rms_norm_ref, silu_and_mul_ref
from kernels.triton_fused import qk_norm_rope, rms_norm, silu_and_mul
from model_svc.config import RopeScaling
from model_svc.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert out.is_contiguous()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, dtype=torch.float32)).to(device, dtype)


# ---- references are the layers' torch code ----


def test_references_are_the_layers_math():
    torch.manual_seed(0)
    x, res = torch.randn(5, 48), torch.randn(5, 48)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.normal_(1.0, 0.3)
    for r in (None, res):
        for got, want in zip(rms_norm_ref(x, norm.weight, 1e-6, r), norm(x, r)):
            assert torch.equal(got, want)
    gate_up = torch.randn(5, 64)
    assert torch.equal(silu_and_mul_ref(gate_up), SiluAndMul()(gate_up))
    rotary = RotaryEmbedding(16, 64, 10000.0, RopeScaling())
    positions = torch.tensor([0, 3, 63, 7, 1])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos, sin = rotary.cos_sin(positions)
    got = qk_norm_rope_ref(q, k, positions, rotary.cos_sin_cache)
    assert torch.equal(got[0], apply_rotary(q, cos, sin)) and torch.equal(got[1], apply_rotary(k, cos, sin))


# ---- rms_norm ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("hidden", [64, 96, 1024])
def test_rms_norm(device, dtype, with_residual, hidden):
    torch.manual_seed(hidden)
    n = 7
    x = _randn(n, hidden, dtype=dtype, device=device, scale=3.0)
    residual = _randn(n, hidden, dtype=dtype, device=device) if with_residual else None
    weight = _randn(hidden, dtype=dtype, device=device, scale=0.3) + 1.0
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-6, residual)
    assert_matches(out, ref_out)
    if with_residual:
        assert torch.equal(new_residual, ref_residual)  # one rounded add, exactly the torch one
    else:
        assert new_residual is x


def test_rms_norm_strided_rows(device):
    torch.manual_seed(1)
    wide = _randn(6, 100, dtype=torch.float32, device=device)
    x = wide[:, :64]  # rows 100 apart
    weight = _randn(64, dtype=torch.float32, device=device) + 1.0
    residual = _randn(6, 64, dtype=torch.float32, device=device)
    for got, want in zip(rms_norm(x, weight, 1e-5, residual), rms_norm_ref(x, weight, 1e-5, residual)):
        assert_matches(got, want)


# ---- qk_norm_rope ----


def _qkv_views(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device):
    """q (N, Hq, D) and k (N, Hkv, D) as views into one (N, (Hq + 2 Hkv) D) projection."""
    qkv = _randn(n, (hq + 2 * hkv) * d, dtype=dtype, device=device, scale=2.0)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(n, hq, d), k.view(n, hkv, d)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize("head_dim,heads", [(8, (4, 4)), (64, (4, 2)), (128, (8, 1)), (80, (2, 1))])
def test_qk_norm_rope(device, dtype, qk_norm, head_dim, heads):
    torch.manual_seed(head_dim)
    hq, hkv = heads
    n, max_positions = 5, 256
    q, k = _qkv_views(n, hq, hkv, head_dim, dtype, device)
    assert not q.is_contiguous() and not k.is_contiguous()
    cache = RotaryEmbedding(head_dim, max_positions, 10000.0).cos_sin_cache.to(device, dtype)
    positions = torch.tensor([0, 1, 255, 17, 100], dtype=torch.int64, device=device)
    weights = ()
    if qk_norm:
        weights = tuple(_randn(head_dim, dtype=dtype, device=device, scale=0.3) + 1.0 for _ in range(2))
    q_before, k_before = q.clone(), k.clone()
    got = qk_norm_rope(q, k, positions, cache, *weights, eps=1e-6)
    want = qk_norm_rope_ref(q, k, positions, cache, *weights, eps=1e-6)
    assert_matches(got[0], want[0])
    assert_matches(got[1], want[1])
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched


# ---- silu_and_mul ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [24, 256, 1536])
def test_silu_and_mul(device, dtype, inter):
    torch.manual_seed(inter)
    x = _randn(3, 2 * inter, dtype=dtype, device=device, scale=3.0)
    assert_matches(silu_and_mul(x), silu_and_mul_ref(x))


def test_empty_batch(device):
    x = torch.empty(0, 32, device=device)
    weight = torch.ones(32, device=device)
    assert rms_norm(x, weight, 1e-6, x)[0].shape == (0, 32)
    assert silu_and_mul(x).shape == (0, 16)
    cache = RotaryEmbedding(8, 16, 10000.0).cos_sin_cache.to(device)
    q, k = qk_norm_rope(torch.empty(0, 2, 8, device=device), torch.empty(0, 1, 8, device=device),
                        torch.empty(0, dtype=torch.int64, device=device), cache)
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)


# ---- a tiny Qwen3 on the Triton ops against the torch ops ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_tiny_qwen3_fused_matches_torch(device, dtype, monkeypatch):
    pytest.importorskip("transformers")
    from kernels import triton_fused

    calls = {name: 0 for name in ("rms_norm", "qk_norm_rope", "silu_and_mul")}
    for name in calls:  # count launches: every layer must take the fused path, not just hold it
        def counted(*args, _fn=getattr(triton_fused, name), _name=name, **kwargs):
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(triton_fused, name, counted)
    from model_svc.config import ModelConfig
    from model_svc.loader import build_random_model
    from tests.model.paged_sim import PagedSim
    from tests.model.tiny_models import tiny_hf_config

    config = ModelConfig.from_hf_config(tiny_hf_config("qwen3", head_dim=32, intermediate_size=96))
    triton_ops = select_ops(device, "triton")
    models = {name: build_random_model(config, dtype, device, seed=3, ops=ops, std=0.1)
              for name, ops in (("torch", REFERENCE_OPS), ("triton", triton_ops))}
    assert models["triton"].model.layers[0].self_attn.fused_qk_norm_rope is not None
    assert models["torch"].model.layers[0].self_attn.fused_qk_norm_rope is None
    sims = {name: PagedSim(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                           num_blocks=16, block_size=8, dtype=dtype, device=str(device)) for name in models}
    steps = [[(0, list(range(5, 16))), (1, [7, 8, 9])], [(0, [3]), (1, [4])]]  # a prefill, a decode
    for new_tokens in steps:
        hidden = {}
        for name, model in models.items():
            ids, positions, attn = sims[name].step(new_tokens)
            hidden[name] = model(ids, positions, sims[name].kv_caches, attn)
        layers = config.num_hidden_layers
        assert calls == {"rms_norm": 2 * layers + 1, "qk_norm_rope": layers, "silu_and_mul": layers}
        calls.update(dict.fromkeys(calls, 0))
        if dtype == torch.float32:
            torch.testing.assert_close(hidden["triton"], hidden["torch"], rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(hidden["triton"].float(), hidden["torch"].float(), rtol=3e-2, atol=3e-2)
