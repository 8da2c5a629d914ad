"""Each engine setting is checked once (contracts.engine_fields): the embedded EngineConfig and
the service config's sections refuse the same bad values with the same words."""

from __future__ import annotations

import pytest

from contracts.service_config import ModelSection, SchedulerSection
from scheduler_svc.config import EngineConfig

BAD = [
    ("block_size", 12, "must be a power of two"),
    ("num_gpu_blocks", 0, "must be a positive integer or None"),
    ("num_cpu_blocks", -1, "must be a non-negative integer or None"),
    ("gpu_memory_utilization", 1.5, r"must be in \(0, 1\]"),
    ("swap_space_gib", -1.0, "must be >= 0"),
    ("dtype", "int8", "must be float32, bfloat16 or float16"),
    ("kernel_backend", "cuda", "must be 'torch' or 'triton'"),
    ("torch_threads", 0, "must be a positive integer or None"),
    ("max_num_batched_tokens", 0, "must be >= 1"),
    ("max_num_seqs", 0, "must be >= 1"),
    ("preemption_mode", "drop", "must be 'swap' or 'recompute'"),
    ("max_model_len", 0, "must be a positive integer or None"),
]


@pytest.mark.parametrize("name,value,words", BAD, ids=[b[0] for b in BAD])
def test_engine_and_service_config_refuse_alike(name, value, words):
    with pytest.raises(ValueError, match=rf"^{name} {words}, got {value!r}$"):
        EngineConfig(**{name: value})
    sections = [s for s in (ModelSection, SchedulerSection) if name in s.__dataclass_fields__]
    assert sections, name
    for section in sections:
        prefix = "model" if section is ModelSection else "scheduler"
        with pytest.raises(ValueError, match=rf"^{prefix}\.{name} {words}, got {value!r}$"):
            section(**{name: value})


def test_a_string_where_a_number_goes_is_refused_not_raised_as_type_error():
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization="lots")  # type: ignore[arg-type]
