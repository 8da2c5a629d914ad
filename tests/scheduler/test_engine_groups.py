"""KV-cache groups on real engine runs: a sliding-window group holds only its window's blocks,
so a hybrid model needs less KV memory than the same weights with every layer full, and an
all-sliding model serves a context longer than its whole device pool, token for token as
transformers does. And what the prefix cache registers when a request ends in the step that
computed its prompt."""

from __future__ import annotations

import random

import pytest

from model_svc.kv_cache import KVCachePools
from model_svc.loader import BUNDLED_MODEL_DIR
from scheduler_svc import LLM, SamplingParams
from tests.model.tiny_models import make_tiny_hf_model
from tests.scheduler.test_engine_parity import _hf_greedy, assert_clean, assert_matches_hf

WINDOW, BS = 20, 16
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _peak_bytes(llm: LLM, prompts: list[list[int]]) -> tuple[int, list[int], list]:
    """Peak KV bytes in use over the run, each group's most live blocks of one sequence, and
    the outputs."""
    engine, runner = llm.engine, llm.engine.model
    block_bytes = KVCachePools.bytes_per_block(runner.config, BS, runner.kv_dtype, runner.kv_groups)
    groups = engine.kv.num_groups
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, str(i))
    peak, per_group, outs = 0, [0] * groups, []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
        peak = max(peak, engine.kv.device.num_used_blocks * block_bytes)
        for seq_id in engine.kv.seqs:
            table = engine.kv.block_table(seq_id)
            for g in range(groups):
                per_group[g] = max(per_group[g], sum(b >= 0 for b in table[g::groups]))
    return peak, per_group, sorted(outs, key=lambda o: int(o.request_id))


def test_hybrid_holds_less_than_all_full(tmp_path):
    """Qwen3, layer 0 full and layer 1 sliding: two groups of one layer. Over a 260-token
    prompt and 40 decode steps the sliding group never holds more than its window's blocks
    (plus the chunk being written), and the run's peak KV bytes are well under those of the
    same weights with both layers full; the tokens equal transformers' in both."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(260)]]
    sliding = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    hybrid = make_tiny_hf_model(tmp_path / "h", "qwen3", **sliding)
    full = make_tiny_hf_model(tmp_path / "f", "qwen3")
    results = {}
    for name, path in (("hybrid", hybrid), ("full", full)):
        llm = LLM(str(path), num_gpu_blocks=128, block_size=BS, max_num_batched_tokens=64)
        assert llm.engine.kv.windows == ((0, WINDOW) if name == "hybrid" else (0,))
        results[name] = _peak_bytes(llm, prompts)
        assert_matches_hf([o.token_ids for o in results[name][2]], _hf_greedy(str(path), prompts, 40))
        assert_clean(llm)
    (hybrid_peak, per_group, _), (full_peak, _, _) = results["hybrid"], results["full"]
    assert per_group[0] == -(-300 // BS)  # the full group: every block of prompt and output
    assert per_group[1] <= -(-(WINDOW - 1) // BS) + 1 + -(-64 // BS)  # window + one chunk
    assert hybrid_peak < 0.7 * full_peak, (hybrid_peak, full_peak)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_all_sliding_context_longer_than_the_pool(tmp_path, overlap):
    """Mistral-style, every layer sliding: 12 blocks hold 192 tokens, yet a 400-token prompt
    (chunked) and its 40 tokens run, as transformers computes them."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(400)]]
    path = make_tiny_hf_model(tmp_path, "mistral", sliding_window=WINDOW)
    llm = LLM(str(path), num_gpu_blocks=12, block_size=BS, max_num_batched_tokens=32, async_scheduling=overlap)
    outs = llm.generate(prompts, GREEDY)
    assert len(prompts[0]) + len(outs[0].token_ids) > 12 * BS
    assert_matches_hf([o.token_ids for o in outs], _hf_greedy(str(path), prompts, 40))
    assert_clean(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_a_request_that_ends_in_its_prefill_step_registers_its_prompt(overlap):
    """max_tokens=1: the request finishes with the step that computed its prompt; its full
    prompt blocks still go into the prefix cache, so the same prompt again hits them all."""
    llm = LLM(str(BUNDLED_MODEL_DIR), num_gpu_blocks=64, async_scheduling=overlap)
    prompt = list(range(5, 5 + 70))
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt], one)
    again = llm.generate([prompt], one)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // BS * BS
    assert_clean(llm)
