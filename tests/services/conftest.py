"""Fixtures for the service tests: free ports, a throwaway redis-server, and real service
processes that are always killed in teardown. Every wait here is bounded."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.rpc import free_port

REPO = Path(__file__).resolve().parents[2]
# The internal token every service process of the tests gets through its environment.
INTERNAL_TOKEN = "test-token-" + uuid.uuid4().hex
TOKEN_METADATA = (("authorization", f"Bearer {INTERNAL_TOKEN}"),)


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
        with open(tmp / f"redis-{self.port}.log", "w") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp,
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
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            "PICOVLLM_INTERNAL_TOKEN": INTERNAL_TOKEN,
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.log_path = self.log_dir / f"{self.kind}-{uuid.uuid4().hex[:6]}.log"
        # A session of its own: kill() takes the children of `serve all` along.
        with open(self.log_path, "w") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "scheduler_svc.cli", "-v", "serve", self.kind, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL to the process and everything it started."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

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


class Stack:
    """kvcache + model + scheduler processes on free loopback ports."""

    def __init__(
        self,
        log_dir: Path,
        redis_url: str | None = None,
        deployment: str | None = None,
        scheduler_args: list[str] | None = None,
        model_args: list[str] | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.addr = {k: f"127.0.0.1:{free_port()}" for k in ("scheduler", "kvcache", "model")}
        self.metrics_port = free_port()
        common = [
            "--scheduler-addr",
            self.addr["scheduler"],
            "--kvcache-addr",
            self.addr["kvcache"],
            "--model-addr",
            self.addr["model"],
        ]
        kv_args = (
            common
            + (["--redis-url", redis_url] if redis_url else [])
            + (["--deployment", deployment] if deployment else [])
        )
        self.args = {
            "kvcache": kv_args,
            "model": common
            + ["--device", "cpu", "--torch-threads", "1", "--num-gpu-blocks", "256", "--num-cpu-blocks", "64"]
            + (model_args or []),
            "scheduler": common + ["--metrics-port", str(self.metrics_port)] + (scheduler_args or []),
        }
        self.procs: dict[str, ServiceProcess] = {}
        try:
            for kind in ("kvcache", "model", "scheduler"):
                self.procs[kind] = ServiceProcess(kind, self.args[kind], log_dir)
            for kind in ("kvcache", "model", "scheduler"):
                self.wait_ready(kind)
        except BaseException:
            self.close()
            raise

    def wait_ready(self, kind: str, timeout: float = 120) -> None:
        from contracts.health import check_health

        proc = self.procs[kind]
        try:
            wait_for(lambda: check_health(self.addr[kind], timeout=0.5), timeout, f"{kind} service", proc.proc)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{exc}\n--- {kind} log ---\n{proc.tail()}") from None

    def kill(self, kind: str) -> None:
        self.procs[kind].kill()

    def restart(self, kind: str, wait: bool = True) -> None:
        self.procs[kind].kill()
        self.procs[kind] = ServiceProcess(kind, self.args[kind], self.log_dir)
        if wait:
            self.wait_ready(kind)

    def client(self, timeout: float | None = 60):
        from scheduler_svc.client import Client

        return Client(self.addr["scheduler"], timeout=timeout)

    def kv_info(self):
        import grpc

        from protos.picovllm.kvcache.v1 import kvcache_pb2 as pb
        from protos.picovllm.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

        with grpc.insecure_channel(self.addr["kvcache"]) as ch:
            stub = pb_grpc.KVCacheServiceStub(ch)
            check = stub.CheckInvariants(pb.CheckInvariantsRequest(), timeout=10, metadata=TOKEN_METADATA)
            info = stub.GetInfo(pb.GetInfoRequest(), timeout=10, metadata=TOKEN_METADATA)
        return check, info

    def wait_kv_clean(self, timeout: float = 20):
        """Every block free or cached and the invariant holding, in the KV-cache service."""
        result = {}

        def clean() -> bool:
            check, info = self.kv_info()
            result.update(check=check, info=info)
            return check.ok and info.all_free_or_cached and info.num_seqs == 0

        try:
            wait_for(clean, timeout, "KV-cache blocks freed")
        except TimeoutError:
            raise AssertionError(f"KV-cache not clean: {result}") from None
        return result["info"]

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()


def generate_all(
    stack: Stack, prompts: list, timeout: float = 60, concurrent: bool = False, **sampling
) -> list[tuple[list[int], str, int]]:
    """(token ids, text, finish reason) per prompt, one request at a time or all at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt):
        with stack.client(timeout) as c:
            text, ids, last = c.complete(prompt, **sampling)
        return ids, text, last.finish_reason

    if not concurrent:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park.",
    "One day, a little dog named Max",
    # Longer than a block, sharing a prefix (prefix cache hits in both modes).
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her friends",
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her cat",
    [1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 414, 415, 416, 417],  # token ids
]
FINISH = {"stop": 1, "length": 2, "abort": 3}


@pytest.fixture(scope="session")
def embedded():
    """Embedded mode with the services' pool sizes: the reference for every parity check."""
    import torch

    from scheduler_svc import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(num_gpu_blocks=256, num_cpu_blocks=64, device="cpu")

    def run(prompts: list, **sampling) -> list[tuple[list[int], str, int]]:
        outs = [llm.generate([p], SamplingParams(**sampling))[0] for p in prompts]
        return [(o.token_ids, o.text, FINISH[o.finish_reason]) for o in outs]

    return run
