"""The three services with the scheduler's pipelined step (`--async-scheduling`): Generate
equals embedded mode token for token, and 32 concurrent streams with half of them cancelled
all end with every block free."""

from __future__ import annotations

import pytest

from tests.services.conftest import PROMPTS, Stack, generate_all
from tests.services.test_service_generate import (
    GREEDY,
)
from tests.services.test_service_generate import (
    test_32_concurrent_streams_with_half_cancelled as _half_cancelled,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("svc-pipelined"), scheduler_args=["--async-scheduling"])
    yield s
    s.close()


def test_pipelined_generate_equals_embedded(stack, embedded):
    want = embedded(PROMPTS, **GREEDY)
    assert generate_all(stack, PROMPTS, **GREEDY) == want
    assert generate_all(stack, PROMPTS, concurrent=True, **GREEDY) == want
    stack.wait_kv_clean()


def test_pipelined_32_concurrent_streams_with_half_cancelled(stack):
    _half_cancelled(stack)
