"""Sampler semantics: greedy, seeds, truncation (top-k/top-p/min-p), penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from contracts.sampling_params import SamplingParams
from model_svc.sampler import Sampler, SamplingBatch, apply_penalties, make_generator

sampler = Sampler()


def _batch(params: list[SamplingParams], prompts=None, outputs=None, generators=None) -> SamplingBatch:
    n = len(params)
    prompts = prompts if prompts is not None else [[]] * n
    outputs = outputs if outputs is not None else [[]] * n
    return SamplingBatch.build(params, prompts, outputs, generators, "cpu")


def _logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_fast_path_is_argmax():
    logits = _logits(5)
    batch = _batch([SamplingParams(temperature=0.0)] * 5)
    assert batch.all_greedy and batch.top_k is None and batch.output_tokens is None
    assert torch.equal(sampler(logits, batch).token_ids, logits.argmax(-1))


def test_top_k_1_equals_greedy():
    logits = _logits(8)
    params = [SamplingParams(temperature=1.5, top_k=1, top_p=0.9)] * 4 + [SamplingParams(temperature=0.0)] * 4
    for _ in range(5):
        assert torch.equal(sampler(logits, _batch(params)).token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)] * 3
    out = sampler(logits, _batch(params)).token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def _seeded_run(seed: int, row: int, others: list[SamplingParams], steps: int = 20) -> list[int]:
    """Sample `steps` tokens for a seeded request that sits at index `row` among `others`."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    gen = make_generator(seed, "cpu")
    tokens = []
    for step in range(steps):
        batch_params = others[:row] + [params] + others[row:]
        generators = [make_generator(99, "cpu") if p.seed is not None else None for p in others]
        generators = generators[:row] + [gen] + generators[row:]
        logits = _logits(len(batch_params), seed=1000 + step)
        logits[row] = _logits(1, seed=step)[0]  # the request's own logits do not depend on the batch
        tokens.append(sampler(logits, _batch(batch_params, generators=generators)).token_ids[row].item())
    return tokens


def test_seed_is_reproducible_and_independent_of_batch():
    alone = _seeded_run(1234, 0, [])
    assert alone == _seeded_run(1234, 0, [])
    others = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=5, top_k=3)]
    assert alone == _seeded_run(1234, 2, others)
    assert alone == _seeded_run(1234, 1, others[:1])
    assert alone != _seeded_run(4321, 0, [])


# Designed distribution over 7 tokens (probabilities at temperature 1), in shuffled vocab order.
PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
ORDER = torch.tensor([3, 0, 6, 1, 5, 2, 4])  # token id of each entry of PROBS
DRAWS = 20000


def _empirical(params: SamplingParams) -> torch.Tensor:
    """Token frequencies over DRAWS samples, indexed like PROBS."""
    logits = torch.full((7,), float("nan"))
    logits[ORDER] = PROBS.log()
    batch = _batch([params] * DRAWS)
    torch.manual_seed(0)
    tokens = sampler(logits.expand(DRAWS, 7).contiguous(), batch).token_ids
    counts = torch.bincount(tokens, minlength=7).float() / DRAWS
    return counts[ORDER]


def _expect(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum()


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.5), _expect(PROBS**2)),
        (SamplingParams(top_k=3), _expect(PROBS * (torch.arange(7) < 3))),
        (SamplingParams(top_p=0.6), _expect(PROBS * (torch.arange(7) < 2))),  # 0.40 + 0.25 >= 0.6
        (SamplingParams(top_p=0.7), _expect(PROBS * (torch.arange(7) < 3))),  # needs the 0.15 too
        (SamplingParams(min_p=0.3), _expect(PROBS * (PROBS >= 0.12))),  # threshold 0.3 * 0.40
        (SamplingParams(min_p=0.3, top_k=2), _expect(PROBS * (torch.arange(7) < 2))),
        (SamplingParams(temperature=0.5, top_p=0.8), _expect(PROBS**2 * (torch.arange(7) < 2))),
    ],
)
def test_truncation_keeps_allowed_tokens_with_renormalized_frequencies(params, expected):
    freq = _empirical(params)
    assert torch.all(freq[expected == 0] == 0), f"disallowed tokens drawn: {freq}"
    torch.testing.assert_close(freq, expected.float(), atol=0.015, rtol=0)


def test_penalties_hand_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0], [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
    ]
    batch = _batch(params, prompts=[[0, 1], [0, 1, 2, 3]], outputs=[[3, 3, 4], [5]])
    out = apply_penalties(logits, batch)
    # token 0, 1: prompt only -> repetition; 3 (twice) and 4: output -> all three penalties.
    expected0 = torch.tensor([1.0, -2.0, 0.5, 1.5 - 0.25 * 2 - 0.5, -4.0 - 0.25 - 0.5, 0.0])
    torch.testing.assert_close(out[0], expected0)
    torch.testing.assert_close(out[1], logits[1])  # no penalties on that row


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    batch = _batch([SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)], prompts=[[0, 1]], outputs=[[2]])
    assert batch.prompt_tokens is None  # only repetition penalty needs the prompt
    torch.testing.assert_close(apply_penalties(logits, batch), torch.tensor([[0.0, 0.0, -2.0, 0.0]]))


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    batch = _batch([SamplingParams(temperature=0.0, frequency_penalty=2.0)], outputs=[[0]])
    assert batch.all_greedy and batch.output_tokens is not None
    assert sampler(logits, batch).token_ids.item() == 1


def test_penalties_need_token_ids():
    with pytest.raises(ValueError, match="penalties"):
        SamplingBatch.build([SamplingParams(repetition_penalty=1.2)], None, None, None, "cpu")


def test_logprobs_are_of_the_raw_logits():
    logits = _logits(4, vocab=32)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    out = sampler(logits, _batch(params, prompts=[[1, 2]] * 4, outputs=[[3]] * 4))
    expected = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    top = expected.topk(5, dim=-1)
    assert out.top_token_ids.shape == (4, 5)
    assert torch.equal(out.top_token_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)


def test_no_logprobs_unless_asked():
    out = sampler(_logits(2), _batch([SamplingParams()] * 2))
    assert out.logprobs is None and out.top_token_ids is None


def test_logprobs_zero_gives_only_the_sampled_token():
    out = sampler(_logits(2), _batch([SamplingParams(logprobs=0)] * 2))
    assert out.logprobs.shape == (2,) and out.top_token_ids.shape == (2, 0)
