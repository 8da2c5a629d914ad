"""Bounded waits and honest health (real processes on loopback): a frozen model service
(SIGSTOP: it neither answers nor refuses) turns the scheduler's health NOT_SERVING within 5 s
and SERVING again after SIGCONT; a request without a client deadline, in flight or sent
during the outage, ends with UNAVAILABLE once the configured dependency timeout has passed,
and what the client is told names no internal address. A Redis outage does the same through
the KV-cache service's health, and no Redis error text reaches the client."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import grpc
import pytest

from contracts.health import check_health
from tests.services.conftest import Stack, free_port, wait_for

DEPENDENCY_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(
        tmp_path_factory.mktemp("svc-peer-health"), scheduler_args=["--dependency-timeout", str(DEPENDENCY_TIMEOUT_S)]
    )
    yield s
    s.close()


def _request(stack: Stack, result: dict, started: threading.Event | None = None, max_tokens: int = 100000) -> None:
    """One Generate without a client deadline; the status it ends with goes in `result`."""
    with stack.client(timeout=None) as c:
        try:
            for _ in c.generate("Once upon a time", temperature=0.0, max_tokens=max_tokens, ignore_eos=True):
                if started is not None:
                    started.set()
        except grpc.RpcError as err:
            result.update(code=err.code(), details=err.details())
        result["ended"] = time.monotonic()


def test_frozen_model_service(stack):
    scheduler, model = stack.addr["scheduler"], stack.procs["model"].proc.pid
    assert check_health(scheduler, timeout=2)
    in_flight: dict = {}
    started = threading.Event()
    first = threading.Thread(target=_request, args=(stack, in_flight, started), daemon=True)
    first.start()
    assert started.wait(30)
    os.kill(model, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(lambda: not check_health(scheduler, timeout=0.5), 5, "scheduler NOT_SERVING after the model froze")
        # Sent during the outage, before the dependency timeout: admitted, then it ends too.
        during: dict = {}
        sent = time.monotonic()
        second = threading.Thread(target=_request, args=(stack, during, None, 8), daemon=True)
        second.start()
        for t in (first, second):
            t.join(DEPENDENCY_TIMEOUT_S + 5)
            assert not t.is_alive(), "a request kept waiting on the frozen model service"
        assert in_flight["code"] == during["code"] == grpc.StatusCode.UNAVAILABLE
        assert in_flight["ended"] - stopped < DEPENDENCY_TIMEOUT_S + 3
        assert during["ended"] - sent < DEPENDENCY_TIMEOUT_S + 1.5
        # Past the timeout a new request is refused at once.
        late: dict = {}
        sent = time.monotonic()
        _request(stack, late, None, 8)
        assert late["code"] == grpc.StatusCode.UNAVAILABLE and late["ended"] - sent < 1.0
        for details in (in_flight["details"], during["details"], late["details"]):
            assert "127.0.0.1" not in details and stack.addr["model"] not in details, details
    finally:
        os.kill(model, signal.SIGCONT)
    wait_for(lambda: check_health(scheduler, timeout=0.5), 30, "scheduler SERVING after the model thawed")
    with stack.client(timeout=60) as c:
        text, ids, _ = c.complete("Once upon a time", max_tokens=8, temperature=0.0)
    assert len(ids) == 8 and text.startswith(", there was")
    stack.wait_kv_clean(timeout=30)


def _redis(port: int, tmp) -> subprocess.Popen:
    return subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        cwd=tmp,
    )


def test_redis_outage(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    redis = _redis(port, tmp_path)
    stack = None
    try:
        stack = Stack(
            tmp_path,
            redis_url=f"redis://127.0.0.1:{port}/0",
            deployment="outage",
            scheduler_args=["--dependency-timeout", str(DEPENDENCY_TIMEOUT_S)],
        )
        redis.kill()
        redis.wait(timeout=10)
        wait_for(lambda: not check_health(stack.addr["kvcache"], timeout=0.5), 5, "kvcache NOT_SERVING without Redis")
        wait_for(
            lambda: not check_health(stack.addr["scheduler"], timeout=0.5), 5, "scheduler NOT_SERVING without Redis"
        )
        outage: dict = {}
        sent = time.monotonic()
        _request(stack, outage, None, 8)
        assert outage["code"] == grpc.StatusCode.UNAVAILABLE and outage["ended"] - sent < DEPENDENCY_TIMEOUT_S + 1.5
        assert "redis" not in outage["details"].lower() and "127.0.0.1" not in outage["details"], outage["details"]
        redis = _redis(port, tmp_path)  # back, empty: the scheduler resets the pools
        wait_for(lambda: check_health(stack.addr["scheduler"], timeout=0.5), 30, "scheduler SERVING with Redis back")
        with stack.client(timeout=60) as c:
            text, ids, _ = c.complete("Once upon a time", max_tokens=8, temperature=0.0)
        assert len(ids) == 8 and text.startswith(", there was")
    finally:
        if stack is not None:
            stack.close()
        redis.kill()
        redis.wait(timeout=10)
