"""Several gateway processes on one port (`--http-workers`, http_svc.workers): requests are
answered whichever worker takes them, /metrics counts the workers' requests together, and a
SIGTERM ends every worker with the supervisor."""

from __future__ import annotations

import concurrent.futures
import os
import urllib.request
from pathlib import Path

from tests.http.conftest import ServeAll, raw, wait_until


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _gateway_pid(stack: ServeAll) -> int:
    for child in _children(stack.procs["all"].proc.pid):
        if b"serve\x00http" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    raise AssertionError("no gateway process under serve all")


def test_two_workers_answer_and_count_together_and_stop_together(tmp_path):
    stack = ServeAll(tmp_path, ["--http-workers", "2", "--num-gpu-blocks", "256"])
    try:
        gateway = _gateway_pid(stack)
        workers = _children(gateway)
        assert len(workers) == 2, workers
        body = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: raw(stack, "POST", "/v1/completions", body), range(16)))
        assert all(status == 200 for status, _ in answers), answers[:2]
        assert len({reply["choices"][0]["text"] for _, reply in answers}) == 1  # greedy: the same text
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def completions_counted() -> float:
            with opener.open(f"{stack.url}/metrics", timeout=5) as reply:
                text = reply.read().decode()
            prefix = 'picovllm_http_requests_total{method="POST",route="/v1/completions",status="200"}'
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

        # A worker counts a request once its reply is sent, so the last count may land just after
        # the client has its answer.
        wait_until(lambda: completions_counted() >= 16, 10, "16 completions counted")
        assert completions_counted() == 16  # every worker's, whichever answers /metrics
        stack.procs["all"].proc.terminate()
        assert stack.procs["all"].proc.wait(timeout=90) == 0
        wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in [gateway, *workers]), 10, "workers gone")
    finally:
        stack.close()
