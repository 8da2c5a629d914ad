"""Fast checks without processes: the service config (defaults < YAML < env < flags, errors
that name the bad key or value), the protos (importable, versioned packages, every field
commented, generated code up to date), the error mapping and the servicer's queue limit."""

from __future__ import annotations

import asyncio
import gc
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from contracts.errors import FailedPrecondition, NotFound, QueueFull, Unavailable, status_code_for
from contracts.service_config import load_config
from tests.services.conftest import REPO

PROTOS = sorted((REPO / "protos").rglob("*.proto"))


# ----------------------------------------------------------------- config
def test_precedence_defaults_yaml_env_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "scheduler:\n  max_waiting: 7\n  metrics_port: 1234\n"
        "kvcache:\n  redis_url: redis://yaml:1/0\nmodel:\n  block_size: 32\n"
    )
    env = {"PICOVLLM_REDIS_URL": "redis://env:2/0", "PICOVLLM_MODEL_ADDR": "127.0.0.1:7001"}
    c = load_config(path, {"model": {"address": "127.0.0.1:7002", "num_gpu_blocks": None}}, env=env)
    assert c.scheduler.max_waiting == 7 and c.scheduler.metrics_port == 1234  # YAML over defaults
    assert c.kvcache.redis_url == "redis://env:2/0"  # env over YAML
    assert c.model.address == "127.0.0.1:7002"  # flags over env
    assert c.model.block_size == 32 and c.model.num_gpu_blocks is None  # a None flag changes nothing
    assert c.kvcache.address.startswith("127.0.0.1:") and c.model.address.startswith("127.0.0.1:")


def test_defaults_keep_internal_services_on_loopback():
    c = load_config(env={})
    assert c.kvcache.address.startswith("127.0.0.1:") and c.model.address.startswith("127.0.0.1:")
    assert c.kvcache.redis_url is None


def test_example_config_loads():
    c = load_config(REPO / "config" / "picovllm.yaml", env={})
    assert c == load_config(env={})  # the example shows the defaults


@pytest.mark.parametrize(
    "text,needle",
    [
        ("model:\n  block_size: 12\n", "model.block_size must be a power of two, got 12"),
        ("kvcache:\n  bogus: 1\n", "unknown key kvcache.bogus"),
        ("nothing:\n  x: 1\n", "unknown section 'nothing'"),
        ("scheduler:\n  address: nohost\n", "scheduler.address must be host:port, got 'nohost'"),
        ("scheduler:\n  preemption_mode: drop\n", "'drop'"),
        ("kvcache:\n  redis_url: http://x\n", "redis:// URL"),
    ],
)
def test_bad_config_names_the_value(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_config(path, env={})


def test_bad_env_value_names_the_variable():
    with pytest.raises(
        ValueError, match=r"\$PICOVLLM_METRICS_PORT: scheduler.metrics_port must be int \| None, got 'lots'"
    ):
        load_config(env={"PICOVLLM_METRICS_PORT": "lots"})


# ----------------------------------------------------------------- protos
def test_generated_modules_import():
    from protos.picovllm.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc  # noqa: F401
    from protos.picovllm.model.v1 import model_pb2, model_pb2_grpc  # noqa: F401
    from protos.picovllm.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: F401

    assert scheduler_pb2.DESCRIPTOR.package == "picovllm.scheduler.v1"
    assert kvcache_pb2.DESCRIPTOR.package == "picovllm.kvcache.v1"
    assert model_pb2.DESCRIPTOR.package == "picovllm.model.v1"


@pytest.mark.parametrize("path", PROTOS, ids=[p.name for p in PROTOS])
def test_every_field_rpc_and_enum_value_is_commented(path):
    lines = path.read_text().splitlines()
    decl = re.compile(
        r"^\s*(?:(?:optional|repeated)\s+)?[\w.]+\s+\w+\s*=\s*\d+;|^\s*rpc\s+\w+|^\s*[A-Z][A-Z0-9_]+\s*=\s*\d+;"
    )
    missing = [
        line.strip() for i, line in enumerate(lines) if decl.match(line) and not lines[i - 1].strip().startswith("//")
    ]
    assert not missing, f"uncommented in {path.name}: {missing}"
    package = re.search(r"^package ([\w.]+);", path.read_text(), re.M).group(1)
    assert package == ".".join(path.relative_to(REPO / "protos").parent.parts)  # directories mirror packages


def test_generated_code_is_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "protos", copy / "protos", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "gen_protos.sh", copy / "scripts")
    subprocess.run(["bash", str(copy / "scripts" / "gen_protos.sh")], check=True, capture_output=True, timeout=60)
    for generated in (REPO / "protos").rglob("*_pb2*.py*"):
        fresh = copy / generated.relative_to(REPO)
        assert fresh.read_text() == generated.read_text(), f"{generated.name} is stale: run scripts/gen_protos.sh"


# ----------------------------------------------------------------- errors
def test_domain_errors_map_to_status_codes():
    assert status_code_for(ValueError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code_for(QueueFull("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code_for(NotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_code_for(Unavailable("x")) == grpc.StatusCode.UNAVAILABLE
    assert status_code_for(FailedPrecondition("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_code_for(RuntimeError("x")) == grpc.StatusCode.INTERNAL


def test_full_queue_is_resource_exhausted_through_the_interceptor():
    """A real aio server with a servicer whose queue is full (no engine needed)."""
    from contracts.rpc import start_server
    from contracts.service_config import SchedulerSection
    from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
    from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
    from scheduler_svc.engine_wire import EngineStats
    from scheduler_svc.server import SERVICE_NAME, SchedulerServicer

    class _LLM:  # an engine client with nothing running
        stats = EngineStats()

        async def start(self) -> None:
            pass

    async def main() -> grpc.StatusCode:
        servicer = SchedulerServicer(SchedulerSection(max_waiting=2))
        servicer.llm = _LLM()
        servicer.active = {"a", "b"}
        running = await start_server(
            "127.0.0.1:0", [(pb_grpc.add_SchedulerServiceServicer_to_server, servicer, SERVICE_NAME)]
        )
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as ch:
                call = pb_grpc.SchedulerServiceStub(ch).Generate(pb.GenerateRequest(text="hi"), timeout=10)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as err:
                    return err.code()
        finally:
            await running.server.stop(None)
            del running
            gc.collect()  # collect the aio server while its loop is alive
        return grpc.StatusCode.OK

    assert asyncio.run(main()) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_protos_directory_is_a_package():
    for d in {p.parent for p in PROTOS} | {REPO / "protos"}:
        while d != REPO:
            assert (d / "__init__.py").is_file(), d
            d = d.parent
    assert Path(REPO / "scripts" / "gen_protos.sh").is_file()


# ----------------------------------------------------------------- health
def test_health_check_follows_the_servicer():
    """`check` (used by clients and tests) reads what the servers' grpc_health servicer says."""
    grpc_health = pytest.importorskip("grpc_health.v1.health")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from contracts import health

    async def main() -> list:
        seen = []
        for servicer in (grpc_health.aio.HealthServicer(),):
            server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await servicer.set("svc", health.NOT_SERVING)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"), timeout=10)
                seen.append((await watch.read()).status)
                await servicer.set("svc", health.SERVING)
                seen.append((await watch.read()).status)
                seen.append((await stub.Check(health_pb2.HealthCheckRequest(service="svc"), timeout=5)).status)
                watch.cancel()
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                seen.append(await asyncio.to_thread(health.check, ch, "svc", 5.0))
            await server.stop(None)
        del server
        gc.collect()  # collect the aio servers while their loop is alive
        return seen

    assert asyncio.run(main()) == [health.NOT_SERVING, health.SERVING, health.SERVING, health.SERVING]
