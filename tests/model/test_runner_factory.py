"""One runner factory (model_svc.runner_factory): the embedded engine and the model service
build their ModelRunner from equal settings for the same config, PDL choice included."""

from __future__ import annotations

import asyncio

import pytest

from contracts.auth import Credentials
from contracts.service_config import ModelSection, load_config
from model_svc import runner_factory
from model_svc.runner_factory import RunnerSettings
from model_svc.server import ModelService
from scheduler_svc.config import EngineConfig
from scheduler_svc.engine import LLMEngine

# The model section's keys (everything but its address) and the scheduler's two the runner needs.
MODEL_KEYS = dict(
    block_size=8,
    num_gpu_blocks=40,
    num_cpu_blocks=6,
    swap_space_gib=0.5,
    gpu_memory_utilization=0.8,
    device="cpu",
    dtype="float32",
    kernel_backend="torch",
    max_num_batched_tokens=512,
    torch_threads=1,
    enforce_eager=True,
    tensor_parallel_size=2,
    tp_master_addr="localhost",
    tp_master_port=29611,
)


class _Built(Exception):
    pass


@pytest.fixture
def built(monkeypatch):
    """The settings each build_runner call got (the call then stops its caller)."""
    calls: list[RunnerSettings] = []

    def record(settings: RunnerSettings, tp=None, on_failure=None):
        calls.append(settings)
        raise _Built

    monkeypatch.setattr(runner_factory, "build_runner", record)
    return calls


@pytest.mark.parametrize("async_scheduling", [None, True, False])
def test_embedded_and_service_mode_build_the_same_runner(built, async_scheduling):
    with pytest.raises(_Built):
        LLMEngine(EngineConfig(max_num_seqs=24, async_scheduling=async_scheduling, **MODEL_KEYS))
    with pytest.raises(_Built):
        ModelService(ModelSection(**MODEL_KEYS), 24, async_scheduling=async_scheduling).load()
    embedded, service = built
    assert embedded == service
    assert embedded.max_num_seqs == 24 and embedded.num_cpu_blocks == 6
    assert service.small_batch_pdl == (async_scheduling is not False)


def test_the_model_service_gets_the_scheduler_sections_choice(monkeypatch):
    """`serve model` (and `serve all`'s model child) passes the scheduler section's batch limit
    and scheduling mode, as an embedded engine with that config would use them."""
    import model_svc.server
    from scheduler_svc.serve_cli import _serve_one

    got = {}

    async def serve(config, max_num_seqs=256, token=None, *, async_scheduling=None):
        got.update(config=config, max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)

    monkeypatch.setattr(model_svc.server, "serve", serve)
    config = load_config(overrides={"scheduler": {"max_num_seqs": 12, "async_scheduling": False}}, env={})
    asyncio.run(_serve_one("model", config, Credentials()))
    assert got == {"config": config.model, "max_num_seqs": 12, "async_scheduling": False}
    settings = RunnerSettings.of(config.model, max_num_seqs=12, async_scheduling=False)
    assert not settings.small_batch_pdl


def test_settings_name_every_field():
    with pytest.raises(AttributeError):  # the model section has no max_num_seqs: the caller must give it
        RunnerSettings.of(ModelSection(), async_scheduling=None)
    with pytest.raises(TypeError, match="unknown runner settings"):
        RunnerSettings.of(EngineConfig(), max_num_seq=4)
