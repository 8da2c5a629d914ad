"""Launch-time choices shared by the kernels (pico_kernels.triton_common)."""

from __future__ import annotations

import pytest
import torch

from pico_kernels.triton_common import PDL_ENV, pdl_scope, pdl_wanted, use_pdl


def test_programmatic_dependent_launch_policy(monkeypatch):
    """Unset: only inside pdl_scope(True) (nested scopes restore the outer one); PICOVLLM_PDL=1
    everywhere, =0 nowhere, scope or not; and never off a GPU (the interpreter runs no
    griddepcontrol)."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert not pdl_wanted()
    with pdl_scope(True):
        assert pdl_wanted() and not use_pdl(cpu)
        with pdl_scope(False):
            assert not pdl_wanted()
        assert pdl_wanted()
    assert not pdl_wanted()
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_wanted() and not use_pdl(cpu)
    with pdl_scope(False):
        assert pdl_wanted()
    monkeypatch.setenv(PDL_ENV, "0")
    with pdl_scope(True):
        assert not pdl_wanted()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_programmatic_dependent_launch_on_hopper(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv(PDL_ENV, "0")
    assert not use_pdl(cuda)
    monkeypatch.delenv(PDL_ENV)
    assert not use_pdl(cuda)
    with pdl_scope(True):
        assert use_pdl(cuda) == (torch.cuda.get_device_capability()[0] >= 9)
    monkeypatch.setenv(PDL_ENV, "1")
    assert use_pdl(cuda) == (torch.cuda.get_device_capability()[0] >= 9)


def test_small_batch_pdl_only_where_steps_queue_back_to_back():
    """The engine asks for PDL in its small-batch decode graphs unless it launches steps one at
    a time and waits for each (synchronous scheduling)."""
    from model_svc.runner_factory import RunnerSettings, small_batch_pdl
    from scheduler_svc.config import EngineConfig

    assert small_batch_pdl(None) and small_batch_pdl(True)
    assert not small_batch_pdl(False)
    assert RunnerSettings.of(EngineConfig()).small_batch_pdl
    assert not RunnerSettings.of(EngineConfig(async_scheduling=False)).small_batch_pdl
