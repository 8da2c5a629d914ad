"""The compose file is not decoration: without Docker, parse it, check the deployment rules it
promises (ports on the host's loopback, required secrets that never reach a command line, a
non-root image), then start each service's command with the file's environment as local
processes (Redis from the machine, hostnames mapped to loopback ports), wait for the file's
own healthchecks, and make a gRPC call through the scheduler."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from tests.services.conftest import REPO, free_port, wait_for

COMPOSE = REPO / "compose" / "docker-compose.yml"
DOCKERFILE = REPO / "compose" / "Dockerfile"
PASSWORD = "test-password-" + "x" * 8
SECRETS = {
    "REDIS_PASSWORD": PASSWORD,
    "PICOVLLM_INTERNAL_TOKEN": "compose-test-token-0123456789",
    "PICOVLLM_API_KEY": "compose-test-api-key-0123456789",
}
PICOVLLM = ("kvcache", "model", "model-cpu", "scheduler")


class Unset(KeyError):
    """${VAR:?message} with VAR unset: compose refuses to start."""


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's $$, ${VAR}, ${VAR:-default} and ${VAR:?error} substitution."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if op == ":?" and not env.get(name):
            raise Unset(f"{name}: {arg}")
        return env.get(name) or (arg if op == ":-" else "")

    return re.sub(r"\$\$|\$\{(\w+)(?:(:[-?])([^}]*))?\}", sub, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_deployment_rules(compose):
    services = compose["services"]
    assert set(services) >= {"redis", "kvcache", "model", "model-cpu", "scheduler", "http"}
    # Only the scheduler (its gRPC endpoint and metrics), the HTTP gateway and the router publish ports.
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"scheduler", "http", "router"}
    assert {p.split(":")[-1] for p in services["router"]["ports"]} == {"50050", "9410"}
    assert {p.split(":")[-1] for p in services["scheduler"]["ports"]} == {"50051", "9400"}
    assert [p.split(":")[-1] for p in services["http"]["ports"]] == ["8000"]
    assert all(
        p.startswith("127.0.0.1:") for name in published for p in services[name]["ports"]
    )  # the host's loopback only
    # Redis: a password and append-only persistence on a volume.
    redis_cmd = " ".join(services["redis"]["command"])
    assert "requirepass" in redis_cmd and "--appendonly yes" in redis_cmd
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"]) and "redis-data" in compose["volumes"]
    # The model service reserves an NVIDIA GPU; the cpu profile runs without one.
    devices = services["model"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert services["model-cpu"]["profiles"] == ["cpu"] and "deploy" not in services["model-cpu"]
    # Health-gated start order, healthchecks on every service, model directory read-only.
    for name in ("kvcache", "model", "model-cpu", "scheduler", "redis", "http"):
        assert services[name]["healthcheck"]["test"], name
    assert all(dep["condition"] == "service_healthy" for dep in services["scheduler"]["depends_on"].values())
    assert services["http"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert services["kvcache"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("model", "model-cpu", "http"):
        assert all(v.endswith(":ro") for v in services[name]["volumes"])


def test_fleet_profiles_put_two_replicas_behind_the_router(compose):
    services = compose["services"]
    for profile, suffix in (("fleet", ""), ("fleet-cpu", "-cpu")):
        replicas = [f"replica-{i}{suffix}" for i in (1, 2)]
        assert all(services[r]["profiles"] == [profile] for r in replicas)
        assert profile in services["router"]["profiles"]
        ids = set()
        for r in replicas:
            svc = services[r]
            assert svc["command"][:2] == ["serve", "all"] and "--publish-prefixes" in svc["command"]
            assert svc["environment"]["PICOVLLM_SCHEDULER_ADDR"].endswith(":50051")
            assert "@redis:6379" in svc["environment"]["PICOVLLM_REDIS_URL"]
            assert "PICOVLLM_INTERNAL_TOKEN" not in svc["environment"]  # its own, made by serve all
            ids.add(svc["environment"]["PICOVLLM_DEPLOYMENT"])
        assert ids == {"replica-1", "replica-2"}  # one prefix index each
    assert [
        services[f"replica-{i}"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for i in (1, 2)
    ] == [["0"], ["1"]]
    assert all("deploy" not in services[f"replica-{i}-cpu"] for i in (1, 2))
    assert [services[f"replica-{i}-cpu"]["networks"]["default"]["aliases"] for i in (1, 2)] == [
        ["replica-1"],
        ["replica-2"],
    ]
    router = services["router"]
    assert router["command"][:2] == ["serve", "router"]
    assert router["environment"]["PICOVLLM_REPLICAS"] == "replica-1:50051,replica-2:50051"
    # The router calls only the public API: the API key and the index's Redis, no internal token.
    assert set(router["environment"]) & {"PICOVLLM_API_KEY", "PICOVLLM_INTERNAL_TOKEN", "PICOVLLM_REDIS_URL"} == {
        "PICOVLLM_API_KEY",
        "PICOVLLM_REDIS_URL",
    }


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _strings(v)]
    if isinstance(value, list):
        return [x for v in value for x in _strings(v)]
    return []


def test_secrets_are_required_and_never_on_a_command_line(compose):
    services = compose["services"]
    text = COMPOSE.read_text()
    assert "change-me" not in text  # no silent fallback password
    # Without REDIS_PASSWORD (or the internal token) the file does not interpolate: compose refuses to start.
    for missing in ("REDIS_PASSWORD", "PICOVLLM_INTERNAL_TOKEN"):
        env = {k: v for k, v in SECRETS.items() if k != missing}
        with pytest.raises(Unset, match=missing):
            [_interpolate(x, env) for svc in services.values() for x in _strings(svc)]
    # Commands and healthchecks carry no secret: interpolated, none of the values shows up.
    for name, svc in services.items():
        argv = _strings(svc.get("command")) + _strings(svc.get("healthcheck", {}).get("test"))
        for arg in argv:
            resolved = _interpolate(arg, SECRETS)
            assert not any(secret in resolved for secret in SECRETS.values()), (name, arg)
        assert "--requirepass" not in argv and "-a" not in " ".join(argv).split(), name
    # Each container gets only the secrets it needs.
    for name in PICOVLLM:
        env = services[name]["environment"]
        assert "PICOVLLM_INTERNAL_TOKEN" in env, name
        assert ("PICOVLLM_REDIS_URL" in env) == (name == "kvcache"), name
        assert ("PICOVLLM_API_KEY" in env) == (name == "scheduler"), name
    assert "REDIS_PASSWORD" in services["redis"]["environment"]
    # The HTTP gateway calls only the public API: the API key, neither the token nor Redis.
    assert set(services["http"]["environment"]) & {
        "PICOVLLM_API_KEY",
        "PICOVLLM_INTERNAL_TOKEN",
        "PICOVLLM_REDIS_URL",
    } == {"PICOVLLM_API_KEY"}


def test_image_runs_as_a_non_root_user():
    users = [line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("USER ")]
    assert users, "the Dockerfile sets no USER: the services would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_image_holds_every_package_of_the_distribution():
    """`pip install .` in the image installs what it finds: a package the Dockerfile does not
    copy is missing from the image (the fleet profile's router ran `serve router` there)."""
    find = re.search(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[(.*)\]", (REPO / "pyproject.toml").read_text())
    packages = set(re.findall(r'"(\w+)\*"', find.group(1)))
    assert "model_svc" in packages, find.group(0)
    copied = {line.split()[1] for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ")}
    assert packages <= copied, sorted(packages - copied)


def test_services_start_from_the_file_and_answer(compose, tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    services = compose["services"]
    ports = {
        "scheduler": free_port(),
        "kvcache": free_port(),
        "model": free_port(),
        "redis": free_port(),
        "metrics": free_port(),
        "http": free_port(),
    }
    host_env = SECRETS

    def local(value: str) -> str:
        """Compose hostnames -> loopback ports; container paths -> this checkout."""
        value = _interpolate(value, host_env)
        value = value.replace("@redis:6379", f"@127.0.0.1:{ports['redis']}")
        for name in ("scheduler", "kvcache", "model", "http"):
            value = re.sub(rf"(^|[^\w-]){name}:\d+", lambda m, n=name: f"{m.group(1)}127.0.0.1:{ports[n]}", value)
        return value.replace("/models/model", str(REPO / "model_svc" / "bundled" / "stories260k"))

    def environment(name: str) -> dict[str, str]:
        """The service's own environment from the file, on top of this one's without PICOVLLM_*."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PICOVLLM_")}
        env.update({k: local(str(v)) for k, v in services[name]["environment"].items()})
        return {**env, "PICOVLLM_METRICS_PORT": str(ports["metrics"]), "PYTHONPATH": str(REPO)}

    redis_cmd = [local(a) for a in services["redis"]["command"]]
    redis = subprocess.Popen(
        [*redis_cmd, "--port", str(ports["redis"]), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=environment("redis"),
    )
    procs = [redis]
    try:
        import redis as redis_py

        client = redis_py.Redis(port=ports["redis"], password=PASSWORD, socket_timeout=2)
        wait_for(lambda: _ping(client), 10, "redis from the compose command", redis)
        for name, kind in (
            ("kvcache", "kvcache"),
            ("model-cpu", "model"),
            ("scheduler", "scheduler"),
            ("http", "http"),
        ):
            argv = [local(a) for a in services[name]["command"]]
            # Inside a container the service listens on 0.0.0.0:<its port>; here on loopback.
            argv = [re.sub(r"0\.0\.0\.0:\d+", f"127.0.0.1:{ports[kind]}", a) for a in argv]
            if kind == "http":  # --host 0.0.0.0 --port 8000
                argv = [{"0.0.0.0": "127.0.0.1", "8000": str(ports["http"])}.get(a, a) for a in argv]
            env = environment(name)
            with open(tmp_path / f"{name}.log", "w") as log:  # the child keeps its own copy
                proc = subprocess.Popen(
                    [sys.executable, "-m", "scheduler_svc.cli", *argv, "--torch-threads", "1"]
                    if kind == "model"
                    else [sys.executable, "-m", "scheduler_svc.cli", *argv],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp_path,
                )
            procs.append(proc)
            check = [local(a) for a in services[name]["healthcheck"]["test"][1:]]
            check = [sys.executable if a == "python" else a for a in check]
            try:
                wait_for(
                    lambda c=check, e=env: subprocess.run(c, env=e, capture_output=True, timeout=10).returncode == 0,
                    120,
                    f"{name} healthcheck from the compose file",
                    proc,
                )
            except RuntimeError as exc:  # say why the service stopped: its own last lines
                log_tail = (tmp_path / f"{name}.log").read_text()[-3000:]
                raise RuntimeError(f"{exc}; its log ends:\n{log_tail}") from None
        from scheduler_svc.client import Client

        with Client(f"127.0.0.1:{ports['scheduler']}", timeout=60, api_key=SECRETS["PICOVLLM_API_KEY"]) as c:
            text, ids, last = c.complete("Once upon a time", max_tokens=12, temperature=0)
        assert len(ids) == 12 and text.startswith(", there was a little girl")
        assert client.keys("picovllm:compose:*"), "the KV-cache service wrote no metadata to the compose Redis"
        # The file's API key is required.
        with (
            Client(f"127.0.0.1:{ports['scheduler']}", timeout=10, api_key="") as c,
            pytest.raises(grpc.RpcError) as refused,
        ):
            c.complete("Once upon a time", max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        import openai  # the gateway, with the file's API key

        gateway = openai.OpenAI(
            base_url=f"http://127.0.0.1:{ports['http']}/v1", api_key=SECRETS["PICOVLLM_API_KEY"], max_retries=0
        )
        assert [m.id for m in gateway.models.list().data] == ["model"]  # SERVED_MODEL_NAME's default
        reply = gateway.completions.create(model="model", prompt="Once upon a time", max_tokens=12, temperature=0)
        assert reply.choices[0].text == text
        for proc in procs:  # redis-server included: its password came on stdin
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
            assert not any(secret in cmdline for secret in SECRETS.values()), cmdline
    finally:
        for proc in reversed(procs):
            proc.kill()
            proc.wait(timeout=10)


def _ping(client) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False
