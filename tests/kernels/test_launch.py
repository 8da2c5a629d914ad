"""Launch-time choices shared by the kernels (kernels.triton_common)."""

from __future__ import annotations

import pytest
import torch

from kernels.triton_common import PDL_ENV, use_pdl


def test_programmatic_dependent_launch_is_opt_in(monkeypatch):
    """Off unless PICOVLLM_PDL=1, and never off a GPU (the interpreter runs no griddepcontrol)."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert not use_pdl(cpu)
    monkeypatch.setenv(PDL_ENV, "1")
    assert not use_pdl(cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_programmatic_dependent_launch_on_hopper(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv(PDL_ENV, "0")
    assert not use_pdl(cuda)
    monkeypatch.setenv(PDL_ENV, "1")
    assert use_pdl(cuda) == (torch.cuda.get_device_capability()[0] >= 9)
