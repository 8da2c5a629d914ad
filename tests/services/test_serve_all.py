"""`picovllm serve all`: the three services as processes on loopback from one command, a
request of one completion and one of two, and SIGTERM: new requests are refused, the
in-flight one finishes, every process exits."""

from __future__ import annotations

import threading
import time

import grpc

from contracts.health import check_health
from scheduler_svc.client import Client
from tests.services.conftest import ServiceProcess, free_port, wait_for


def test_serve_all_answers_then_drains_on_sigterm(tmp_path):
    addr = {k: f"127.0.0.1:{free_port()}" for k in ("scheduler", "kvcache", "model")}
    args = [
        "--scheduler-addr",
        addr["scheduler"],
        "--kvcache-addr",
        addr["kvcache"],
        "--model-addr",
        addr["model"],
        "--metrics-port",
        str(free_port()),
        "--device",
        "cpu",
        "--torch-threads",
        "1",
        "--num-gpu-blocks",
        "128",
        "--num-cpu-blocks",
        "16",
        "--drain-timeout",
        "60",
        "--port",
        str(free_port()),
    ]
    proc = ServiceProcess("all", args, tmp_path)
    try:
        wait_for(lambda: check_health(addr["scheduler"], timeout=0.5), 120, "serve all", proc.proc)
        with Client(addr["scheduler"], timeout=60) as c:
            text, ids, _ = c.complete("Once upon a time", temperature=0.0, max_tokens=8)
            msgs = list(c.generate("Once upon a time", temperature=0.0, max_tokens=8, n=2))
        assert len(ids) == 8 and text
        for index in (0, 1):  # parallel sampling: both completions stream, each the greedy one
            assert [t for m in msgs if m.index == index for t in m.token_ids] == ids
        assert msgs[-1].usage.completion_tokens == 16

        result: dict[str, object] = {}
        started = threading.Event()

        def in_flight() -> None:
            with Client(addr["scheduler"], timeout=60) as c:
                n = 0
                for msg in c.generate("Once upon a time", temperature=0.0, max_tokens=400, ignore_eos=True):
                    n += len(msg.token_ids)
                    started.set()
                result["tokens"], result["reason"] = n, msg.finish_reason

        t = threading.Thread(target=in_flight)
        t.start()
        assert started.wait(30)
        proc.proc.terminate()
        wait_for(lambda: not check_health(addr["scheduler"], timeout=0.5), 10, "scheduler draining")
        with Client(addr["scheduler"], timeout=10) as c:
            try:
                c.complete("Once upon a time", max_tokens=4)
                raise AssertionError("a new request was accepted while draining")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
        t.join(60)
        assert not t.is_alive()
        assert result == {"tokens": 400, "reason": 2}  # finished normally (LENGTH)
        assert proc.proc.wait(timeout=60) == 0
        time.sleep(0.2)
        assert not any(check_health(a, timeout=0.3) for a in addr.values())
    finally:
        proc.kill()
