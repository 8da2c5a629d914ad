"""The fused elementwise kernels (pico_kernels.triton_fused) against their torch references, and a
tiny Qwen3 whose forward uses them against the same model on the torch ops.

Inputs are random (never zeros); q/k are strided head views of a fused qkv projection, as in
the model. Without CUDA the kernels run under the Triton interpreter (see conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_svc.config import RopeScaling
from model_svc.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary
from pico_kernels import select_ops
from pico_kernels.ops import REFERENCE_OPS
from pico_kernels.reference import qk_norm_rope_ref, qk_norm_rope_store_ref, rms_norm_ref, silu_and_mul_ref
from pico_kernels.triton_fused import heads_per_program, qk_norm_rope, qk_norm_rope_store, rms_norm, silu_and_mul
from pico_kernels.triton_store import store_kvcache

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


def _qkv_views(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device, with_v: bool = False):
    """q (N, Hq, D) and k (N, Hkv, D) (and v, with_v) as views into one (N, (Hq + 2 Hkv) D)
    projection."""
    qkv = _randn(n, (hq + 2 * hkv) * d, dtype=dtype, device=device, scale=2.0)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    views = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    return views if with_v else views[:2]


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


# ---- qk_norm_rope_store ----


def _poisoned_cache(num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype, device, padded: bool):
    """A NaN-filled (num_blocks, block_size, Hkv, D) cache; padded: a view with row stride > D,
    as a cache carved out of a bigger tensor."""
    width = d + 8 if padded else d
    cache = torch.full((num_blocks, block_size, hkv, width), float("nan"), dtype=dtype, device=device)
    return cache[..., :d]


def _written_rows(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(num_slots,) bool: the cache rows a slot mapping writes."""
    written = torch.zeros(num_slots, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    return written


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm-rope"])
@pytest.mark.parametrize(
    "head_dim,heads", [(8, (2, 2)), (64, (4, 2)), (8, (4, 2)), (64, (2, 2)), (80, (2, 1)), (16, (16, 8))]
)
@pytest.mark.parametrize("padded", [False, True], ids=["dense-cache", "strided-cache"])
def test_qk_norm_rope_store(device, dtype, qk_norm, head_dim, heads, padded):
    torch.manual_seed(head_dim + heads[0])
    hq, hkv = heads
    n, max_positions, num_blocks, block_size = 6, 256, 6, 4
    q, k, v = _qkv_views(n, hq, hkv, head_dim, dtype, device, with_v=True)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    rope_cache = RotaryEmbedding(head_dim, max_positions, 10000.0).cos_sin_cache.to(device, dtype)
    # positions and slots as slices of one packed int64 tensor at an odd offset (as the runner packs them)
    packed = torch.tensor([7, 0, 1, 255, 17, 100, 5, 13, 8, -1, 23, 1, -1, 6], dtype=torch.int64, device=device)
    positions, slots = packed[1 : n + 1], packed[n + 2 :]
    assert slots.shape == (n,) and slots.max() < num_blocks * block_size  # blocks 2, 5, 0, 1; two tokens skipped
    weights = (None, None)
    if qk_norm:
        weights = tuple(_randn(head_dim, dtype=dtype, device=device, scale=0.3) + 1.0 for _ in range(2))
    caches = {
        name: (_poisoned_cache(num_blocks, block_size, hkv, head_dim, dtype, device, padded),
               _poisoned_cache(num_blocks, block_size, hkv, head_dim, dtype, device, padded))
        for name in ("got", "want", "unfused")
    }  # fmt: skip
    before = q.clone(), k.clone(), v.clone()
    got = qk_norm_rope_store(q, k, v, positions, rope_cache, *weights, 1e-6, *caches["got"], slots)
    want = qk_norm_rope_store_ref(q, k, v, positions, rope_cache, *weights, 1e-6, *caches["want"], slots)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), before))  # inputs untouched
    assert_matches(got, want)
    written = _written_rows(slots, num_blocks * block_size)
    assert written.sum() == 4
    for which, got_cache, want_cache in zip("kv", caches["got"], caches["want"]):
        got_rows, want_rows = got_cache.reshape(-1, hkv, head_dim), want_cache.reshape(-1, hkv, head_dim)
        assert got_rows[~written].isnan().all()  # rows of no slot (and of the skipped tokens) untouched
        if which == "v":  # a copy
            assert torch.equal(got_rows[written], want_rows[written])
        else:
            assert_matches(got_rows[written].contiguous(), want_rows[written].contiguous())
    # bit for bit the unfused Triton path it replaces: qk_norm_rope, then store_kvcache
    q_unfused, k_unfused = qk_norm_rope(q, k, positions, rope_cache, *weights, eps=1e-6)
    store_kvcache(k_unfused, v, *caches["unfused"], slots)
    assert torch.equal(got, q_unfused)
    for got_cache, unfused_cache in zip(caches["got"], caches["unfused"]):
        assert torch.equal(got_cache.nan_to_num(7.0), unfused_cache.nan_to_num(7.0))


def test_heads_per_program():
    """Groups of heads that never mix q, k and v heads (Qwen3-0.6B: 16 + 8 + 8 in four groups)."""
    assert heads_per_program(16, 8) == 8 and heads_per_program(32, 8) == 8 and heads_per_program(64, 64) == 8
    assert heads_per_program(4, 2) == 2 and heads_per_program(12, 4) == 4 and heads_per_program(14, 2) == 2
    assert heads_per_program(2, 1) == 1 and heads_per_program(9, 3) == 1


def test_qk_norm_rope_store_casts_to_cache_dtype(device):
    """fp32 activations into bf16 caches: rotated in fp32, then rounded once, as .to() does."""
    torch.manual_seed(2)
    n, hq, hkv, d = 3, 4, 2, 16
    q, k, v = _qkv_views(n, hq, hkv, d, torch.float32, device, with_v=True)
    rope_cache = RotaryEmbedding(d, 64, 10000.0).cos_sin_cache.to(device)
    positions = torch.tensor([3, 0, 63], dtype=torch.int64, device=device)
    slots = torch.tensor([5, 2, -1], dtype=torch.int64, device=device)
    weights = tuple(_randn(d, dtype=torch.float32, device=device, scale=0.3) + 1.0 for _ in range(2))
    got_caches = [torch.zeros(2, 4, hkv, d, dtype=torch.bfloat16, device=device) for _ in range(2)]
    want_caches = [c.clone() for c in got_caches]
    got = qk_norm_rope_store(q, k, v, positions, rope_cache, *weights, 1e-6, *got_caches, slots)
    want = qk_norm_rope_store_ref(q, k, v, positions, rope_cache, *weights, 1e-6, *want_caches, slots)
    assert_matches(got, want)
    assert torch.equal(got_caches[1], want_caches[1])
    # k: fp32 results an ulp apart may round to neighbouring bf16 values, but rarely (a
    # truncating conversion would miss about half of them)
    torch.testing.assert_close(got_caches[0].float(), want_caches[0].float(), rtol=1e-2, atol=1e-2)
    assert (got_caches[0] != want_caches[0]).float().mean() < 0.05


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
    q, k = qk_norm_rope(
        torch.empty(0, 2, 8, device=device),
        torch.empty(0, 1, 8, device=device),
        torch.empty(0, dtype=torch.int64, device=device),
        cache,
    )
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)
    kv_cache = torch.full((2, 4, 1, 8), 3.0, device=device)
    empty_heads = torch.empty(0, 1, 8, device=device)
    q = qk_norm_rope_store(
        torch.empty(0, 2, 8, device=device),
        empty_heads,
        empty_heads,
        torch.empty(0, dtype=torch.int64, device=device),
        cache,
        None,
        None,
        0.0,
        kv_cache,
        kv_cache,
        torch.empty(0, dtype=torch.int64, device=device),
    )
    assert q.shape == (0, 2, 8) and (kv_cache == 3.0).all()


# ---- a tiny Qwen3 on the Triton ops against the torch ops ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_tiny_qwen3_fused_matches_torch(device, dtype, monkeypatch):
    pytest.importorskip("transformers")
    from pico_kernels import triton_fused

    fused_names = ("rms_norm", "qk_norm_rope", "qk_norm_rope_store", "silu_and_mul")
    calls = {name: 0 for name in (*fused_names, "store_kvcache")}

    def counting(fn, name):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name in fused_names:  # count launches: every layer must take the fused path, not just hold it
        monkeypatch.setattr(triton_fused, name, counting(getattr(triton_fused, name), name))
    from pico_kernels import triton_linear

    for name in ("gemv", "rms_norm_gemv"):
        calls[name] = 0
        monkeypatch.setattr(triton_linear, name, counting(getattr(triton_linear, name), name))
    from model_svc.config import ModelConfig
    from model_svc.loader import build_random_model
    from tests.model.paged_sim import PagedSim
    from tests.model.tiny_models import tiny_hf_config

    config = ModelConfig.from_hf_config(tiny_hf_config("qwen3", head_dim=32, intermediate_size=96))
    triton_ops = select_ops(device, "triton")
    triton_ops = dataclasses.replace(triton_ops, store_kvcache=counting(triton_ops.store_kvcache, "store_kvcache"))
    models = {
        name: build_random_model(config, dtype, device, seed=3, ops=ops, std=0.1)
        for name, ops in (("torch", REFERENCE_OPS), ("triton", triton_ops))
    }
    # The same weights: a 16-bit model on the Triton ops folds its norm weights into the
    # projections at load (for the deferred norms), the torch one is given them folded too.
    assert models["triton"].model.norms_folded == (dtype != torch.float32)
    if models["triton"].model.norms_folded:
        models["torch"].fold_norm_weights(force=True)
    assert models["triton"].model.layers[0].self_attn.fused_qk_norm_rope_store is not None
    assert models["torch"].model.layers[0].self_attn.fused_qk_norm_rope_store is None
    sims = {
        name: PagedSim(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            num_blocks=16,
            block_size=8,
            dtype=dtype,
            device=str(device),
        )
        for name in models
    }
    layers = config.num_hidden_layers
    # a prefill and decodes of two rows and one through the cache (K/V stored by the fused
    # kernel, no separate store), then a profiling forward without one (q/k rotated, K/V used directly)
    steps = [
        ([(0, list(range(5, 16))), (1, [7, 8, 9])], True),
        ([(0, [3]), (1, [4])], True),
        ([(1, [5])], True),
        ([(2, [1, 2, 3, 4])], False),
    ]
    for new_tokens, with_cache in steps:
        hidden = {}
        for name, model in models.items():
            ids, positions, attn = sims[name].step(new_tokens)
            hidden[name] = model(ids, positions, sims[name].kv_caches if with_cache else None, attn)
        fused_rope = {"qk_norm_rope_store": layers, "qk_norm_rope": 0} if with_cache else {"qk_norm_rope": layers}
        rows = len(ids)
        if dtype != torch.float32 and rows == 1:
            # 16-bit, one row: o and down by gemv (SiLU-and-mul inside down's), q|k|v and gate|up
            # by gemv with the layer's two norms inside; only the final norm is alone
            projections = {"gemv": 2 * layers, "rms_norm_gemv": 2 * layers, "silu_and_mul": 0, "rms_norm": 1}
        elif dtype != torch.float32 and rows <= triton_linear.GEMV_MAX_ROWS:
            # up to four rows: o and down by gemv where they narrow (use_gemv's rule), the norms,
            # q|k|v and gate|up as at any batch
            layer0 = models["triton"].model.layers[0]
            narrows = [
                triton_linear.use_gemv(torch.zeros((rows, w.shape[1]), dtype=dtype), w)
                for w in (layer0.self_attn.o_proj.weight, layer0.mlp.down_proj.weight)
            ]
            projections = {
                "gemv": sum(narrows) * layers,
                "rms_norm_gemv": 0,
                "silu_and_mul": 0 if narrows[1] else layers,
                "rms_norm": 2 * layers + 1,
            }
        else:
            projections = {"gemv": 0, "rms_norm_gemv": 0, "silu_and_mul": layers, "rms_norm": 2 * layers + 1}
        assert calls == {**dict.fromkeys(calls, 0), **projections, **fused_rope}
        calls.update(dict.fromkeys(calls, 0))
        if dtype == torch.float32:
            torch.testing.assert_close(hidden["triton"], hidden["torch"], rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(hidden["triton"].float(), hidden["torch"].float(), rtol=3e-2, atol=3e-2)
    for (k_t, v_t), (k_r, v_r) in zip(sims["triton"].kv_caches, sims["torch"].kv_caches):  # the caches too
        if dtype == torch.float32:
            torch.testing.assert_close(k_t, k_r, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v_t, v_r, rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(k_t.float(), k_r.float(), rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(v_t.float(), v_r.float(), rtol=3e-2, atol=3e-2)
