"""Greedy output of the whole engine equals Hugging Face transformers token for token (fp32,
CPU): the bundled stories260k and random tiny Qwen3 / Qwen2 / Llama models, and two
sliding-window ones (tests.scheduler.test_engine_sliding: Mistral-style all-sliding, a Qwen3
hybrid, the window under most prompts), in one batch, with prefix caching on and off, and
under preemption by swap and by recompute. Every run ends with the KV-cache invariant holding
and every block free or cached."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from contracts.service_config import BUNDLED_MODEL
from scheduler_svc import LLM, SamplingParams
from tests.model.tiny_models import make_tiny_hf_model

MAX_NEW = 24
NEAR_TIE = 1e-4
SLIDING_WINDOW = 20  # under most prompts, and under prompt + generation of all but the shortest


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Per prompt: HF's greedy new tokens and its raw logits at each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new like ignore_eos
    results = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        results.append((out.sequences[0, len(ids) :].tolist(), [step_logits[0] for step_logits in out.logits]))
    return results


def assert_matches_hf(ours: list[list[int]], ref: list[tuple[list[int], list[torch.Tensor]]]) -> None:
    """Token-for-token equality; a divergence is excused only at a near-tie in the reference
    (top-2 logit gap under 1e-4), after which the continuations legitimately differ."""
    for i, (got, (want, logits)) in enumerate(zip(ours, ref)):
        for step, (a, b) in enumerate(zip(got, want)):
            if a != b:
                top2 = torch.topk(logits[step], 2).values
                gap = float(top2[0] - top2[1])
                assert gap < NEAR_TIE, f"prompt {i}: step {step}: ours {a}, HF {b}, top-2 gap {gap:.2e}"
                break
        else:
            assert len(got) == len(want), f"prompt {i}: {len(got)} tokens vs HF {len(want)}"


def assert_clean(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.all_free_or_cached(), "blocks leaked"
    assert not llm.engine.requests


def _mixed_prompts(vocab: int, block_size: int, seed: int, n: int = 18) -> list[list[int]]:
    """Lengths inside blocks and exactly on block edges (k*bs - 1, k*bs, k*bs + 1)."""
    rng = random.Random(seed)
    lengths = [
        1,
        2,
        5,
        block_size - 1,
        block_size,
        block_size + 1,
        2 * block_size,
        2 * block_size + 3,
        3 * block_size - 1,
        3 * block_size,
        4 * block_size + 7,
        5 * block_size,
        37,
        50,
        61,
        77,
        90,
        100,
    ][:n]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


# ------------------------------------------------------------------ bundled model
def test_bundled_model_matches_reference_outputs():
    ref = json.loads((Path(BUNDLED_MODEL) / "reference_greedy.json").read_text())
    llm = LLM(num_gpu_blocks=256)
    results = ref["results"]
    outs = llm.generate([r["prompt"] for r in results], SamplingParams(temperature=0, max_tokens=ref["max_new_tokens"]))
    for r, out in zip(results, outs):
        assert out.prompt_token_ids == r["prompt_token_ids"]
        n = len(out.token_ids)
        assert out.token_ids == r["new_token_ids"][:n], r["prompt"]
        # Shorter only when the model emitted EOS (HF's reference runs to max_new_tokens).
        assert n == len(r["new_token_ids"]) or (out.finish_reason == "stop" and out.token_ids[-1] == 2)
        if n == len(r["new_token_ids"]):
            # Detokenized in the prompt's context (as vLLM does): prompt + text is the story.
            assert r["prompt"] + out.text == r["full_text"]
            assert out.text.strip() == r["new_text"].strip()
    assert_clean(llm)


# ------------------------------------------------------------------ random tiny models
# name -> (family, config overrides)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "llama": ("llama", {}),
    "mistral-all-sliding": ("mistral", dict(sliding_window=SLIDING_WINDOW)),
    "qwen3-hybrid": ("qwen3", dict(use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1)),
}


@pytest.fixture(scope="module", params=list(TINY_MODELS))
def tiny(request, tmp_path_factory):
    family, overrides = TINY_MODELS[request.param]
    path = make_tiny_hf_model(str(tmp_path_factory.mktemp(request.param)), family, **overrides)
    prompts = _mixed_prompts(vocab=512, block_size=16, seed=hash(request.param) % 1000)
    return path, prompts, _hf_greedy(path, prompts, MAX_NEW)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def test_tiny_models_one_batch(tiny):
    path, prompts, ref = tiny
    llm = LLM(path, num_gpu_blocks=512, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert_matches_hf([o.token_ids for o in outs], ref)
    assert_clean(llm)


def test_tiny_models_chunked_prefill(tiny):
    path, prompts, ref = tiny
    # Prompts split across steps.
    llm = LLM(path, num_gpu_blocks=512, max_num_batched_tokens=40)
    outs = llm.generate(prompts, GREEDY)
    assert_matches_hf([o.token_ids for o in outs], ref)
    assert_clean(llm)


def test_tiny_models_prefix_caching(tiny):
    path, prompts, _ = tiny
    rng = random.Random(7)
    shared = [rng.randrange(3, 512) for _ in range(70)]
    prefixed = [shared + p[:20] for p in prompts[:10]]
    ref = _hf_greedy(path, prefixed, MAX_NEW)
    for caching in (True, False):
        llm = LLM(path, num_gpu_blocks=512, enable_prefix_caching=caching)
        first = llm.generate(prefixed, GREEDY)
        assert_matches_hf([o.token_ids for o in first], ref)
        second = llm.generate(prefixed, GREEDY)
        assert_matches_hf([o.token_ids for o in second], ref)
        if caching:
            # Second pass: every full prompt block (all but the last token) comes from the cache.
            for p, o in zip(prefixed, second):
                assert o.num_cached_tokens == (len(p) - 1) // 16 * 16
            assert llm.engine.kv.num_prefix_hits > 0
        else:
            assert all(o.num_cached_tokens == 0 for o in second)
        assert_clean(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiny_models_preemption(tiny, mode, overlap):
    path, prompts, ref = tiny
    # About a quarter of what the batch needs at its peak: preemption must happen. Overlapped:
    # the next step is scheduled while the current one runs (placeholder tokens).
    llm = LLM(
        path,
        num_gpu_blocks=24,
        num_cpu_blocks=200,
        preemption_mode=mode,
        enable_prefix_caching=(mode == "swap"),
        async_scheduling=overlap,
    )
    assert llm.engine.async_scheduling == overlap
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    if mode == "swap":
        assert llm.engine.scheduler.stats.num_swapped_out_blocks > 0
    assert_matches_hf([o.token_ids for o in outs], ref)
    assert_clean(llm)


def test_swap_falls_back_to_recompute_when_host_pool_full(tiny):
    path, prompts, ref = tiny
    llm = LLM(path, num_gpu_blocks=24, num_cpu_blocks=2, preemption_mode="swap", async_scheduling=True)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert_matches_hf([o.token_ids for o in outs], ref)
    assert_clean(llm)
