"""The one-pass Gumbel-max sampler (pico_kernels.triton_sample) and the Sampler's dispatch to it."""

from __future__ import annotations

import pytest
import torch

from contracts.sampling_params import SamplingParams
from model_svc.sampler import Sampler, SamplingBatch, make_generator
from pico_kernels.triton_sample import gumbel_sample, pick_num_chunks

PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
ORDER = torch.tensor([3, 0, 6, 1, 5, 2, 4])  # token id of each entry of PROBS


def test_greedy_rows_are_the_first_argmax(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((5, 300), generator=gen)
    logits[1, [7, 150, 299]] = 9.0  # ties across chunks: the first wins
    logits[2, [70, 71]] = 9.0  # ties inside a chunk
    logits[3, :] = 0.0  # all equal: index 0
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(device, dtype)
        temperature = torch.ones(5, device=device)
        greedy = torch.ones(5, dtype=torch.bool, device=device)
        assert torch.equal(gumbel_sample(x, temperature, greedy, seed=1).cpu(), x.float().argmax(-1).cpu())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_rows_follow_softmax_over_temperature(device, temperature):
    draws = 20000 if device.type == "cuda" else 800  # the interpreter runs one program at a time
    row = torch.full((7,), float("nan"))
    row[ORDER] = PROBS.log()
    logits = row.expand(draws, 7).contiguous().to(device, torch.bfloat16)
    tokens = gumbel_sample(
        logits,
        torch.full((draws,), temperature, device=device),
        torch.zeros(draws, dtype=torch.bool, device=device),
        seed=12345,
    )
    freq = (torch.bincount(tokens.cpu(), minlength=7).float() / draws)[ORDER]
    # bf16 logits of log(PROBS): the target is the softmax of what the kernel reads
    expected = torch.softmax(row[ORDER].to(torch.bfloat16).float() / temperature, 0)
    torch.testing.assert_close(freq, expected, atol=0.05 if draws < 5000 else 0.015, rtol=0)  # ~3 sigma


def test_seed_decides_the_draw(device):
    logits = torch.zeros((64, 50), device=device)
    temperature = torch.ones(64, device=device)
    greedy = torch.zeros(64, dtype=torch.bool, device=device)
    a = gumbel_sample(logits, temperature, greedy, seed=7)
    assert torch.equal(a, gumbel_sample(logits, temperature, greedy, seed=7))
    assert not torch.equal(a, gumbel_sample(logits, temperature, greedy, seed=8))
    assert len(set(a.tolist())) > 20  # uniform over 50 tokens: many distinct draws


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_seed_read_from_device_memory_draws_as_the_int(device, num_chunks):
    """A (1,) int64 tensor holding the key (what a captured launch reads each step) gives the
    draws of the same key passed as an int, into a given output buffer too."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((6, 700), generator=gen).to(device, torch.bfloat16)
    temperature = torch.full((6,), 0.9, device=device)
    greedy = torch.tensor([False] * 5 + [True], device=device)
    for seed in (0, 12345, 2**31 - 1):
        want = gumbel_sample(x, temperature, greedy, seed=seed, num_chunks=num_chunks)
        out = torch.full((6,), -1, dtype=torch.int64, device=device)
        got = gumbel_sample(x, temperature, greedy, torch.tensor([seed], device=device), num_chunks=num_chunks, out=out)
        assert got is out and torch.equal(got, want)
    assert not torch.equal(
        want, gumbel_sample(x, temperature, greedy, torch.tensor([7], device=device), num_chunks=num_chunks)
    )


@pytest.mark.parametrize("num_chunks", [2, 3, 5])
def test_draws_do_not_depend_on_the_chunking(device, num_chunks):
    """The noise is keyed by (row, column), so cutting rows into column ranges changes nothing:
    sampled rows draw the same tokens, greedy rows keep the first maximum across chunks, and a
    row of only -inf takes column 0 (as torch.argmax)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn((6, 1200), generator=gen)  # 5 interpreter blocks of 256 columns
    logits[4, [10, 530, 1190]] = 9.0  # ties in different chunks
    logits[5, :] = float("-inf")
    x = logits.to(device, torch.bfloat16)
    temperature = torch.full((6,), 0.8, device=device)
    greedy = torch.tensor([False, False, False, True, True, True], device=device)
    one = gumbel_sample(x, temperature, greedy, seed=99, num_chunks=1)
    assert torch.equal(gumbel_sample(x, temperature, greedy, seed=99, num_chunks=num_chunks), one)
    assert one[3:].tolist() == [x[3].float().argmax().item(), 10, 0]


def test_pick_num_chunks_fills_the_device():
    """About four programs per SM, chunks of at least one block, at least one chunk."""
    assert [pick_num_chunks(b, 151936, 2048, 132) for b in (1, 64, 256, 600)] == [75, 8, 2, 1]
    assert pick_num_chunks(1, 100, 2048, 132) == 1


def _batch(params, generators=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, [[]] * n, [[]] * n, generators, "cpu")


def test_sampler_takes_the_kernel_only_for_plain_temperature_rows():
    calls = []

    def fused(logits, temperature, greedy, seed):
        calls.append(seed)
        return torch.zeros(logits.shape[0], dtype=torch.int64)

    sampler = Sampler(fused)
    logits = torch.randn(2, 16)
    plain = [SamplingParams(temperature=0.7), SamplingParams(temperature=0)]
    sampler(logits, _batch(plain))
    sampler(logits, _batch(plain))
    assert len(calls) == 2 and calls[0] != calls[1]  # a new seed every step
    for other in (
        [SamplingParams(temperature=0.7, top_p=0.9)],
        [SamplingParams(temperature=0.7, top_k=5)],
        [SamplingParams(temperature=0.7, min_p=0.1)],
        [SamplingParams(temperature=0.7, logprobs=1)],
        [SamplingParams(temperature=0.7, presence_penalty=0.5)],
        [SamplingParams(temperature=0)],
    ):
        sampler(logits[:1], _batch(other))
    sampler(logits[:1], _batch([SamplingParams(temperature=0.7, seed=3)], [make_generator(3, "cpu")]))
    assert len(calls) == 2  # none of those took the kernel


def test_sampler_falls_back_when_the_kernel_fails(caplog):
    def broken(*args):
        raise RuntimeError("no kernel here")

    sampler = Sampler(broken)
    out = sampler(torch.randn(3, 16), _batch([SamplingParams(temperature=0.7)] * 3))
    assert out.token_ids.shape == (3,) and sampler.fused is None
    assert "fused sampling kernel failed" in caplog.text


def test_decode_graphs_sampling_body(device):
    """What a decode graph's sampling graph runs (DecodeGraphs._sample, here uncaptured): the LM
    head on the graph's hidden states, the one-pass kernel on the inputs' temperatures, greedy
    flags and key, the draws recorded at each row's slot of last_token (padding rows: the spare
    row only)."""
    import numpy as np

    from model_svc.cuda_graphs import DecodeGraphs

    class Head:
        def __init__(self):
            self.weight = torch.randn((300, 8), generator=torch.Generator().manual_seed(1)).to(device)

        def compute_logits(self, hidden):
            return hidden @ self.weight.T

    g = DecodeGraphs(Head(), [], 8, 4, device, last_token_rows=16, capture=False, sample=gumbel_sample)
    n, bucket = 5, 8
    hidden = torch.randn((bucket, 8), generator=torch.Generator().manual_seed(2)).to(device)
    g.outputs[(bucket, False)] = hidden
    h = g.host
    h.rows[:n] = [3, 9, 0, 15, 7]
    h.temperature[:n], h.greedy[:n], h.seed[0] = [0.7, 1.0, 1.3, 1.0, 0.9], [0, 1, 0, 1, 0], 777
    h.pad(n, bucket, g.spare_row)
    g.buffer.copy_(torch.from_numpy(g.host_buffer))
    g.last_token.fill_(-5)
    tokens = g._sample(bucket, False)
    logits = Head().compute_logits(hidden)
    want = gumbel_sample(logits, g.inputs.temperature[:bucket], g.inputs.greedy[:bucket], 777)
    assert torch.equal(tokens, want) and torch.equal(g.sampled[:bucket], want)
    assert torch.equal(want[[1, 3]], logits[[1, 3]].argmax(-1))  # greedy rows
    last = g.last_token.cpu()
    assert last[[3, 9, 0, 15, 7]].tolist() == want[:n].tolist()
    assert (
        last[16].item() in want[n:].tolist() and last[[r for r in range(16) if r not in (3, 9, 0, 15, 7)]].eq(-5).all()
    )
    assert np.all(h.rows[n:bucket] == 16)
