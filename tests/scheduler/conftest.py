"""The bundled model's engine, shared by the tests of one module."""

from __future__ import annotations

import pytest

from scheduler_svc import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_gpu_blocks=128)
