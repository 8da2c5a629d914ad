"""The scheduler service's engine loop, apart from its gRPC front end (scheduler_svc.server).

`EngineCore` owns an engine (a ServiceEngine in the service: scheduler, KV-cache client,
model client) and one end of a socket to the front end (scheduler_svc.engine_wire). Its
loop: take the commands that arrived (add, abort, stop), run one engine step, send one frame
with every request's output of that step and the engine's stats. The front end's work per
message (gRPC, protobuf, asyncio) never holds this loop's interpreter lock, so the steps run
as fast as embedded mode's; and this loop does nothing per token that embedded streaming
does not do (the frame is one pickle of tuples per step).

Semantics kept from the in-process AsyncLLM loop: a step that raises fails every open
request, not the loop; an admission error ends that request alone (its stream gets it as its
only output); deadlines given with a request bound the internal calls of the steps it is in.

`python -m scheduler_svc.engine_core FD` is the engine process: it reads its setup (config,
internal token, log level) as the first frame on the inherited socket FD, builds the service
engine, answers "ready" or "failed", then loops. It ignores SIGINT and SIGTERM (the front end
drains and then tells it to stop) and exits when the front end's end of the socket closes.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import signal
import socket
import sys
import threading
from typing import Any

from scheduler_svc.engine_wire import EngineInfo, EngineStats, encode, pack_error, split_frames
from scheduler_svc.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # how long an idle loop waits for a command before it looks again


class FrameChannel:
    """The engine's end of the socket. Frames go out at once when the socket takes them
    whole, else through a sender thread (a front end that is slow to read never stalls a
    step), in order; frames come in by polling between steps."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._inbox = bytearray()
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._queued = 0  # frames handed to the sender thread and not yet sent
        self._lock = threading.Lock()
        self.closed = False  # the front end is gone (EOF, or a send failed)
        self._sender = threading.Thread(target=self._send_loop, name="engine-frames-out", daemon=True)
        self._sender.start()

    def send(self, obj: Any) -> None:
        """Called from one thread (the engine loop)."""
        data = encode(obj)
        with self._lock:
            if not self._queued:  # nothing ahead of it: try the socket first
                try:
                    sent = self.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self.closed = True
                    return
                if sent == len(data):
                    return
                data = data[sent:]
            self._queued += 1
        self._outbox.put(data)

    def _send_loop(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.sock.sendall(data)
            except OSError:
                self.closed = True
                return
            with self._lock:
                self._queued -= 1

    def receive(self, timeout: float | None) -> list[Any]:
        """Frames that arrived, waiting up to `timeout` seconds for the first (None: forever)."""
        frames = split_frames(self._inbox)
        if frames or self.closed:
            return frames
        readable, _, _ = select.select([self.sock], [], [], timeout)
        while readable:
            try:
                chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self._inbox += chunk
            if len(chunk) < 1 << 20:
                break
        return split_frames(self._inbox)

    def close(self, timeout: float = 5.0) -> None:
        self._outbox.put(None)
        self._sender.join(timeout)
        self.sock.close()


def engine_info(engine: Any) -> EngineInfo:
    model, mc = engine.model, engine.model_config
    info = getattr(model, "info", None)  # a remote model's facts (an in-process runner has none)
    return EngineInfo(
        model=info.model if info is not None else str(engine.config.model),
        family=mc.family,
        vocab_size=mc.vocab_size,
        max_model_len=engine.max_model_len,
        block_size=engine.config.block_size,
        num_device_blocks=model.num_device_blocks,
        num_host_blocks=model.num_host_blocks,
        eos_token_ids=tuple(mc.eos_token_ids),
        enable_prefix_caching=engine.config.enable_prefix_caching,
        limits=engine.limits,
        has_tokenizer=engine.tokenizer is not None,
    )


def engine_stats(engine: Any) -> EngineStats:
    sched, kv = engine.scheduler, engine.kv
    try:
        usage = [p.num_used_blocks / p.num_blocks if p.num_blocks else 0.0 for p in (kv.device, kv.host)]
    except AttributeError:  # no pools yet
        usage = [0.0, 0.0]
    return EngineStats(
        len(sched.running),
        len(sched.waiting),
        len(sched.swapped),
        usage[0],
        usage[1],
        kv.num_prefix_queries,
        kv.num_prefix_hits,
        sched.stats.num_preemptions,
        getattr(engine, "unavailable", None),
        sched.stats.num_steps,
    )


def _logprobs(out: RequestOutput | CompletionOutput) -> list | None:
    if out.logprobs is None or not out.delta_token_ids:
        return None
    entries = out.logprobs[-len(out.delta_token_ids) :]
    return [
        (t, e.get(t, 0.0), [(a, lp) for a, lp in e.items() if a != t]) for t, e in zip(out.delta_token_ids, entries)
    ]


def _final(request_id: str, error: BaseException) -> tuple:
    return (request_id, [], "", None, "abort", None, 0, 0, 0, pack_error(error))


class EngineCore:
    def __init__(self, engine: Any, channel: FrameChannel) -> None:
        engine.stream_outputs = "delta"  # running requests' outputs come as wire deltas (LLMEngine._output)
        self.engine = engine
        self.channel = channel
        self.open: set[str] = set()  # requests the front end streams
        self.stopped = False
        self._deadlines: dict[str, float] = getattr(engine, "deadlines", {})  # ServiceEngine bounds its calls with them
        self._info_key: tuple | None = None
        self._reported: dict[str, set[int]] = {}  # n > 1: completions whose finish reason went out

    def run(self) -> None:
        """Step until told to stop or the front end goes away."""
        try:
            self._send_info()
            while not self.stopped and not self.channel.closed:
                busy = self.engine.has_unfinished()
                deltas = self._apply(self.channel.receive(0.0 if busy else _IDLE_WAIT_S))
                if not self.stopped and self.engine.has_unfinished():
                    deltas += self._step()
                elif not deltas:
                    continue
                self.channel.send(("step", deltas, engine_stats(self.engine)))
                self._send_info()
        finally:
            for request_id in list(self.open):  # the front end is gone: free their blocks
                self.engine.abort(request_id)

    def _send_info(self) -> None:
        """The model's facts: first as "ready", then again whenever they change."""
        key = (self.engine.max_model_len, self.engine.model.num_device_blocks, self.engine.model.num_host_blocks)
        if key != self._info_key:
            kind = "ready" if self._info_key is None else "info"
            self._info_key = key
            self.channel.send((kind, engine_info(self.engine)))

    def _apply(self, frames: list[list[tuple]]) -> list[tuple]:
        deltas: list[tuple] = []
        for commands in frames:
            for cmd in commands:
                if cmd[0] == "add":
                    self._add(cmd, deltas)
                elif cmd[0] == "abort":
                    out = self.engine.abort(cmd[1])
                    if out is not None:
                        deltas += self._deltas(out)
                elif cmd[0] == "stop":
                    self.stopped = True
        return deltas

    def _add(self, cmd: tuple, deltas: list[tuple]) -> None:
        _, request_id, prompt, params, salt, deadline = cmd
        try:
            self.engine.add_request(prompt, params, request_id, salt)
        except Exception as exc:  # noqa: BLE001 - this request's own input: it alone fails
            deltas.append(_final(request_id, exc))
            return
        self.open.add(request_id)
        if deadline is not None:
            self._deadlines[request_id] = deadline

    def _step(self) -> list[tuple]:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a broken step fails every open request, not the loop
            logger.exception("an engine step failed; failing its %d open requests", len(self.open))
            deltas: list[tuple] = []
            for request_id in list(self.open):
                self.engine.abort(request_id)
                self._closed(request_id)
                deltas.append(_final(request_id, exc))
            return deltas
        deltas = []
        for out in outputs:
            if isinstance(out, tuple):  # a running request's delta, already in the wire's form (stream_outputs "delta")
                deltas.append(out)
            else:
                deltas += self._deltas(out)
        return deltas

    def _deltas(self, out: RequestOutput) -> list[tuple]:
        """The wire deltas of one output: one for a request of one completion; for n > 1 one
        per completion that changed (its finish reason once), then the final one."""
        if out.completions is None:
            deltas = [] if out.finished else [(out.request_id, out.delta_token_ids, out.delta_text, _logprobs(out))]
        else:
            deltas = self._completion_deltas(out)
        if not out.finished:
            return deltas
        self._closed(out.request_id)
        ids, text, lp = (
            (out.delta_token_ids, out.delta_text, _logprobs(out)) if out.completions is None else ([], "", None)
        )
        final = (
            out.request_id,
            ids,
            text,
            lp,
            out.finish_reason,
            out.stop_reason,
            len(out.prompt_token_ids),
            sum(len(c.token_ids) for c in out.outputs),
            out.num_cached_tokens,
            None if out.error is None else pack_error(out.error),
        )
        return [*deltas, final]

    def _completion_deltas(self, out: RequestOutput) -> list[tuple]:
        done = self._reported.setdefault(out.request_id, set())
        deltas = []
        for c in out.outputs:
            ends = c.finish_reason is not None and c.index not in done
            if c.delta_token_ids or c.delta_text or ends:
                deltas.append(
                    (out.request_id, c.delta_token_ids, c.delta_text, _logprobs(c), c.index)
                    + ((c.finish_reason, c.stop_reason) if ends else (None, None))
                )
                if ends:
                    done.add(c.index)
        if out.finished:
            del self._reported[out.request_id]
        return deltas

    def _closed(self, request_id: str) -> None:
        self.open.discard(request_id)
        self._reported.pop(request_id, None)
        self._deadlines.pop(request_id, None)


# ----------------------------------------------------------------- the engine process
def _die_with_parent() -> None:
    """Linux: SIGKILL when the front end's process dies, even by SIGKILL (SIGTERM is ignored here)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    """The engine process: `python -m scheduler_svc.engine_core FD`."""
    fd = int((argv if argv is not None else sys.argv[1:])[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    channel = FrameChannel(socket.socket(fileno=fd))
    frames: list[Any] = []
    while not frames and not channel.closed:
        frames = channel.receive(None)
    if not frames:
        return 1
    _, config, token, skip_tokenizer_init, log_level = frames[0]
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from scheduler_svc.remote_engine import build_service_engine

    try:
        engine = build_service_engine(config, skip_tokenizer_init, token)
    except Exception as exc:  # noqa: BLE001 - the front end says it in its one line
        logger.debug("the engine could not be built", exc_info=True)
        channel.send(("failed", pack_error(exc)))
        channel.close()
        return 1
    logger.info("engine process %d ready", os.getpid())
    EngineCore(engine, channel).run()
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
