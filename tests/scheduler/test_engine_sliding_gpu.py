"""On a GPU: the sliding-window models of the parity tests (Mistral-style all-sliding, Qwen3
hybrid) through the Triton kernels and CUDA graphs give transformers' greedy tokens (fp32),
with chunked prefill and prefix caching, under swap and recompute preemption, and in decode
batches over a shared prefix (cascade decode: the full layers take it, the sliding ones do
not)."""

from __future__ import annotations

import random

import pytest

from scheduler_svc import LLM, SamplingParams
from tests.model.tiny_models import make_tiny_hf_model
from tests.scheduler.test_engine_parity import (
    MAX_NEW,
    TINY_MODELS,
    _hf_greedy,
    _mixed_prompts,
    assert_clean,
    assert_matches_hf,
)
from tests.scheduler.test_engine_sliding import SLIDING

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=list(SLIDING))
def sliding(request, tmp_path_factory):
    family, overrides = TINY_MODELS[request.param]
    path = make_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), family, **overrides)
    prompts = _mixed_prompts(vocab=512, block_size=16, seed=5)
    return path, prompts, _hf_greedy(path, prompts, MAX_NEW)


def _cuda_llm(path, **kwargs) -> LLM:
    llm = LLM(path, device="cuda", dtype="float32", **kwargs)
    assert llm.engine.model.ops.name == "triton" and llm.engine.model.graphs is not None
    return llm


def test_sliding_triton_graphs_match_hf(sliding):
    path, prompts, ref = sliding
    llm = _cuda_llm(path, num_gpu_blocks=512, max_num_batched_tokens=40)
    outs = llm.generate(prompts, GREEDY)
    assert_matches_hf([o.token_ids for o in outs], ref)
    assert_clean(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_sliding_triton_preemption(sliding, mode):
    path, prompts, ref = sliding
    llm = _cuda_llm(path, num_gpu_blocks=24, num_cpu_blocks=200, preemption_mode=mode, enable_prefix_caching=True)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_matches_hf([o.token_ids for o in outs], ref)
    assert_clean(llm)


def test_sliding_triton_cascade_batch(sliding):
    """Sixteen prompts sharing a 300-token prefix, twice (the second time from the cache)."""
    path, _, _ = sliding
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(300)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(5 + i)] for i in range(16)]
    ref = _hf_greedy(path, prompts, MAX_NEW)
    llm = _cuda_llm(path, num_gpu_blocks=1024, enable_prefix_caching=True)
    for _ in range(2):
        outs = llm.generate(prompts, GREEDY)
        assert_matches_hf([o.token_ids for o in outs], ref)
    assert_clean(llm)


def test_groups_on_gpu_hold_the_window_only(tmp_path):
    """KV-cache groups through the Triton kernels and CUDA graphs: the hybrid has a full and
    a sliding group, and an all-sliding model runs a context longer than its 12-block pool,
    both as transformers computes them."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(400)] for _ in range(2)]
    for name, windows in (("qwen3-hybrid", (0, 20)), ("mistral-all-sliding", (20,))):
        family, overrides = TINY_MODELS[name]
        path = make_tiny_hf_model(str(tmp_path / name), family, **overrides)
        blocks = 12 * len(windows) if len(windows) == 1 else 128
        llm = _cuda_llm(path, num_gpu_blocks=blocks, max_num_batched_tokens=32)
        assert llm.engine.kv.windows == windows
        outs = llm.generate(prompts, GREEDY)
        assert_matches_hf([o.token_ids for o in outs], _hf_greedy(path, prompts, MAX_NEW))
        assert_clean(llm)
