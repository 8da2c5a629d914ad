"""A tensor-parallel model service (two ranks, gloo on the CPU): the same greedy tokens as
embedded mode; kill -9 of rank 1 mid-generation ends the model service with a clear error
(its process exits, its other rank with it) and, once restarted, every request completes
with the undisturbed tokens (recomputed, as after any model-service crash); a kill -9 of
the model service itself leaves no rank process behind, and SIGTERM stops its ranks."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from model_svc.server import RANK_LOST_EXIT_CODE
from tests.services.conftest import PROMPTS, ServiceProcess, Stack, free_port, generate_all, wait_for
from tests.services.test_service_failures import LONG, STREAM_PROMPTS, Streams


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # A restart starts two interpreters (two ranks) on a busy CI machine: the scheduler waits longer.
    s = Stack(
        tmp_path_factory.mktemp("svc-tp"),
        model_args=["--tensor-parallel-size", "2"],
        scheduler_args=["--dependency-timeout", "120"],
    )
    yield s
    s.close()


def _ranks(stack: Stack) -> list[psutil.Process]:
    return _children_ranks(stack.procs["model"].proc.pid)


def _children_ranks(pid: int) -> list[psutil.Process]:
    """A model service's rank processes (its children running model_svc.tp_launch)."""
    return [c for c in psutil.Process(pid).children() if "model_svc.tp_launch" in " ".join(c.cmdline())]


def test_generate_equals_embedded(stack, embedded):
    greedy = dict(temperature=0.0, max_tokens=32)
    assert generate_all(stack, PROMPTS, **greedy) == embedded(PROMPTS, **greedy)


def test_rank_kill9_fails_the_model_service_then_restart_recomputes(stack, embedded):
    undisturbed = embedded(STREAM_PROMPTS, **LONG)
    (rank1,) = _ranks(stack)
    streams = Streams(stack, STREAM_PROMPTS, timeout=120, **LONG)
    streams.wait_started()
    os.kill(rank1.pid, signal.SIGKILL)
    model = stack.procs["model"]
    wait_for(lambda: model.proc.poll() is not None, 30, "the model service to exit")
    assert model.proc.returncode == RANK_LOST_EXIT_CODE
    assert "tensor-parallel rank 1 exited with code -9" in model.log_path.read_text()
    stack.restart("model", wait=False)  # what a supervisor does
    results = streams.join(150)
    for i, (ids, _, _) in enumerate(undisturbed):
        assert results[i] == (ids, 2), i  # FINISH_REASON_LENGTH, same tokens
    stack.wait_kv_clean()


def test_model_service_kill9_leaves_no_rank(stack):  # the last test: it leaves no model service
    stack.wait_ready("model")
    ranks = _ranks(stack)
    assert len(ranks) == 1
    os.kill(stack.procs["model"].proc.pid, signal.SIGKILL)  # the parent only, not its group
    deadline = time.monotonic() + 10
    while any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks):
        assert time.monotonic() < deadline, "a rank outlived the model service"
        time.sleep(0.1)


def test_sigterm_stops_the_ranks_with_the_service(tmp_path):
    from contracts.health import check_health

    addr = f"127.0.0.1:{free_port()}"
    args = ["--model-addr", addr, "--device", "cpu", "--num-gpu-blocks", "64", "--tensor-parallel-size", "2"]
    model = ServiceProcess("model", args, tmp_path)
    try:
        wait_for(lambda: check_health(addr, timeout=0.5), 120, "model service", model.proc)
        ranks = _children_ranks(model.proc.pid)
        assert len(ranks) == 1
        assert model.terminate(timeout=30) == 0
        assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)
    finally:
        model.kill()
