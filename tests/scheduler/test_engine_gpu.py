"""On a GPU: the engine's greedy output through the Triton kernels and CUDA graphs equals the
torch-reference path's, for the bundled model in fp32."""

import json
from pathlib import Path

import pytest

from contracts.service_config import BUNDLED_MODEL
from scheduler_svc import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_triton_path_equals_reference_path_fp32():
    ref = json.loads((Path(BUNDLED_MODEL) / "reference_greedy.json").read_text())
    prompts = [r["prompt"] for r in ref["results"]] * 4
    params = SamplingParams(temperature=0, max_tokens=64)
    fast = LLM(device="cuda", dtype="float32", num_gpu_blocks=512, max_num_batched_tokens=64)
    slow = LLM(
        device="cuda",
        dtype="float32",
        num_gpu_blocks=512,
        max_num_batched_tokens=64,
        kernel_backend="torch",
        enforce_eager=True,
    )
    assert fast.engine.model.ops.name == "triton" and fast.engine.model.graphs is not None
    got = [o.token_ids for o in fast.generate(prompts, params)]
    want = [o.token_ids for o in slow.generate(prompts, params)]
    assert got == want
    for r, toks in zip(ref["results"], got):
        n = min(len(toks), len(r["new_token_ids"]))
        assert toks[:n] == r["new_token_ids"][:n]
    fast.engine.kv.check_invariants()
    assert fast.engine.kv.all_free_or_cached()


def test_overlapped_launch_never_waits_for_the_device():
    """With async scheduling, queuing a step must not synchronize with the step in flight:
    every input goes through pinned memory with non-blocking copies. CUDA's sync debug mode
    raises on any synchronizing call made inside launch()."""
    import torch

    llm = LLM(device="cuda", dtype="float32", num_gpu_blocks=512, async_scheduling=True)
    runner = llm.engine.model
    assert llm.engine.async_scheduling and runner.pinned_inputs
    launch = runner.launch
    checked = []

    def strict_launch(inp):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(inp)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(inp.seqs))

    runner.launch = strict_launch
    params = [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=24),
    ]
    outs = llm.generate(["Once upon a time", "The little dog"], params)
    assert all(len(o.token_ids) == 24 for o in outs)
    assert len(checked) >= 24  # every step went through the strict launch


def test_no_triton_compiles_once_warm():
    """Kernels launched eagerly on run-time shapes (prefill, the logits) must not compile a new
    specialization for each batch: a compile mid-serving stalls every request for ~1 s. After
    one warm batch, batches of other sizes and token counts compile nothing."""
    from triton import knobs

    llm = LLM(device="cuda", dtype="float32", num_gpu_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(["Once upon a time there was", "A cat"], params)
    compiled = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["repr"])
    try:
        for batch in (
            ["The little dog ran"],
            ["x y", "The sun was shining and the", "Tom", "Lily had a red ball, and"] * 3,
        ):
            llm.generate(batch, params)
    finally:
        knobs.runtime.jit_post_compile_hook = previous
    assert compiled == []


def test_overlapped_graph_decode_with_cascade_equals_eager():
    """Overlapped decode through the graphs' one-copy inputs (each step's tokens unknown to the
    host, read inside the graph from the device) over a shared prefix of prefix-cache hits
    (the cascade graphs) gives the eager path's greedy tokens."""
    import random

    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(300)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(3 + i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fast = LLM(device="cuda", dtype="float32", num_gpu_blocks=512, async_scheduling=True, enable_prefix_caching=True)
    slow = LLM(device="cuda", dtype="float32", num_gpu_blocks=512, enforce_eager=True, async_scheduling=False)
    graphs = fast.engine.model.graphs
    replays = []
    replay = graphs.replay
    graphs.replay = lambda batch, cascade: replays.append((batch, cascade)) or replay(batch, cascade)
    got = [o.token_ids for o in fast.generate(prompts[:1], params) + fast.generate(prompts[1:], params)]
    want = [o.token_ids for o in slow.generate(prompts, params)]
    assert got == want
    assert (11, True) in replays and (1, False) in replays  # the cascade graph, and plain decode


class _CountedGraph:
    def __init__(self, graph, log, key):
        self.graph, self.log, self.key = graph, log, key

    def replay(self):
        self.log.append(self.key)
        self.graph.replay()


def test_sampling_in_the_decode_graphs_draws_as_the_runner():
    """Decode steps whose rows are all greedy or plain temperature are sampled inside the
    graphs (the LM head, the one-pass kernel with its key read from the inputs, the draws
    recorded at the rows): the same tokens as the runner's sampling after the graph, given
    the same keys; a row with top-k keeps its batch on the runner's sampler."""
    import random

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(5 + i)] for i in range(20)]
    plain = [SamplingParams(temperature=0 if i % 3 == 0 else 0.8, max_tokens=32, ignore_eos=True) for i in range(20)]

    def run(graph_sampling: bool, params) -> tuple[list[list[int]], list]:
        llm = LLM(device="cuda", dtype="float32", num_gpu_blocks=512, async_scheduling=True)
        runner = llm.engine.model
        runner.sampler._seed = 4321  # the same keys in both runs
        log = []
        graphs = runner.graphs
        assert graphs.sample_graphs, "sampling graphs were not captured"
        graphs.sample_graphs = (
            {k: _CountedGraph(g, log, k) for k, g in graphs.sample_graphs.items()} if graph_sampling else {}
        )
        return [o.token_ids for o in llm.generate(prompts, params)], log

    got, log = run(True, plain)
    want, _ = run(False, plain)
    assert got == want
    assert len(log) >= 30 and (32, False) in log  # the decode steps sampled in the graphs (20 rows: bucket 32)
    topk = [
        SamplingParams(temperature=0.8, top_k=5 if i == 7 else -1, max_tokens=8, ignore_eos=True) for i in range(20)
    ]
    outs, log = run(True, topk)
    assert log == [] and all(len(t) == 8 for t in outs)


def test_programmatic_dependent_launch_changes_no_token(monkeypatch):
    """PICOVLLM_PDL=1 (and the default, PDL in the small-batch decode graphs only) only changes
    when kernels start, never what they compute: bf16 greedy tokens with it equal those
    without, through the decode graphs (plain and cascade over a shared prefix; one prompt
    alone first, in the batch-1 graph), the fused gate|up + SiLU kernel (40 rows) and the
    eager prefill."""
    import random

    rng = random.Random(1)
    prefix = [rng.randrange(3, 500) for _ in range(200)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(2 + i % 7)] for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(pdl: str | None) -> list[list[int]]:
        if pdl is None:  # the default: the decode graphs of small batches only
            monkeypatch.delenv("PICOVLLM_PDL", raising=False)
        else:
            monkeypatch.setenv("PICOVLLM_PDL", pdl)  # read at every launch and at graph capture
        llm = LLM(
            device="cuda", dtype="bfloat16", num_gpu_blocks=1024, async_scheduling=True, enable_prefix_caching=True
        )
        return [o.token_ids for o in llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)]

    off = run("0")
    assert run("1") == off
    assert run(None) == off


def test_cascade_with_fused_store_equals_separate_launches(tmp_path, monkeypatch):
    """A tiny Qwen3 (head_dim 64, q/k norm, GQA) decoding over a shared prefix: the cascade
    graphs, whose prefix launch also norms q/k and writes the step's K/V
    (pico_kernels.triton_cascade.cascade_decode_attention_store), give the greedy tokens of eager
    decode with the separate qk_norm_rope_store launch before the cascade."""
    import random

    from model_svc.models.llama import LlamaAttention
    from pico_kernels import triton_cascade
    from tests.model.tiny_models import make_tiny_hf_model

    path = str(make_tiny_hf_model(tmp_path, "qwen3"))
    calls = []
    fused = triton_cascade.cascade_decode_attention_store
    monkeypatch.setattr(
        triton_cascade, "cascade_decode_attention_store", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    rng = random.Random(2)
    prefix = [rng.randrange(3, 500) for _ in range(300)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(2 + i)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        return [o.token_ids for o in llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)]

    got = run(LLM(model=path, device="cuda", dtype="float32", num_gpu_blocks=512, async_scheduling=True))
    assert calls, "the cascade path with the fused store was not taken"
    slow = LLM(
        model=path, device="cuda", dtype="float32", num_gpu_blocks=512, enforce_eager=True, async_scheduling=False
    )
    for module in slow.engine.model.model.modules():
        if isinstance(module, LlamaAttention):
            module.cascade = None  # qk_norm_rope_store, then cascade_decode_attention
    calls.clear()
    assert run(slow) == got
    assert not calls
