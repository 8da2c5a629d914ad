"""Fixtures for the service tests: free ports, a throwaway redis-server, and real service
processes that are always killed in teardown. Every wait here is bounded."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not ready after {timeout:.0f} s")


class RedisServer:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = open(tmp / f"redis-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp,
        )
        import redis

        self.client = redis.Redis(port=self.port, socket_timeout=2)

        def up() -> bool:
            try:
                return bool(self.client.ping())
            except redis.RedisError:
                return False

        wait_for(up, 10, "redis-server", self.proc)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip("redis-py is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def deployment() -> str:
    """A fresh key namespace per test (the Redis server is shared)."""
    return "t" + uuid.uuid4().hex[:10]


class ServiceProcess:
    """One `picovllm serve <kind>` process with its log in a file."""

    def __init__(self, kind: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.kind, self.args, self.log_dir = kind, args, log_dir
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.log_path = self.log_dir / f"{self.kind}-{uuid.uuid4().hex[:6]}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "scheduler_svc.cli", "-v", "serve", self.kind, *self.args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()

    def terminate(self, timeout: float = 30) -> int:
        assert self.proc is not None
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""
