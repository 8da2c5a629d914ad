"""The ranks of a tensor-parallel model runner as processes: start-up, the step loop of
ranks 1..N-1, failure and shutdown.

The process that builds the runner is rank 0. start_ranks starts ranks 1..N-1, one process
per device (rank r on cuda:r), each a fresh `python -m model_svc.tp_launch`; they rendezvous
with rank 0 at the master address and port (a free loopback port by default), build the same
runner on their shard and then run every step rank 0 sends (serve_steps). A watcher thread
per rank in rank 0 notices a rank that exits: the group is marked failed (the next step
raises TensorParallelError, with the rank and its exit code) and the on_failure callback
runs (the model service ends its process there, so the scheduler sees a model-service
restart). Each rank > 0 ends itself when its parent is gone, whatever the way the parent
ended (a kill -9 included), so no rank outlives rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from contracts.errors import SequenceFailed
from contracts.rpc import free_port
from model_svc.parallel import TPGroup

if TYPE_CHECKING:
    from model_svc.runner import ModelRunner

# Builds a rank's runner on its group: picklable (a started rank receives it), e.g.
# functools.partial(runner_factory.build_runner, settings).
BuildRunner = Callable[[TPGroup], "ModelRunner"]

logger = logging.getLogger(__name__)

# How often a rank > 0 checks that rank 0 (its parent) is still there.
PARENT_POLL_S = 0.5


def rank_device(device: str | None, rank: int) -> torch.device:
    """Rank r's device: cuda:r on a CUDA machine (one process per GPU), else the CPU."""
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = torch.device(kind).type
    return torch.device(kind, rank) if kind == "cuda" else torch.device("cpu")


@dataclasses.dataclass(slots=True)
class _Ranks:
    """Rank 0's view of the other ranks: their processes, and whether it is stopping them."""

    procs: list[subprocess.Popen]
    stopping: bool = False


def start_ranks(
    size: int,
    master_addr: str,
    master_port: int | None,
    device: str | None,
    build: BuildRunner,
    on_failure: Callable[[str], None] | None = None,
) -> TPGroup:
    """Start ranks 1..size-1 (each runs build(its group), then serve_steps), join the group
    as rank 0 and return its TPGroup. master_port None: a free port."""
    port = master_port or free_port(master_addr)
    rendezvous = (size, master_addr, port, device)
    ranks = _Ranks([_spawn(rank, rendezvous, build) for rank in range(1, size)])
    try:
        tp = TPGroup(0, size, master_addr, port, rank_device(device, 0))
    except BaseException:
        _kill(ranks.procs)
        raise
    tp.stop_ranks = functools.partial(_stop, tp, ranks)
    tp.rank_pids = [p.pid for p in ranks.procs]
    failed = threading.Event()  # the first rank to exit fails the group, once
    for rank, proc in enumerate(ranks.procs, start=1):
        args = (tp, ranks, rank, proc, failed, on_failure)
        threading.Thread(target=_watch, args=args, name=f"tp-watch-{rank}", daemon=True).start()
    logger.info("tensor parallel: %d ranks, rendezvous %s:%d", size, master_addr, port)
    return tp


def _spawn(rank: int, rendezvous: tuple[int, str, int, str | None], build: BuildRunner) -> subprocess.Popen:
    """A fresh interpreter (no fork of a process that may hold CUDA, and no re-import of the
    caller's main module) that reads its rank, the rendezvous and `build` from its stdin."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)  # where model_svc lives
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "model_svc.tp_launch"], stdin=subprocess.PIPE, env=env)
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps((rank, rendezvous, build, os.getpid())))
    proc.stdin.close()
    return proc


def _stop(tp: TPGroup, ranks: _Ranks) -> None:
    """Rank 0 (TPGroup.close): tell the other ranks to stop, wait for them and kill any that linger."""
    ranks.stopping = True
    if tp.failure is None:
        try:
            tp.publish(None)
        except Exception:  # noqa: BLE001 - a rank already gone: killed below
            logger.debug("tensor parallel: stop broadcast failed", exc_info=True)
    deadline = time.monotonic() + 10
    for p in ranks.procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    _kill(ranks.procs)


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(5)


def _watch(
    tp: TPGroup,
    ranks: _Ranks,
    rank: int,
    proc: subprocess.Popen,
    failed: threading.Event,
    on_failure: Callable[[str], None] | None,
) -> None:
    """Rank 0's watcher of one rank: the first to exit while the group is not stopping fails it."""
    code = proc.wait()
    if ranks.stopping or failed.is_set():
        return
    failed.set()
    message = f"tensor-parallel rank {rank} exited with code {code}; the model runner is unusable"
    tp.failure = message
    logger.error("%s", message)
    _kill(ranks.procs)
    if on_failure is not None:
        on_failure(message)


def _rank_main(rank: int, rendezvous: tuple[int, str, int, str | None], build: BuildRunner, parent_pid: int) -> None:
    """A started rank: join the group, build the runner on this rank's shard, run the steps."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    size, master_addr, master_port, device = rendezvous
    serve_steps(build(TPGroup(rank, size, master_addr, master_port, rank_device(device, rank))))


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def serve_steps(runner: ModelRunner) -> None:
    """Ranks > 0: run each step rank 0 sends until it sends None. A step's tokens are read
    back after the next one is launched (the device keeps the next step queued, as rank 0's);
    all of them before a step whose sampling reads the token history (penalties), which
    rank 0 only launches with its own history complete. A step that fails for one sequence
    fails the same way on every rank: rank 0 reports it, this rank goes on."""
    tp = runner.tp
    assert tp is not None and tp.rank > 0
    pending: deque = deque()
    while (inp := tp.receive()) is not None:
        if any(_reads_history(runner, s) for s in inp.seqs):
            while pending:
                pending.popleft().result()
        try:
            pending.append(runner.launch(inp))
        except SequenceFailed:
            continue
        while len(pending) > 1:
            pending.popleft().result()
    tp.close()


def _reads_history(runner: ModelRunner, seq) -> bool:
    state = runner.seqs.get(seq.seq_id)
    sampling = seq.sampling if seq.sampling is not None else (state.sampling if state is not None else None)
    return sampling is not None and sampling.has_penalties


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _rank_main(*pickle.loads(sys.stdin.buffer.read()))
