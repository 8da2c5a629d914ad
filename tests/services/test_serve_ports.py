"""Ports as an operator meets them: a second `picovllm serve all` on the ports of a running
one is refused in one line naming the port (gRPC on Linux would otherwise share them through
SO_REUSEPORT) and the first keeps serving; a service says in one line when it is ready and
where it listens; `picovllm client --wait-ready` waits for the scheduler's health."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from contracts.health import check_health
from scheduler_svc.client import Client
from tests.services.conftest import INTERNAL_TOKEN, REPO, ServiceProcess, Stack, free_port, wait_for

ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    "PICOVLLM_INTERNAL_TOKEN": INTERNAL_TOKEN,
}


def serve_args(addr: dict[str, str], metrics_port: int) -> list[str]:
    return [
        "--scheduler-addr",
        addr["scheduler"],
        "--kvcache-addr",
        addr["kvcache"],
        "--model-addr",
        addr["model"],
        "--metrics-port",
        str(metrics_port),
        "--device",
        "cpu",
        "--torch-threads",
        "1",
        "--num-gpu-blocks",
        "64",
        "--num-cpu-blocks",
        "16",
        "--port",
        str(free_port()),
    ]  # the HTTP gateway's


def run_cli(*argv: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler_svc.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=ENV,
    )
    return proc, time.monotonic() - t


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A running `picovllm serve all`: its addresses, metrics port and process."""
    addr = {k: f"127.0.0.1:{free_port()}" for k in ("scheduler", "kvcache", "model")}
    metrics_port = free_port()
    proc = ServiceProcess("all", serve_args(addr, metrics_port), tmp_path_factory.mktemp("first"))
    try:
        wait_for(lambda: check_health(addr["scheduler"], timeout=0.5), 120, "serve all", proc.proc)
        yield addr, metrics_port, proc
    finally:
        proc.kill()


def assert_still_serving(addr: dict[str, str]) -> None:
    assert all(check_health(a, timeout=2) for a in addr.values())
    with Client(addr["scheduler"], timeout=60) as c:
        text, ids, _ = c.complete("Once upon a time", temperature=0.0, max_tokens=8)
    assert len(ids) == 8 and text.startswith(", there was")


def test_serve_all_announces_every_address_once_ready(first):
    addr, metrics_port, proc = first
    wait_for(lambda: "ready:" in proc.tail(), 10, "the readiness line")
    line = next(x for x in proc.tail(200).splitlines() if x.startswith("picovllm: ready:"))
    for address in (*addr.values(), f"http://127.0.0.1:{metrics_port}/metrics"):
        assert address in line
    assert (
        sum("service ready" in x for x in proc.tail(200).splitlines()) == 0
    )  # the children stay quiet under serve all


@pytest.mark.parametrize("clash", ["all ports", "gRPC ports only", "metrics port only"])
def test_second_serve_all_is_refused_in_one_line(first, clash):
    addr, metrics_port, _ = first
    mine = {k: f"127.0.0.1:{free_port()}" for k in addr}
    if clash == "all ports":
        second, port = serve_args(addr, metrics_port), addr["scheduler"]
    elif clash == "gRPC ports only":
        second, port = serve_args(addr, free_port()), addr["scheduler"]
    else:
        second, port = serve_args(mine, metrics_port), f"127.0.0.1:{metrics_port}"
    proc, seconds = run_cli("serve", "all", *second)
    line = one_line(proc)
    assert proc.returncode != 0 and seconds < 10
    what = " (metrics)" if "metrics" in clash else ""
    assert line == f"picovllm: error: cannot listen on {port}{what}: address already in use"
    assert_still_serving(addr)


def test_one_service_on_a_taken_port_is_one_line(first):
    addr, metrics_port, _ = first
    proc, _ = run_cli("serve", "scheduler", "--scheduler-addr", addr["scheduler"], "--metrics-port", "0")
    assert proc.returncode == 2
    assert one_line(proc) == f"picovllm: error: cannot listen on {addr['scheduler']}: address already in use"
    mine = f"127.0.0.1:{free_port()}"
    proc, _ = run_cli("serve", "scheduler", "--scheduler-addr", mine, "--metrics-port", str(metrics_port))
    assert proc.returncode == 2
    assert (
        one_line(proc)
        == f"picovllm: error: cannot listen on 127.0.0.1:{metrics_port} (metrics): address already in use"
    )
    assert not check_health(mine, timeout=0.3)  # its gRPC server went down with it
    with socket.socket() as held:  # a port held by another program
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        proc, _ = run_cli("serve", "kvcache", "--kvcache-addr", taken)
    assert (
        proc.returncode == 2 and one_line(proc) == f"picovllm: error: cannot listen on {taken}: address already in use"
    )
    assert_still_serving(addr)


def test_client_wait_ready(first):
    addr, _, _ = first
    proc, _ = run_cli("client", "--wait-ready", "30", "--addr", addr["scheduler"])
    assert proc.returncode == 0, proc.stderr
    proc, _ = run_cli(
        "client", "Once upon a time", "--max-tokens", "4", "--wait-ready", "30", "--addr", addr["scheduler"]
    )
    assert proc.returncode == 0 and proc.stdout.startswith("Once upon a time, there"), proc.stderr
    nothing = f"127.0.0.1:{free_port()}"
    proc, seconds = run_cli("client", "--wait-ready", "1", "--addr", nothing)
    assert proc.returncode == 1 and seconds < 30
    assert one_line(proc) == f"picovllm: error: the scheduler at {nothing} is not ready after 1 s"
    proc, _ = run_cli("client", "Once upon a time", "--addr", nothing)  # no wait: one line that says what to do
    assert (
        proc.returncode == 1
        and proc.stdout == ""
        and "is unavailable" in one_line(proc)
        and "--wait-ready" in proc.stderr
    )


def test_serve_all_stops_when_a_child_fails_at_start_up(tmp_path):
    """The ports are free when serve all checks them, but the kvcache and model services are
    given the same one: the second of the two to bind fails, and serve all stops the rest."""
    shared = f"127.0.0.1:{free_port()}"
    addr = {"scheduler": f"127.0.0.1:{free_port()}", "kvcache": shared, "model": shared}
    proc, seconds = run_cli("serve", "all", *serve_args(addr, 0))
    assert proc.returncode == 2
    # A slow machine may let the scheduler reach the service that did bind (the wrong one for
    # it) before serve all stops it: its own one-line error may come too, never a traceback.
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and all(line.startswith("picovllm: error: ") for line in lines), lines
    assert f"picovllm: error: cannot listen on {shared}: address already in use" in lines
    # The child's own start (imports, torch) is in this time, on a machine shared with other
    # tests; serve all itself notices the exit within a fraction of a second.
    assert seconds < 30
    time.sleep(0.5)
    assert not any(check_health(a, timeout=0.3) for a in addr.values())  # nothing left running


def test_each_service_announces_its_addresses(tmp_path):
    stack = Stack(tmp_path)
    try:
        pattern = {
            "kvcache": rf"picovllm: kvcache service ready: gRPC {stack.addr['kvcache']} \(store: memory\)",
            "model": rf"picovllm: model service ready: gRPC {stack.addr['model']} \(LlamaForCausalLM, cpu\)",
            "scheduler": rf"picovllm: scheduler service ready: gRPC {stack.addr['scheduler']}, "
            rf"metrics http://127\.0\.0\.1:{stack.metrics_port}/metrics",
        }
        for kind, proc in stack.procs.items():  # health says SERVING a moment before the line
            wait_for(lambda k=kind, p=proc: re.search(pattern[k], p.tail(200)), 10, f"the {kind} readiness line")
    finally:
        stack.close()
