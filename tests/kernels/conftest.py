"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else on CPU tensors under
the Triton interpreter. TRITON_INTERPRET must be set before the kernels are decorated, i.e.
before pico_kernels.triton_ops is first imported, hence here."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
