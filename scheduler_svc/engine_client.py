"""The gRPC front end's handle on its engine loop (scheduler_svc.engine_core).

The engine runs in a process of its own (`EngineClient.spawn`); tests may run it in a thread
of this process instead (`in_thread`: the same loop over the same wire, so an engine can be
patched in place). One reader task takes the engine's frames (scheduler_svc.engine_wire):
per step, each request's delta goes into that request's `OutputStream`, which merges
everything its Generate handler has not taken yet. A handler that is behind (its client
reads slowly, or this process is busy) then sends one message with every token since its
last, in order, instead of one message per token; a handler waiting for output is woken at
most once per step. Nothing here runs per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contracts.errors import Unavailable
from contracts.sampling_params import SamplingParams
from scheduler_svc.engine_wire import HEADER, EngineInfo, EngineStats, encode, unpack_error

logger = logging.getLogger(__name__)

# (token ids, text, logprobs or None, the final delta or None) taken from an OutputStream.
Chunk = tuple[list[int], str, list | None, tuple | None]
# n > 1: one completion's part of a take, (index, token ids, text, logprobs or None, finish
# reason or None, stop reason or None).
CompletionChunk = tuple[int, list[int], str, list | None, str | None, int | str | None]


class EngineGone(Unavailable):
    """The engine loop exited under a request (its process died)."""


class OutputStream:
    """One request's output not yet taken by its handler: the deltas since, merged in order."""

    __slots__ = ("token_ids", "text", "logprobs", "final", "error", "waiter", "completions")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.final: tuple | None = None  # the last delta (finish reason, usage), once it came
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None  # set while the handler waits for output
        self.completions: dict[int, list] = {}  # n > 1: index -> [ids, text, logprobs, finish, stop] not taken

    def put(self, delta: tuple) -> None:
        if len(delta) == 7:  # a completion of n > 1
            entry = self.completions.setdefault(delta[4], [[], "", None, None, None])
            entry[0] += delta[1]
            entry[1] += delta[2]
            if delta[3] is not None:
                entry[2] = (entry[2] or []) + delta[3]
            if delta[5] is not None:
                entry[3], entry[4] = delta[5], delta[6]
            self._wake()
            return
        self.token_ids += delta[1]
        if delta[2]:
            self.text += delta[2]
        if delta[3] is not None:
            self.logprobs = (self.logprobs or []) + delta[3]
        if len(delta) > 4:
            self.final = delta
            if delta[9] is not None:
                self.error = unpack_error(delta[9])
        self._wake()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error`, raised by the next take()."""
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> Chunk:
        """Everything since the last take, waiting until there is something; raises the
        request's error (an admission error, a failed step, or one given to fail())."""
        await self._wait()
        chunk = (self.token_ids, self.text, self.logprobs, self.final)
        self.token_ids, self.text, self.logprobs = [], "", None
        return chunk

    async def take_completions(self) -> tuple[list[CompletionChunk], tuple | None]:
        """take() of a request of n > 1: each completion's part since the last take, in index
        order, and the final delta or None."""
        await self._wait()
        chunks = [(i, *self.completions[i]) for i in sorted(self.completions)]
        self.completions = {}
        return chunks, self.final

    async def _wait(self) -> None:
        while not (self.token_ids or self.text or self.completions or self.final is not None or self.error is not None):
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        if self.error is not None:
            raise self.error


class EngineClient:
    """`stats` and `info` are the engine's as of its last frame. `on_exit(why)` is called when
    the engine loop ends without being asked to (every open stream has failed by then)."""

    def __init__(
        self,
        sock: socket.socket,
        tokenize: Callable[[str], list[int]] | None = None,
        load_tokenizer: Callable[[], Any] | None = None,
    ) -> None:
        self._sock = sock
        self._tokenize = tokenize
        self._load_tokenizer = load_tokenizer
        self.info: EngineInfo | None = None
        self.stats = EngineStats()
        self.on_exit: Callable[[str], None] | None = None
        self.exited: str | None = None  # why the engine loop is gone
        self._streams: dict[str, OutputStream] = {}
        self._outbox: list[tuple] = []
        self._writer: asyncio.StreamWriter | None = None
        self._starting: asyncio.Future | None = None
        self._stopping = False
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- starting
    @classmethod
    def spawn(cls, config: Any, token: str | None, skip_tokenizer_init: bool = False) -> EngineClient:
        """The engine in a process of its own (built there from `config`, a ServiceConfig); the
        prompt tokenizer is loaded here by start()."""
        from contracts.auth import API_KEY_ENV, INTERNAL_TOKEN_ENV, REDIS_URL_ENV

        parent, child = socket.socketpair()
        # No secret in its environment: the internal token comes over the socket, and the
        # engine has no use for the API key or the Redis URL.
        secrets = {v for var in (API_KEY_ENV, INTERNAL_TOKEN_ENV, REDIS_URL_ENV) for v in (var, f"{var}_FILE")}
        env = {k: v for k, v in os.environ.items() if k not in secrets}
        root = str(Path(__file__).resolve().parent.parent)  # the engine imports this checkout's packages
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            [sys.executable, "-m", "scheduler_svc.engine_core", str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
        )
        child.close()
        parent.sendall(encode(("setup", config, token, skip_tokenizer_init, logging.getLogger().getEffectiveLevel())))

        def load() -> Any:
            from contracts.tokenizer import load_tokenizer

            return None if skip_tokenizer_init else load_tokenizer(config.tokenizer)

        client = cls(parent, load_tokenizer=load)
        client._proc = proc
        return client

    @classmethod
    def in_thread(cls, engine: Any) -> EngineClient:
        """The engine loop in a daemon thread of this process (tests), over the same wire."""
        from scheduler_svc.engine_core import EngineCore, FrameChannel

        parent, child = socket.socketpair()
        client = cls(parent, tokenize=lambda text: engine.tokenize(text))  # looked up per call: tests patch it
        client._thread = threading.Thread(
            target=EngineCore(engine, FrameChannel(child)).run, name="engine-loop", daemon=True
        )
        client._thread.start()
        return client

    async def start(self) -> None:
        """Connect and wait until the engine is built; raises what kept it from being built."""
        if self.info is not None:  # started
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        loading = None
        if self._load_tokenizer is not None:
            loading = asyncio.get_running_loop().run_in_executor(None, self._load_tokenizer)
        try:
            frame = await _read_frame(reader)
        except (asyncio.IncompleteReadError, OSError):
            raise EngineGone(f"the engine process exited while starting{self._exit_status()}") from None
        if frame[0] == "failed":
            raise unpack_error(frame[1])
        self.info = frame[1]
        if loading is not None:
            tokenizer = await loading
            self._tokenize = None if tokenizer is None else (lambda text: list(tokenizer.encode(text)))
        asyncio.ensure_future(self._read_loop(reader))

    def _exit_status(self) -> str:
        if self._proc is None or self._proc.poll() is None:
            return ""
        return f" (status {self._proc.returncode})"

    # ----------------------------------------------------------------- requests
    def check_request(self, prompt: str | list[int], params: SamplingParams) -> None:
        """What can be checked before any work: the prompt's size and the request limits
        (LLMEngine.check_request against the engine's facts). ValueError naming the field."""
        info = self.info
        assert info is not None, "start() first"
        if isinstance(prompt, str) and (self._tokenize is None or not info.has_tokenizer):
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): give prompt token ids")
        info.limits.check_prompt(prompt, info.max_model_len)
        params.check_limits(info.limits, info.vocab_size)

    def tokenize(self, text: str) -> list[int]:
        assert self._tokenize is not None
        return self._tokenize(text)

    def open(
        self, prompt: list[int], params: SamplingParams, request_id: str, cache_salt: str | None, deadline: float | None
    ) -> OutputStream:
        """Send the request to the engine; its outputs arrive in the returned stream."""
        stream = self._streams[request_id] = OutputStream()
        if self.exited is not None:
            stream.fail(EngineGone(self.exited))
        else:
            self._send(("add", request_id, prompt, params, cache_salt, deadline))
        return stream

    def close(self, request_id: str) -> None:
        """The handler is done with the request: abort it if it has not finished."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.final is None:
            self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish reason "abort"."""
        self._send(("abort", request_id))

    def _send(self, cmd: tuple) -> None:
        """Commands leave as one frame per turn of the event loop (a burst of requests: one)."""
        if self.exited is not None or self._writer is None:
            return
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(cmd)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and self.exited is None and self._writer is not None:
            self._writer.write(encode(batch))

    # ----------------------------------------------------------------- frames in
    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        streams = self._streams
        try:
            while True:
                frame = await _read_frame(reader)
                if frame[0] == "step":
                    for delta in frame[1]:
                        stream = streams.get(delta[0])
                        if stream is not None:
                            stream.put(delta)
                    self.stats = frame[2]
                elif frame[0] == "info":
                    self.info = frame[1]
        except (asyncio.IncompleteReadError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a frame that does not decode: the wire is broken
            logger.exception("a frame from the engine did not decode")
        self.exited = f"the engine loop exited{self._exit_status()}"
        for stream in streams.values():
            stream.fail(EngineGone(self.exited))
        if not self._stopping:
            logger.error("%s", self.exited)
            if self.on_exit is not None:
                self.on_exit(self.exited)

    # ----------------------------------------------------------------- stopping
    async def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the engine to stop (its open requests are aborted), wait for it (bounded),
        then kill what is left."""
        self._stopping = True
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        if self._writer is not None and self.exited is None:
            self._flush()
            self._writer.write(encode([("stop",)]))
            with contextlib.suppress(asyncio.TimeoutError, OSError):
                await asyncio.wait_for(self._writer.drain(), timeout)
        loop = asyncio.get_running_loop()
        if self._proc is not None:
            try:
                await loop.run_in_executor(None, self._proc.wait, timeout)
            except subprocess.TimeoutExpired:
                if self.info is not None:  # not one still being built (waiting for its peers)
                    logger.warning("the engine process did not stop in %.0f s: killing it", timeout)
                self._proc.kill()
                await loop.run_in_executor(None, self._proc.wait)
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join, timeout)
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))
