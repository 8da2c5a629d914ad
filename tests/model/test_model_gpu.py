"""The model on CUDA, with the torch references and with the Triton kernels, against
transformers on the same GPU; the sampler's seeded path with CUDA generators."""

from __future__ import annotations

import pytest
import torch

from contracts.sampling_params import SamplingParams
from model_svc.loader import BUNDLED_MODEL_DIR, load_model
from model_svc.sampler import Sampler, SamplingBatch, make_generator
from pico_kernels import select_ops
from pico_kernels.ops import REFERENCE_OPS
from tests.model.paged_sim import PagedSim
from tests.model.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def _ops(name: str):
    return REFERENCE_OPS if name == "torch" else select_ops("cuda", "triton")


@torch.no_grad()
def _paged_logits(model, config, seqs: list[list[int]], chunk: int) -> list[torch.Tensor]:
    """Prefill every sequence in chunks of `chunk` tokens (all sequences per step)."""
    sim = PagedSim(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        num_blocks=256,
        dtype=next(model.parameters()).dtype,
        device="cuda",
    )
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for start in range(0, max(map(len, seqs)), chunk):
        step = [(i, s[start : start + chunk]) for i, s in enumerate(seqs) if start < len(s)]
        ids, positions, attn = sim.step(step)
        logits = model.compute_logits(model(ids, positions, sim.kv_caches, attn))
        for (i, _), part in zip(step, logits.split([len(t) for _, t in step])):
            outs[i].append(part)
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("ops_name", ["torch", "triton"])
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_tiny_fp32_on_cuda_matches_hf(tmp_path, family, ops_name):
    path = make_tiny_hf_model(tmp_path, family)
    model, config = load_model(path, "cuda", torch.float32, _ops(ops_name))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (70, 33, 129)]
    for chunk in (1000, 24, 1):  # whole prefill, chunked prefill, decode (one token per step)
        for tokens, ours in zip(seqs, _paged_logits(model, config, seqs, chunk)):
            with torch.no_grad():
                ref = hf(torch.tensor([tokens], device="cuda")).logits[0].float()
            torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("ops_name", ["torch", "triton"])
def test_stories_bf16_on_cuda_close_to_fp32(ops_name):
    model16, config = load_model(BUNDLED_MODEL_DIR, "cuda", torch.bfloat16, _ops(ops_name))
    model32, _ = load_model(BUNDLED_MODEL_DIR, "cuda", torch.float32, REFERENCE_OPS)
    seqs = [[1, 403, 407, 261, 378], [1, 317, 269, 274, 287, 263, 377, 267, 265, 282, 295, 433, 426]]
    for chunk in (1000, 1):
        l16 = _paged_logits(model16, config, seqs, chunk)
        l32 = _paged_logits(model32, config, seqs, chunk)
        for a, b in zip(l16, l32):
            assert a.dtype == torch.float32  # from the product's fp32 accumulator, never rounded to bf16
            assert (a.float() - b).abs().max().item() < 0.5
            assert torch.equal(a[-1].argmax(), b[-1].argmax())


def test_seeded_sampling_on_cuda_is_reproducible():
    sampler = Sampler()
    logits = torch.randn(3, 1000, device="cuda")
    params = [SamplingParams(seed=7, top_p=0.9), SamplingParams(), SamplingParams(temperature=0)]

    def run(rows: list[int]) -> list[int]:
        gens = [make_generator(7, "cuda") if params[r].seed is not None else None for r in rows]
        batch = SamplingBatch.build([params[r] for r in rows], None, None, gens, "cuda")
        return [sampler(logits[rows], batch).token_ids[0].item() for _ in range(5)]

    alone = run([0])
    assert alone == run([0, 1, 2]) and len(set(alone)) > 1  # same seed, fresh generator
