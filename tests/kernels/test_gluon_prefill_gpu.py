"""On a Hopper GPU (skipped elsewhere): the default prefill launch is pico_kernels.gluon_prefill's
warp-specialised kernel where it applies, matches the torch reference on ragged batches whose
unused cache slots are NaN, leaves the launches it does not apply to to the Triton kernel,
and is compiled ahead by pico_kernels.compile_ahead like the Triton kernels. (Its build for
sm_90 is checked on the CPU by test_gluon_prefill_build.py; CUDA-graph capture of the default
prefill by test_kernels_gpu.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from triton import knobs

from pico_kernels.compile_ahead import compile_ahead
from pico_kernels.reference import paged_prefill_attention_ref
from pico_kernels.triton_prefill import PrefillConfig, prefill_with_config
from tests.kernels.test_kernels import assert_matches, make_paged_kv, make_query, nan_like

hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)
pytestmark = [pytest.mark.gpu, hopper]

# (block size, head dim, (query heads, KV heads))
SHAPES = [(16, 128, (32, 8)), (8, 64, (8, 2)), (32, 128, (16, 16)), (128, 64, (12, 4))]
BATCH = ([700, 1, 300, 129, 64], [1000, 50, 0, 3, 2000])  # new tokens, cached


@pytest.fixture
def ws_launches(monkeypatch) -> list[int]:
    """The token counts of the warp-specialised launches made from now on."""
    from pico_kernels import gluon_prefill

    counts: list[int] = []
    launch = gluon_prefill.paged_prefill

    def spy(q, *args, **kwargs):
        counts.append(q.shape[0])
        return launch(q, *args, **kwargs)

    monkeypatch.setattr(gluon_prefill, "paged_prefill", spy)
    return counts


def prefill_case(dtype, block_size, head_dim, heads, batch=BATCH, seed=3, window=0, **kwargs):
    """(out, ref) of one launch (the default unless kwargs ask for a config) over a shuffled,
    NaN-padded cache."""
    gen = torch.Generator().manual_seed(seed)
    cuda = torch.device("cuda")
    q_lens, cached = batch
    lens = [c + n for c, n in zip(cached, q_lens)]
    k_cache, v_cache, tables, seq_lens = make_paged_kv(lens, heads[1], head_dim, block_size, dtype, cuda, gen)
    cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(cuda, torch.int32)
    q = make_query(sum(q_lens), *heads, head_dim, dtype, cuda, gen)
    scale = 1.0 / math.sqrt(head_dim)
    out = nan_like(q)
    prefill_with_config(q, k_cache, v_cache, tables, cu, seq_lens, scale, out=out, window=window, **kwargs)
    return out, paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, scale, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size,head_dim,heads", SHAPES)
def test_default_prefill_is_the_warp_specialised_kernel_and_matches_the_reference(
    ws_launches, dtype, block_size, head_dim, heads
):
    out, ref = prefill_case(dtype, block_size, head_dim, heads)
    assert ws_launches == [sum(BATCH[0])]
    assert_matches(out, ref)


@pytest.mark.parametrize(
    "case",
    [
        dict(block_size=16, head_dim=80, kwargs={}),  # head_dim
        dict(block_size=256, head_dim=128, kwargs={}),  # pages longer than a key tile
        dict(block_size=16, head_dim=128, kwargs=dict(window=100)),  # a sliding window
        dict(block_size=16, head_dim=128, kwargs=dict(max_query_len=64)),  # short queries: packed tiles
        dict(block_size=16, head_dim=128, kwargs=dict(config=PrefillConfig(128, 128, 8, 3))),  # a config asked for
    ],
    ids=["d80", "page256", "window", "short", "config"],
)
def test_other_launches_take_the_triton_kernel(ws_launches, case):
    batch = ([64, 1, 17], [500, 0, 90]) if "max_query_len" in case["kwargs"] else BATCH
    out, ref = prefill_case(torch.bfloat16, case["block_size"], case["head_dim"], (8, 2), batch, **case["kwargs"])
    assert ws_launches == []
    assert_matches(out, ref)


def test_an_fp8_cache_takes_the_triton_kernel():
    from pico_kernels import gluon_prefill

    q = torch.zeros((4, 8, 128), dtype=torch.bfloat16, device="cuda")
    fp8 = torch.zeros((3, 16, 2, 128), dtype=torch.float8_e4m3fn, device="cuda")
    bf16 = fp8.to(torch.bfloat16)
    assert gluon_prefill.applies(q, bf16, bf16, 0)
    assert not gluon_prefill.applies(q, fp8, fp8, 0)
    assert not gluon_prefill.applies(q, bf16[:, :8], bf16[:, :8], 0)  # not contiguous


def test_compile_ahead_compiles_the_warp_specialised_kernel_at_its_exit(monkeypatch):
    names: list[str] = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda *, fn, **_: names.append(fn.name))
    heads = (14, 1)  # a GROUP no other test launches: a specialisation not compiled yet
    with compile_ahead(workers=2):
        out, _ = prefill_case(torch.float16, 16, 64, heads, seed=4)
        assert names == []  # recorded, not compiled, and not launched
        assert out.isnan().all()
    assert names.count("_prefill_ws_kernel") == 1
    out, ref = prefill_case(torch.float16, 16, 64, heads, seed=4)
    assert names.count("_prefill_ws_kernel") == 1  # found compiled
    assert_matches(out, ref)
