"""LLMEngine: the scheduler loop of one engine step, in process.

add_request -> step() -> RequestOutputs. Text exists only here: prompts are tokenized on
the way in and generated ids detokenized incrementally on the way out; the KV-cache and
model sides see ids only.

A request that fails fails alone: everything a step could fail on is checked per request at
admission (RequestLimits, the vocabulary, max_model_len); an error in one request's stop
checks, detokenization or logprobs ends that request only; a model step that raises ends the
request it names (SequenceFailed), or else the requests of that step, and the others are
recomputed. A failed request's last output has finish_reason "abort" and `error` set.

A request of n > 1 completions (scheduler_svc.request) is one request to the caller: one
RequestOutput per step with every completion, one abort for all, and a failure of any of
its sequences fails it whole. Each completion (child) has its own text stream.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from typing import Any, Protocol, cast

from contracts import phase_times
from contracts.errors import ModelLost, OutOfRange, RequestFailed, failed_seq_id
from contracts.sampling_params import RequestLimits, SamplingParams
from contracts.step import StepInput, StepOutput
from contracts.tokenizer import load_tokenizer_soon
from kvcache_svc import KVCacheManager
from scheduler_svc.config import EngineConfig
from scheduler_svc.detokenizer import Detokenizers
from scheduler_svc.outputs import RequestOutput
from scheduler_svc.prompt_ids import checked_ids, is_token
from scheduler_svc.request import Request, child_seq_id
from scheduler_svc.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from scheduler_svc.streams import Stream, failed_output, group_output, stream_output

logger = logging.getLogger(__name__)


class ModelClient(Protocol):
    """The scheduler's view of the model service (in process, or a gRPC stub)."""

    @property
    def num_device_blocks(self) -> int: ...

    @property
    def num_host_blocks(self) -> int: ...

    @property
    def kv_group_windows(self) -> tuple[int, ...]: ...  # contracts.kv_groups

    @property
    def config(self) -> Any: ...

    def step(self, inp: StepInput) -> StepOutput: ...


class LLMEngine:
    # Steps in flight under overlapped scheduling: step k is queued before step k - depth is
    # read back, so the device has the next step queued even when the host's work for one
    # step (read back, stop checks, schedule, prepare, launch) is longer than a short step.
    pipeline_depth = 2

    def __init__(
        self, config: EngineConfig, model: ModelClient | None = None, tokenizer=None, model_config=None, kv=None
    ) -> None:
        self.config = config
        loading = None if tokenizer is not None or config.skip_tokenizer_init else load_tokenizer_soon(config.model)
        if model is None:
            from model_svc.runner_factory import RunnerSettings, build_runner

            model = build_runner(RunnerSettings.of(config))
        # Typed loosely: a ModelRunner, a RemoteModel or a test double, each with ModelClient's
        # members, and launch() where the engine overlaps steps (checked with hasattr).
        self.model: Any = model
        self.model_config = model_config if model_config is not None else model.config
        self.tokenizer = tokenizer = loading.result() if loading is not None else tokenizer
        # Service mode passes a KV-cache client with the manager's interface (kvcache_svc.client).
        pools = (model.num_device_blocks, model.num_host_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = kv if kv is not None else KVCacheManager(*pools, model.kv_group_windows)
        self.scheduler = Scheduler(SchedulerConfig.of(config, self._max_model_len(model, config)), self.kv)
        self.max_model_len = self.scheduler.config.max_model_len
        self.limits = RequestLimits()  # per-request caps (service mode: the scheduler section's)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, Stream] = {}
        self._detok = Detokenizers(tokenizer)
        self._ids = itertools.count()
        # False: step() returns finished requests only (offline use); "delta" (the engine process,
        # scheduler_svc.engine_core): a running request without logprobs comes as the tuple
        # (request_id, new token ids, new text, None), the rest as RequestOutputs.
        self.stream_outputs: bool | str = True
        # Overlap the host's work with the device's step (needs a model client with launch()).
        overlap = config.async_scheduling
        if overlap is None:
            overlap = getattr(getattr(model, "device", None), "type", None) == "cuda"
        self.async_scheduling = bool(overlap) and hasattr(model, "launch")
        self._inflight: deque[tuple[SchedulerOutput, Any]] = (
            deque()
        )  # (SchedulerOutput, LaunchedStep) on the device, oldest first
        self._next: SchedulerOutput | None = None  # step k+1, scheduled while step k runs
        self._failing: SchedulerOutput | None = None  # the step whose model call is under way

    def _max_model_len(self, model, config: EngineConfig) -> int:
        limit = self.kv.max_tokens(self.model_config.max_position_embeddings)
        return limit if config.max_model_len is None else min(limit, config.max_model_len)

    # ----------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self._prompt_tokens(prompt)[0]

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> None:
        """What can be checked before any work (tokenizing above all): the prompt's length in
        characters or tokens and the request limits. ValueError naming the field."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init): give prompt token ids")
        self.limits.check_prompt(prompt, self.max_model_len)
        params.check_limits(self.limits, self.model_config.vocab_size)

    def _prompt_tokens(self, prompt: str | list[int]) -> tuple[list[int], bytes | None]:
        """The prompt's token ids, checked, and for given ids the same as int64 bytes (the
        check makes them; the prefix-cache lookup hashes them)."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt)), None
        prompt = prompt if isinstance(prompt, (list, tuple)) else list(prompt)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.model_config.vocab_size
        checked = checked_ids(prompt, vocab)
        if checked is None:
            bad = [t for t in prompt if not is_token(t, vocab)]
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {bad[:5]}")
        return checked

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq_ids = [request_id] + [child_seq_id(request_id, i) for i in range(params.n if params.n > 1 else 0)]
        if any(seq_id in self.requests or seq_id in self._streams for seq_id in seq_ids):
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.check_request(prompt, params)
        token_ids, token_bytes = self._prompt_tokens(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len})"
            )
        req = Request(request_id, token_ids, params, self.eos_token_ids, cache_salt, prompt_bytes=token_bytes)
        self.scheduler.add(req)
        self.requests[request_id] = req
        for seq in req.completions:  # keyed by sequence id
            self._streams[seq.request_id] = Stream(
                prompt if isinstance(prompt, str) else None, self._detok.start(len(token_ids))
            )
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, "abort")
        out = self._output(req)
        assert isinstance(out, RequestOutput)  # a finished request's output is never the delta tuple
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._inflight) or self._next is not None

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's unreferenced blocks (benchmarks: a cold start for every
        run); returns how many were dropped."""
        return self.scheduler.kv.reset_prefix_cache()

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        self._failing = None
        try:
            if self.async_scheduling:
                return self._step_overlapped()
            return self._step_sync()
        except Exception as exc:
            # Not a model call (the engine's own state is in question), or a model that is gone.
            if self._failing is None or isinstance(exc, ModelLost):
                raise
            return self._contain(exc)

    def _step_sync(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        inp = sched.step
        if inp.is_empty():
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                return self._unblock()
            return []
        self._failing = sched
        result = self.model.step(inp)
        self._failing = None
        # The step's computed tokens and full blocks first (as overlapped scheduling does at
        # launch): a request that the results finish still registers the prompt it computed.
        self.scheduler.update(sched)
        return self._process(sched, result)

    def _step_overlapped(self) -> list[RequestOutput]:
        """One turn of the pipeline: queue step k on the device, then, while it runs, read
        back step k - pipeline_depth's tokens (stop checks, detokenization, outputs), advance
        the cache bookkeeping of step k and schedule step k+1 (tokens the steps in flight are
        still sampling are fed on the device as placeholders). Outputs therefore come
        pipeline_depth steps late."""
        t0 = phase_times.start()
        sched = self._next
        if sched is None:  # nothing scheduled ahead (the first step, or after an idle turn)
            sched = self.scheduler.schedule()
            phase_times.add("engine.schedule_inline", t0)
        self._next = None
        inp = sched.step
        outputs: list[RequestOutput] = []
        if self._inflight and any(req.sampling.has_penalties for req, _ in sched.scheduled()):
            outputs += self._drain(0)  # penalties read the token history: no overlap this step
        launched = None
        if not inp.is_empty():
            t = phase_times.start()
            self._failing = sched
            launched = self._launch(sched)
            self._failing = None
            self._inflight.append((sched, launched))
            phase_times.add("engine.launch", t)
        was_inflight = bool(self._inflight)
        outputs += self._drain(self.pipeline_depth if launched is not None else 0)
        t = phase_times.start()
        if launched is not None:
            self.scheduler.update(sched)
        else:
            self._idle_step()
            if not was_inflight and self.scheduler.has_unfinished() and not self.scheduler.running:
                outputs += self._unblock()
        phase_times.add("engine.update", t)
        t = phase_times.start()
        if self.scheduler.has_unfinished():
            self._next = self.scheduler.schedule()
        phase_times.add("engine.schedule", t)
        phase_times.add("engine.step", t0)
        return outputs

    def _launch(self, sched: SchedulerOutput) -> Any:
        """Queue the step; the returned object's result() reads it back."""
        return self.model.launch(sched.step)

    def _idle_step(self) -> None:
        """A turn of the pipeline that launched nothing (service mode flushes its KV ops)."""

    def _drain(self, keep: int) -> list[RequestOutput]:
        """Read back the oldest steps in flight until `keep` remain, then any older ones the
        device has already finished: when the host is the slower side, tokens (a request's
        first above all) come out a step or two sooner, and nothing waits for that."""
        outputs: list[RequestOutput] = []
        while len(self._inflight) > keep or (self._inflight and _finished(self._inflight[0][1])):
            sched, launched = self._inflight[0]
            t = phase_times.start()
            self._failing = sched
            result = launched.result()
            self._failing = None
            self._inflight.popleft()
            phase_times.add("engine.wait", t)
            t = phase_times.start()
            outputs += self._process(sched, result)
            phase_times.add("engine.process", t)
        return outputs

    def _process(self, sched: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        """Append each request's token, detokenize them all in one batch, then each request's
        stop checks and output; a failure in a request's phases fails it alone."""
        sampled = {t.seq_id: t for t in result.sampled}
        outputs: list[RequestOutput] = []
        reqs: list[Request] = []
        groups: dict[str, Request] = {}  # parents of the completions that got a token: one output each
        now = time.monotonic()
        for req, seq in sched.scheduled():
            if not seq.sample or req.finished:
                continue
            try:
                self._append(req, sampled[req.request_id], now)
                reqs.append(req)
            except Exception as exc:  # noqa: BLE001 - this request's own phases: it fails alone
                outputs.append(self._failed_processing(req, exc))
        reqs = [req for req in reqs if not req.finished]  # a sibling's failure ends its whole request
        streams = [self._streams[req.request_id].detok for req in reqs]
        skip = [req.sampling.skip_special_tokens for req in reqs]
        errors = self._detok.step(streams, [req.token_ids for req in reqs], skip)
        for req, error in zip(reqs, errors):
            if req.finished:  # failed with a sibling just now
                continue
            try:
                if error is not None:
                    raise error
                out = self._process_one(req)
            except Exception as exc:  # noqa: BLE001 - this request's own phases: it fails alone
                out = self._failed_processing(req, exc)
            if out is not None:
                outputs.append(out)
            elif req.parent is not None:
                groups[req.parent.request_id] = req.parent
        for parent in groups.values():
            if parent.request_id in self.requests and (self.stream_outputs or parent.finished):
                outputs.append(cast(RequestOutput, self._output(parent)))
        return outputs

    def _failed_processing(self, req: Request, exc: Exception) -> RequestOutput:
        logger.error("request %s failed while its tokens were processed", req.request_id, exc_info=exc)
        return self._fail(req, RequestFailed(f"request {req.request_id} failed: {exc!r}"))

    def _append(self, req: Request, token: Any, now: float) -> None:
        req.num_pending -= 1
        if req.first_token_time is None:
            req.first_token_time = now
        if req.sampling.logprobs is not None and token.logprob is not None:
            req.logprobs.append((token.logprob, token.top_logprobs or []))
        req.token_ids.append(token.token_id)

    def _process_one(self, req: Request) -> RequestOutput | None:
        """One request's detokenized token: its stop checks, its output."""
        self._check_stop(req)
        if req.parent is not None or not (self.stream_outputs or req.finished):
            return None  # a completion's output is its parent's (made once per step by _process)
        return cast(RequestOutput, self._output(req))  # "delta" mode (engine_core): maybe its wire tuple

    def _check_stop(self, req: Request) -> None:
        params, detok = req.sampling, self._streams[req.request_id].detok
        token = req.token_ids[-1]
        if params.stop and detok.delta and (s := detok.cut_at_stop(params.stop)) is not None:
            return self._finish(req, "stop", s)
        if token in params.stop_token_ids:
            return self._finish(req, "stop", token)
        if not params.ignore_eos and token in req.eos_token_ids:
            return self._finish(req, "stop", None)
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return self._finish(req, "length", None)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        req.stop_reason = stop_reason
        self.scheduler.finish(req, reason)

    # ----------------------------------------------------------------- failures
    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """End one request with `error` (its blocks freed; a completion's: its whole request's);
        its last output, finish_reason "abort" and `error` set, without the text still held back."""
        req = req.parent or req
        self.scheduler.finish(req, "abort")
        out = failed_output(req, self._streams, error)
        self._forget(req)
        return out

    def _fail_each(self, failures: list[tuple[Request, Exception]]) -> list[RequestOutput]:
        """_fail for each sequence; a request of several completions fails once."""
        return [self._fail(r, e) for r, e in failures if not (r.parent or r).finished]

    def _contain(self, exc: Exception) -> list[RequestOutput]:
        """A model step raised. The request it names fails alone (SequenceFailed); when it
        names none, the requests of that step fail. Every other unfinished request is
        recomputed, since the failed step (and any in flight with it) may have run in part."""
        sched, self._failing = self._failing, None
        assert sched is not None
        self._abandon_inflight()
        seq_id = failed_seq_id(exc)
        in_step = [req for req, _ in sched.scheduled() if not req.finished]
        culprits = [r for r in in_step if r.request_id == seq_id] or in_step
        logger.error(
            "a model step failed (%s); failing %s, recomputing the other requests",
            exc,
            ", ".join(r.request_id for r in culprits[:8]) + (" ..." if len(culprits) > 8 else ""),
        )
        # The failed step's sequences to forget may not have reached the model: send them again.
        self.scheduler.pending_finished.extend(sched.step.finished)
        outputs = self._fail_each(
            [(r, RequestFailed(f"request {r.request_id} failed in a model step: {exc}")) for r in culprits]
        )
        self.scheduler.recompute_all()
        return outputs

    def _abandon_inflight(self) -> None:  # their requests are recomputed
        self._inflight.clear()
        self._next = None

    def _unblock(self) -> list[RequestOutput]:
        """Nothing runs and nothing could be scheduled: a waiting request needs more blocks
        than the device pool has (the pool shrank after it was admitted). It fails alone with
        OUT_OF_RANGE; with no such request the engine is stuck for another reason."""
        pool = self.scheduler.kv.device.num_blocks
        stuck = [r for r in self.scheduler.waiting if self.scheduler.kv.blocks_to_hold(r.num_tokens + 1) > pool]
        if not stuck:
            raise RuntimeError("scheduler made no progress: a request cannot fit in the KV cache")
        limit = f"{self.scheduler.kv.max_tokens(self.max_model_len + 1) - 1} (max_model_len {self.max_model_len})"
        return self._fail_each(
            [
                (r, OutOfRange(f"request {r.request_id} has {r.num_tokens} tokens; the KV cache holds at most {limit}"))
                for r in stuck
            ]
        )

    def set_max_model_len(self, max_model_len: int) -> list[RequestOutput]:
        """A new limit (the device pool changed size): requests that no longer fit in it fail
        alone with OUT_OF_RANGE, the others finish by length at the new limit."""
        self.max_model_len = max_model_len
        self.scheduler.config = dataclasses.replace(self.scheduler.config, max_model_len=max_model_len)
        unfinished = [*self.scheduler.running, *self.scheduler.swapped, *self.scheduler.waiting]
        limit = f"{max_model_len - 1} (max_model_len {max_model_len})"
        return self._fail_each(
            [
                (
                    r,
                    OutOfRange(
                        f"request {r.request_id} has {r.num_tokens} tokens; after the model service "
                        f"restarted the limit is {limit}"
                    ),
                )
                for r in unfinished
                if r.num_tokens >= max_model_len
            ]
        )

    def _output(self, req: Request) -> RequestOutput | tuple:
        if req.children:
            out: RequestOutput | tuple = group_output(req, self._streams)
        else:
            out = stream_output(req, self._streams[req.request_id], self.stream_outputs)
        if req.finished:
            self._forget(req)
        return out

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        for seq in req.completions:
            self._streams.pop(seq.request_id, None)


def _finished(launched: Any) -> bool:
    """A launched step whose device work is known to be done (False when it cannot tell)."""
    done = getattr(launched, "done", None)
    return done is not None and done()
