"""Tensor parallelism on the CPU (gloo): greedy output equals TP=1 token for token, on the
bundled stories260k at TP=2 (8 q heads, 4 KV heads: split) and a random fp32 Qwen3 at TP=4
(4 q heads, 2 KV heads: replicated), with prefix caching, swap preemption and
overlapped scheduling (placeholder tokens) on; the checkpoint slicing and the config checks;
a rank killed with SIGKILL fails the embedded engine with a clear error, and closing the
runner stops every rank."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from contracts.service_config import BUNDLED_MODEL
from model_svc.config import ModelConfig
from model_svc.parallel import TensorParallelError, kv_heads_of_rank, shard_config, shard_weights
from scheduler_svc import LLM, SamplingParams
from tests.model.tiny_models import make_tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Five prompts of odd lengths; the first and the fourth share a 40-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    lengths = (1, 5, 33, 23, 50)
    return [(shared if i in (0, 3) else []) + [rng.randrange(3, 512) for _ in range(n)] for i, n in enumerate(lengths)]


def _run(model: str, prompts: list[list[int]], tp: int) -> tuple[list[list[int]], LLM]:
    # Three sequences at a time in too few blocks: swap preemption, and the fourth prompt
    # finds the first one's prefix in the cache.
    llm = LLM(
        model,
        num_gpu_blocks=8,
        num_cpu_blocks=200,
        max_num_seqs=3,
        preemption_mode="swap",
        enable_prefix_caching=True,
        async_scheduling=True,
        device="cpu",
        torch_threads=1,
        tensor_parallel_size=tp,
    )
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.num_swapped_out_blocks > 0
    assert llm.engine.kv.num_prefix_hits > 0
    llm.engine.kv.check_invariants()
    return outs, llm


@pytest.fixture(scope="module", params=["bundled", "qwen3"])
def model_and_reference(request, tmp_path_factory):
    if request.param == "bundled":
        model = BUNDLED_MODEL
    else:
        model = str(make_tiny_hf_model(tmp_path_factory.mktemp("qwen3"), "qwen3"))
    prompts = _prompts(seed=len(request.param))
    ref, llm = _run(model, prompts, 1)
    llm.engine.model.close()
    return request.param, model, prompts, ref


# Each model at the size that shows its layout: the bundled one's KV heads split over 2 ranks,
# the Qwen3's 2 KV heads replicated over 4 (kv_heads_of_rank's other layouts: below).
TP_OF = {"bundled": 2, "qwen3": 4}


def test_greedy_equals_single_rank_then_close_stops_every_rank(model_and_reference):
    name, model, prompts, ref = model_and_reference
    tp = TP_OF[name]
    got, llm = _run(model, prompts, tp)
    runner = llm.engine.model
    pids = runner.tp.rank_pids
    try:
        assert got == ref
    finally:
        runner.close()
    assert len(pids) == tp - 1
    for pid in pids:
        _assert_gone(pid)


def test_rank_killed_fails_with_a_clear_error_and_leaves_no_process():
    llm = LLM(num_gpu_blocks=64, num_cpu_blocks=16, device="cpu", tensor_parallel_size=2)
    runner = llm.engine.model
    (rank1,) = runner.tp.rank_pids
    try:
        assert llm.generate(["Once upon a time"], GREEDY)[0].token_ids
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while runner.tp.failure is None:
            assert time.monotonic() < deadline, "rank 0 did not notice"
            time.sleep(0.05)
        with pytest.raises(TensorParallelError, match="rank 1 exited with code -9"):
            llm.generate(["Once upon a time"], GREEDY)
    finally:
        runner.close()
    _assert_gone(rank1)


def _assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):  # exited and reaped
        os.kill(pid, 0)


# ------------------------------------------------------------------ sharding, no processes
def _config(heads: int, kv_heads: int, inter: int = 64) -> ModelConfig:
    return ModelConfig(
        family="llama",
        architecture="LlamaForCausalLM",
        vocab_size=10,
        hidden_size=16,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def test_kv_heads_split_or_replicated():
    assert [kv_heads_of_rank(4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    assert [kv_heads_of_rank(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    local = shard_config(_config(8, 2), 4)
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (2, 1, 16)


@pytest.mark.parametrize(
    "heads, kv_heads, inter, size, why",
    [(6, 6, 64, 4, "6 attention heads"), (8, 3, 64, 2, "3 KV heads"), (8, 8, 66, 4, "intermediate size 66")],
)
def test_shard_config_names_what_does_not_split(heads, kv_heads, inter, size, why):
    with pytest.raises(ValueError, match=why):
        shard_config(_config(heads, kv_heads, inter), size)


def test_shard_weights_slices_reassemble_the_model():
    """Every rank's slices put back together are the whole tensors: rows of q/k/v and gate/up,
    columns of o/down, vocab rows padded, row-parallel bias on rank 0 only, norms whole."""
    config = _config(8, 2)
    gen = torch.Generator().manual_seed(0)
    whole = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 16, generator=gen),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 16, generator=gen),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 32, generator=gen),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(16, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 64, generator=gen),
        "model.embed_tokens.weight": torch.randn(10, 16, generator=gen),
        "model.norm.weight": torch.randn(16, generator=gen),
    }
    shards = [dict(shard_weights(whole.items(), config, r, 4)) for r in range(4)]
    name = "model.layers.0.self_attn."
    assert torch.equal(torch.cat([s[name + "q_proj.weight"] for s in shards]), whole[name + "q_proj.weight"])
    k = whole[name + "k_proj.weight"]
    assert all(torch.equal(s[name + "k_proj.weight"], k[4 * (r // 2) : 4 * (r // 2 + 1)]) for r, s in enumerate(shards))
    assert torch.equal(torch.cat([s[name + "o_proj.weight"] for s in shards], 1), whole[name + "o_proj.weight"])
    assert torch.equal(sum(s[name + "o_proj.bias"] for s in shards), whole[name + "o_proj.bias"])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([s[down] for s in shards], 1), whole[down])
    embed = torch.cat([s["model.embed_tokens.weight"] for s in shards])  # 4 rows a rank, 12 in all
    assert embed.shape == (12, 16) and torch.equal(embed[:10], whole["model.embed_tokens.weight"])
    assert not embed[10:].any()
    assert all(torch.equal(s["model.norm.weight"], whole["model.norm.weight"]) for s in shards)


# ------------------------------------------------------------------ GPUs (NCCL, CUDA graphs)
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_greedy_equals_single_rank_with_graphs(tmp_path):
    """fp32 on the Triton kernels with the decode and prefill CUDA graphs (their all-reduces
    captured), overlapped scheduling: TP=2 equals TP=1 token for token."""
    model = str(make_tiny_hf_model(tmp_path, "qwen3"))
    prompts = _prompts(seed=3)
    outs = []
    for tp in (1, 2):
        llm = LLM(model, dtype="float32", device="cuda", num_gpu_blocks=64, num_cpu_blocks=64, tensor_parallel_size=tp)
        try:
            assert llm.engine.model.graphs is not None
            outs.append([o.token_ids for o in llm.generate(prompts, GREEDY)])
        finally:
            llm.engine.model.close()
    assert outs[0] == outs[1]
