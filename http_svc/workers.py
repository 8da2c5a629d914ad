"""Several gateway processes on one listening socket: `http.workers` (`--http-workers`).

The gateway holds no state, so it scales as pre-forked workers do under gunicorn or
`uvicorn --workers`: this process binds the port once (a taken port is still one line),
forks the workers, which each run the whole gateway (its own scheduler channel, tokenizer
and uvicorn server) on the shared socket while the kernel spreads connections over them, and
then only supervises. SIGTERM and SIGINT go on to every worker (each stops as one gateway
does); the first worker to exit stops the others, and its status is the exit status.

Metrics are the workers' together: prometheus-client's multiprocess mode, in a private
directory made before the first metric exists and removed at the end.

The default (None) is one worker per four CPUs, at least one and at most four.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import time
from typing import Any

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def num_workers(configured: int | None) -> int:
    return configured if configured is not None else max(1, min(4, (os.cpu_count() or 1) // 4))


def run(config: Any, creds: Any) -> int:
    """`serve http`: one gateway in this process, or the workers and their supervision."""
    workers = num_workers(config.http.workers)
    metrics_dir = None
    if workers > 1:  # before http_svc.app creates its first metric
        metrics_dir = tempfile.mkdtemp(prefix="picovllm-http-metrics-")
        os.environ[MULTIPROC_ENV] = metrics_dir
    from http_svc.server import bind, serve

    try:
        sock = bind(config.http.host, config.http.port)
        if workers == 1:
            asyncio.run(serve(config, creds, sock))
            return 0
        # The first answers 503 while starting; the others are forked once it is ready (so that
        # no connection reaches a worker still starting once one has said ready) and take
        # connections from when they are ready themselves.
        ready_r, ready_w = os.pipe()
        pids = [_fork(lambda: asyncio.run(serve(config, creds, sock, on_ready=lambda: os.write(ready_w, b"1"))))]
        os.close(ready_w)
        started = os.read(ready_r, 1)  # b"": the first worker ended before it was ready
        os.close(ready_r)
        if started:
            pids += [_fork(lambda: asyncio.run(serve(config, creds, sock, first=False))) for _ in range(workers - 1)]
        return _supervise(pids)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _fork(body) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        body()
        code = 0
    except BaseException:  # noqa: BLE001 - the worker's failure is its exit status; its log said why
        import logging

        logging.getLogger(__name__).exception("HTTP gateway worker %d failed", os.getpid())
    finally:
        os._exit(code)


def _supervise(pids: list[int]) -> int:
    stopping = False

    def forward(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        for pid in pids:
            _kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    first_code = None
    alive = set(pids)
    while alive:
        pid, status = os.waitpid(-1, 0)
        if pid not in alive:
            continue
        alive.discard(pid)
        _forget_metrics_of(pid)
        code = os.waitstatus_to_exitcode(status)
        if first_code is None:
            first_code = code if code >= 0 else 1
            if not stopping:  # a worker died on its own: the gateway stops whole, as one process would
                stopping = True
                for other in alive:
                    _kill(other, signal.SIGTERM)
                _kill_after(alive, 60)
    return first_code or 0


def _forget_metrics_of(pid: int) -> None:
    """A dead worker's in-progress gauge no longer counts (its counters still do)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _kill_after(pids: set[int], timeout: float) -> None:
    """SIGKILL whoever of `pids` is still running after `timeout` (in a thread: waitpid goes on)."""
    import threading

    def later() -> None:
        time.sleep(timeout)
        for pid in list(pids):
            _kill(pid, signal.SIGKILL)

    threading.Thread(target=later, daemon=True).start()
