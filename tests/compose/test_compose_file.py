"""The compose file is not decoration: without Docker, parse it, check the deployment rules it
promises, then start each service's command with the file's environment as local processes
(Redis from the machine, hostnames mapped to loopback ports), wait for the file's own
healthchecks, and make a gRPC call through the scheduler."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.services.conftest import REPO, free_port, wait_for

COMPOSE = REPO / "compose" / "docker-compose.yml"
PASSWORD = "test-password"


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} substitution."""
    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(3) or ""
        return env.get(name) or default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", sub, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_deployment_rules(compose):
    services = compose["services"]
    assert set(services) >= {"redis", "kvcache", "model", "model-cpu", "scheduler"}
    # Only the scheduler publishes ports: its gRPC endpoint and metrics.
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"scheduler"}
    assert {p.split(":")[-1] for p in services["scheduler"]["ports"]} == {"50051", "9400"}
    # Redis: a password and append-only persistence on a volume.
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--requirepass" in redis_cmd and "--appendonly yes" in redis_cmd
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"]) and "redis-data" in compose["volumes"]
    # The model service reserves an NVIDIA GPU; the cpu profile runs without one.
    devices = services["model"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert services["model-cpu"]["profiles"] == ["cpu"] and "deploy" not in services["model-cpu"]
    # Health-gated start order, healthchecks on every service, model directory read-only.
    for name in ("kvcache", "model", "model-cpu", "scheduler", "redis"):
        assert services[name]["healthcheck"]["test"], name
    assert all(dep["condition"] == "service_healthy" for dep in services["scheduler"]["depends_on"].values())
    assert services["kvcache"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("model", "model-cpu"):
        assert all(v.endswith(":ro") for v in services[name]["volumes"])


def test_services_start_from_the_file_and_answer(compose, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    services = compose["services"]
    ports = {"scheduler": free_port(), "kvcache": free_port(), "model": free_port(), "redis": free_port(), "metrics": free_port()}
    host_env = {"REDIS_PASSWORD": PASSWORD}

    def local(value: str) -> str:
        """Compose hostnames -> loopback ports; container paths -> this checkout."""
        value = _interpolate(value, host_env)
        value = value.replace("@redis:6379", f"@127.0.0.1:{ports['redis']}")
        for name in ("scheduler", "kvcache", "model"):
            value = re.sub(rf"(^|[^\w-]){name}:\d+", lambda m, n=name: f"{m.group(1)}127.0.0.1:{ports[n]}", value)
        return value.replace("/models/model", str(REPO / "model_svc" / "bundled" / "stories260k"))

    env_common = {k: local(str(v)) for k, v in services["scheduler"]["environment"].items()}
    env_common["PICOVLLM_METRICS_PORT"] = str(ports["metrics"])
    redis_cmd = [local(a) for a in services["redis"]["command"]]
    redis = subprocess.Popen([*redis_cmd, "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    procs = [redis]
    try:
        import redis as redis_py

        client = redis_py.Redis(port=ports["redis"], password=PASSWORD, socket_timeout=2)
        wait_for(lambda: _ping(client), 10, "redis from the compose command", redis)
        for name, kind in (("kvcache", "kvcache"), ("model-cpu", "model"), ("scheduler", "scheduler")):
            argv = [local(a) for a in services[name]["command"]]
            # Inside a container the service listens on 0.0.0.0:<its port>; here on loopback.
            argv = [re.sub(r"0\.0\.0\.0:\d+", f"127.0.0.1:{ports[kind]}", a) for a in argv]
            env = {**os.environ, **env_common, "PYTHONPATH": str(REPO)}
            log = open(tmp_path / f"{name}.log", "w")
            proc = subprocess.Popen([sys.executable, "-m", "scheduler_svc.cli", *argv, "--torch-threads", "1"] if kind == "model" else
                                    [sys.executable, "-m", "scheduler_svc.cli", *argv], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
            procs.append(proc)
            check = [local(a) for a in services[name]["healthcheck"]["test"][1:]]
            check = [sys.executable if a == "python" else a for a in check]
            wait_for(lambda c=check, e=env: subprocess.run(c, env=e, capture_output=True, timeout=10).returncode == 0, 120,
                     f"{name} healthcheck from the compose file", proc)
        from scheduler_svc.client import Client

        with Client(f"127.0.0.1:{ports['scheduler']}", timeout=60) as c:
            text, ids, last = c.complete("Once upon a time", max_tokens=12, temperature=0)
        assert len(ids) == 12 and text.startswith(", there was a little girl")
        assert client.keys("picovllm:compose:*"), "the KV-cache service wrote no metadata to the compose Redis"
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait(timeout=10)


def _ping(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False
