"""pico_kernels.compile_ahead on the GPU: a rehearsal launches no uncompiled kernel, the block's
exit compiles each one once, and what follows (a runner's graph capture, its first
requests) compiles nothing more."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from contracts.sampling_params import SamplingParams
from model_svc.loader import BUNDLED_MODEL_DIR
from pico_kernels.compile_ahead import compile_ahead

pytestmark = pytest.mark.gpu


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def _launch(x: torch.Tensor, block: int) -> None:
    _add_one[(triton.cdiv(x.numel(), block),)](x, x.numel(), BLOCK=block)


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The names of the kernels Triton compiles (or loads from its disk cache) from now on."""
    names: list[str] = []

    def hook(*, fn, **_):
        names.append(fn.name)

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    return names


def test_a_rehearsal_launches_nothing_new_and_its_exit_compiles_each_kernel_once(compiles):
    x = torch.zeros(100, device="cuda")
    with compile_ahead(workers=4):
        for block in (32, 64, 64, 32):  # two specialisations, each met twice
            _launch(x, block)
        assert compiles == []  # nothing compiled inside the block
        assert torch.count_nonzero(x).item() == 0  # and nothing launched
    assert compiles.count("_add_one") == 2  # each specialisation once, at the exit
    assert knobs.runtime.jit_cache_hook is None  # the hook is Triton's again
    _launch(x, 32)
    _launch(x, 64)
    assert compiles.count("_add_one") == 2  # the real launches found them compiled
    torch.testing.assert_close(x, torch.full_like(x, 2.0))


def test_compiled_kernels_run_inside_the_block_and_a_failed_rehearsal_compiles_nothing(compiles):
    x = torch.zeros(40, device="cuda")
    _launch(x, 128)  # compiled before the block
    with compile_ahead():
        _launch(x, 128)
    torch.testing.assert_close(x, torch.full_like(x, 2.0))
    before = len(compiles)
    with pytest.raises(RuntimeError, match="rehearsal failed"), compile_ahead():
        _launch(x, 256)
        raise RuntimeError("rehearsal failed")
    assert len(compiles) == before and knobs.runtime.jit_cache_hook is None
    _launch(x, 256)  # compiles now, as it would without the block
    assert len(compiles) == before + 1
    torch.testing.assert_close(x, torch.full_like(x, 3.0))


def _start_and_serve(conn) -> None:
    """In a fresh process: LLM() on the bundled model, then a first batch of requests of
    several lengths and sampling modes; which kernels compiled in the capture and after."""
    names: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: names.append(fn.name)
    import model_svc.runner as runner_mod
    from scheduler_svc.llm import LLM

    capture, phases = runner_mod.ModelRunner._capture_graphs, {}

    def counted(self):
        before = len(names)
        capture(self)
        phases["capture"] = names[before:]

    runner_mod.ModelRunner._capture_graphs = counted
    llm = LLM(model=str(BUNDLED_MODEL_DIR), max_num_seqs=8)
    started = len(names)
    prompts = ["Once upon a time", "The little dog ran to the park and saw a big red ball", "A"]
    params = [SamplingParams(max_tokens=24, temperature=t, seed=1, ignore_eos=True) for t in (0.0, 0.8, 1.0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    conn.send(
        {
            "start": started,
            "capture": phases["capture"],
            "requests": names[started:],
            "lengths": [len(o.outputs[0].token_ids) for o in outs],
        }
    )
    conn.close()
    os._exit(0)  # the engine's threads need no teardown here


def test_a_fresh_start_compiles_everything_before_its_capture(tmp_path, monkeypatch):
    """With an empty Triton cache, every compile of a start happens in the profiling forward
    and compile_kernels: the graphs' capture and a first batch of requests compile nothing."""
    from bench.common import in_fresh_process

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    run = in_fresh_process("fresh start", _start_and_serve)
    assert run["start"] > 0 and run["lengths"] == [24, 24, 24]
    assert run["capture"] == [] and run["requests"] == []
