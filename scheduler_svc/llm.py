"""The public Python API: `LLM(...).generate(...)` and the streaming `AsyncLLM`."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from contracts.rpc import freeze_heap
from contracts.sampling_params import SamplingParams
from contracts.service_config import BUNDLED_MODEL
from scheduler_svc.config import EngineConfig
from scheduler_svc.engine import LLMEngine
from scheduler_svc.outputs import RequestOutput

Prompt = str | list[int] | dict[str, Any]


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    def one(p: Prompt) -> str | list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            return p["prompt"]
        return p

    if isinstance(prompts, (str, dict)):
        return [one(prompts)]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return [one(p) for p in items]


class LLM:
    """Offline generation in one process, with no server, no Redis and no GPU needed."""

    def __init__(
        self,
        model: str = BUNDLED_MODEL,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "swap",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,  # None: by device (scheduler_svc.config.offline_batched_tokens)
        device: str | None = None,
        dtype: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = EngineConfig(
            model=model,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            device=device,
            dtype=dtype,
            **kwargs,
        )
        self.engine = LLMEngine(self.config)
        freeze_heap()  # start-up is done: keep full collections off the model, torch and the tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built by hand (a prebuilt model runner, a remote model client)."""
        llm = cls.__new__(cls)
        llm.config, llm.engine = engine.config, engine
        freeze_heap()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompts = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        self.engine.stream_outputs = False
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            self.engine.stream_outputs = True
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


class AsyncLLM:
    """Streaming front of an engine: the engine steps in a thread of its own while callers
    await their outputs. Adds and aborts are queued and applied between steps."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield one RequestOutput per step that produced text for this request; the last has
        finished=True. Cancelling the consumer aborts the request and frees its blocks."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._commands.put(("add", prompt, params, request_id, done, loop, cache_salt))
        self._wake.set()
        try:
            request_id, stream = await asyncio.shield(done)  # raises ValueError for invalid input
        except asyncio.CancelledError:  # gone before the engine took the request: abort it then
            done.add_done_callback(self._abort_when_added)
            raise
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:
                self.abort(request_id)

    def _abort_when_added(self, done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            request_id, _ = done.result()
            self._streams.pop(request_id, None)
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step fails every open stream, not the loop
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                    self._deliver(request_id, exc)
                continue
            for out in outputs:
                self._deliver(out.request_id, out)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, prompt, params, request_id, done, loop, cache_salt = cmd
                try:
                    request_id = self.engine.add_request(prompt, params, request_id, cache_salt)
                except Exception as exc:
                    loop.call_soon_threadsafe(_set_exception, done, exc)
                    continue
                stream: asyncio.Queue = asyncio.Queue()
                self._streams[request_id] = (loop, stream)
                loop.call_soon_threadsafe(_set_result, done, (request_id, stream))
            else:
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._deliver(cmd[1], out)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)
            if isinstance(item, BaseException) or item.finished:
                self._streams.pop(request_id, None)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
