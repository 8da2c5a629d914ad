"""ServiceEngine: LLMEngine over the two remote clients, with the failure handling that
service mode needs. Embedded mode never uses it.

One step is still two calls: the KV client's commit (every block op of the step, one
ApplyStep) and the model step. They overlap: ApplyStep is sent first and answered while the
model runs on the blocks the local copy chose (the service must answer the same), and the
step's tokens are used only once both answers are in. Around them:

- A peer that stays down for the retry window: the step is kept (`pending`) and the engine
  returns no outputs; the next step() (after queued adds and aborts are applied) tries the
  same step again. Requests whose deadline passes meanwhile are failed by the front end.
- A model service with a new epoch (it restarted): the KV pools are reset to the new epoch
  and every unfinished request is recomputed from its prompt and generated tokens. Limits
  that follow from the pool (max_model_len) are taken from the new epoch: a request that no
  longer fits fails alone with OUT_OF_RANGE.
- A model step that fails for another reason: the request it names fails alone, else those
  of the step (LLMEngine._contain); the others are recomputed.
- A KV service out of step with the local copy: the client resyncs, and the requests are
  recomputed on the resynced state (the model's answer for that step is dropped).
- A KV service down while the model answered: the model's answer is kept with the step and
  used once a later commit gets through (the model step is not run twice).

Pipelined (`async_scheduling` in the scheduler section; by default on when the model service
runs on a GPU): steps go to
the model service over one StepStream, in order, without waiting. Step k is sent, then this
process reads back step k-2, schedules step k+1 (tokens still being sampled go as
placeholders, which the model service resolves from each sequence's latest sample) and sends
it, so the model service always has the next step queued behind the one running. Any
failure with steps in flight drains them and recomputes every unfinished request (a model
restart, a peer down, a KV resync alike): simpler than keeping the retries of several steps
apart, and greedy requests end with the same tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from contracts import phase_times
from contracts.rpc import freeze_heap
from contracts.sampling_params import RequestLimits
from contracts.step import StepInput, StepOutput
from contracts.tokenizer import load_tokenizer
from kvcache_svc.client import KVClient, KVOutOfSync, KVUnavailable
from kvcache_svc.ops import PoolConfig
from model_svc.client import ModelRestarted, ModelUnavailable, RemoteModel, StreamedStep
from scheduler_svc.config import EngineConfig
from scheduler_svc.engine import LLMEngine
from scheduler_svc.outputs import RequestOutput
from scheduler_svc.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def pool_config(model: RemoteModel, enable_prefix_caching: bool) -> PoolConfig:
    info = model.info
    assert info is not None
    return PoolConfig(
        info.num_device_blocks,
        info.num_host_blocks,
        info.block_size,
        enable_prefix_caching,
        info.epoch,
        info.kv_group_windows,
    )


class _RemoteStep:
    """A pipelined step in flight: its KV batch and model Step sent. result() waits for both
    (the KV answer first); once it returns or raises, nothing of the step is pending."""

    def __init__(self, engine: ServiceEngine, wait_kv: Callable[[], None], model: StreamedStep) -> None:
        self.engine, self.model = engine, model
        self.wait_kv: Callable[[], None] | None = wait_kv  # None once awaited

    def await_kv(self) -> None:
        if self.wait_kv is not None:
            wait, self.wait_kv = self.wait_kv, None
            try:
                wait()
            except BaseException:
                self.settle()
                raise

    def result(self) -> StepOutput:
        self.await_kv()
        out = self.model.result()
        self.engine.num_steps += 1
        self.engine.unavailable = None  # a step went through: the peers are back
        return out

    def settle(self) -> None:
        """Wait for what is still pending, whatever its outcome."""
        for wait in (self.model.result, self.wait_kv):
            if wait is not None:
                with contextlib.suppress(Exception):  # the failure being handled, or one like it
                    wait()
        self.wait_kv = None


class ServiceEngine(LLMEngine):
    def __init__(self, config: EngineConfig, model: RemoteModel, kv: KVClient, tokenizer: Any) -> None:
        super().__init__(config, model=model, tokenizer=tokenizer, model_config=model.config, kv=kv)
        self.model: RemoteModel
        self.kv: KVClient
        self.deadlines: dict[str, float] = {}  # request id -> monotonic deadline (set by the front end)
        self.unavailable: str | None = None  # why the last step could not run, while that lasts
        self._pending: SchedulerOutput | None = None  # scheduled, not yet run by the model
        self._result: StepOutput | None = None  # the model's answer for _pending, its KV commit not yet confirmed
        self._restarted = False  # the model came back empty: recompute before the next step
        self._failed: list[RequestOutput] = []  # requests failed by a recovery, returned by the next step()
        self.num_steps = 0
        self.num_recoveries = 0
        pipelined = config.async_scheduling
        if pipelined is None:  # as embedded mode: on when the steps run on a GPU
            pipelined = model.info is not None and model.info.device.startswith("cuda")
        self.pipelined = bool(pipelined)

    def reset_prefix_cache(self) -> int:
        raise NotImplementedError(
            "the KV-cache service owns the prefix index; restart it (or its store) for a cold cache"
        )

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or self.kv.has_pending() or self._pending is not None or self._restarted

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        self._failing = None
        outputs = self._step_pipelined() if self.pipelined else self._step_once()
        failed, self._failed = self._failed, []
        return failed + outputs

    def _step_once(self) -> list[RequestOutput]:
        try:
            if self._restarted:
                self._recompute_after_restart()
            sched = self._pending or self.scheduler.schedule()
            self._pending = sched
            sched.drop_finished()
            timeout = self._timeout(sched)
            inp = sched.step
            if inp.is_empty():
                self.kv.commit(timeout)
                self._pending, self.unavailable = None, None
                if self.scheduler.has_unfinished() and not self.scheduler.running:
                    return self._unblock()
                return []
            if self._result is None:
                self._failing = sched
                self._result = self._run_model(inp, timeout)
                self._failing = None
            else:  # the model ran this step already; only its KV commit is owed
                self.kv.commit(timeout)
            result = self._result
        except ModelRestarted as exc:
            return self._on_restart(str(exc))
        except (KVUnavailable, ModelUnavailable) as exc:
            if self.unavailable is None:
                logger.warning("step waits for a peer: %s", exc)
            self.unavailable = str(exc)
            return []
        except KVOutOfSync as exc:
            self._recompute_after_resync(str(exc))
            return []
        except Exception as exc:  # unexpected: not retried
            self._pending, self._result = None, None
            if self._failing is None:  # not the model's answer (the front end fails the open streams)
                raise
            return self._contain(exc)
        self._pending, self._result, self.unavailable = None, None, None
        self.num_steps += 1
        # The step's computed tokens and full blocks first (as overlapped scheduling does at
        # launch): a request that the results finish still registers the prompt it computed.
        self.scheduler.update(sched)
        return self._process(sched, result)

    def _step_pipelined(self) -> list[RequestOutput]:
        """The embedded engine's overlapped step (LLMEngine._step_overlapped) over the remote
        peers: _launch sends the step, _idle_step flushes the KV ops."""
        try:
            if self._restarted:
                self._recompute_after_restart()
            if self._next is not None:
                self._next.drop_finished()  # aborted since it was scheduled
            return self._step_overlapped()
        except (ModelRestarted, ModelUnavailable, KVUnavailable, KVOutOfSync) as exc:
            self._abandon_pipeline(exc)
            return []
        except Exception as exc:
            if self._failing is None:
                self._settle()
                raise
            return self._contain(exc)

    def _launch(self, sched: SchedulerOutput) -> _RemoteStep:
        timeout = self._timeout(sched)
        t = phase_times.start()
        if self._inflight:
            self._inflight[-1][1].await_kv()  # one KV batch in flight at a time
        phase_times.add("engine.kv_wait", t)
        wait_kv = self.kv.start_commit(timeout)
        return _RemoteStep(self, wait_kv, self.model.launch(sched.step, timeout))

    def _idle_step(self) -> None:
        self.kv.commit()

    def _abandon_inflight(self) -> None:
        self._settle()

    def _settle(self) -> None:
        """Wait for whatever is in flight (its outcome no longer matters) and forget it."""
        inflight, self._next = list(self._inflight), None
        self._inflight.clear()
        for _, step in inflight:
            step.settle()

    def _abandon_pipeline(self, exc: Exception) -> None:
        """A peer failed with steps in flight: drop them and recompute every unfinished request
        (their sampled-but-unread tokens are sampled again)."""
        self._settle()
        if isinstance(exc, ModelRestarted):
            self._on_restart(str(exc))
            return
        if isinstance(exc, KVOutOfSync):
            self._recompute_after_resync(str(exc))
            return
        if self.unavailable is None:
            logger.warning("step waits for a peer: %s", exc)
        self.unavailable = str(exc)
        self.scheduler.recompute_all()
        self.num_recoveries += 1

    def _run_model(self, inp: StepInput, timeout: float | None) -> StepOutput:
        """The model step with the step's ApplyStep in flight (it hides the ApplyStep round
        trip, ~1-2.5 ms a step on the CPU). Returns the model's answer once the KV service
        has confirmed the step; a KV error wins over the model's (as when the KV call came
        first and the model was never called). A model answer whose KV commit fails is
        kept in self._result, so the retry does not run the model twice."""
        wait_kv = self.kv.start_commit(timeout)
        try:
            result = self.model.step(inp, timeout)
        except BaseException:
            wait_kv()  # must be awaited before any other commit; its error, if any, replaces the model's
            raise
        self._result = result
        wait_kv()
        return result

    def _timeout(self, sched: SchedulerOutput) -> float | None:
        """The time left of the latest client deadline among the step's requests (None when
        one of them has none): the internal calls may not take longer than that."""
        # The front end edits the dict; a completion of n > 1 has its request's deadline.
        deadlines = [self.deadlines.get((req.parent or req).request_id) for req, _ in sched.scheduled()]
        known = [d for d in deadlines if d is not None]
        if not known or len(known) < len(deadlines):
            return None
        return max(0.05, max(known) - time.monotonic())

    # ----------------------------------------------------------------- recovery
    def _on_restart(self, why: str) -> list[RequestOutput]:
        logger.warning("model service restarted (%s): recomputing", why)
        self._pending, self._result, self._restarted = None, None, True  # the next step recomputes (and retries that)
        return []

    def _recompute_after_restart(self) -> None:
        """New epoch: its KV tensors are empty, so reset the pools (no stale prefix hits) and
        feed every unfinished request again."""
        self.model.connect(self.model.retry_window_s)  # ModelUnavailable: try again next step
        self.kv.reset(pool_config(self.model, self.config.enable_prefix_caching))
        self.scheduler.recompute_all()
        self.scheduler.pending_finished.clear()  # the new model process knows no sequence
        self._failed += self.set_max_model_len(self._max_model_len(self.model, self.config))
        self._restarted = False
        self.num_recoveries += 1
        self.kv.commit()

    def _recompute_after_resync(self, why: str) -> None:
        """The local KV copy was replaced by the service's: no request may keep blocks it
        believes it has. The model side is intact, so finished sequences are still forgotten."""
        logger.warning("KV-cache resync (%s): recomputing", why)
        self._pending, self._result = None, None
        self.scheduler.recompute_all()
        for seq_id in list(self.kv.seqs):
            self.kv.free(seq_id)
        self.num_recoveries += 1


def build_service_engine(config: Any, skip_tokenizer_init: bool = False, token: str | None = None) -> ServiceEngine:
    """Connect to the model and KV-cache services (waiting for them, bounded by the startup
    timeout) and build the engine. `config` is a service_config.ServiceConfig;
    skip_tokenizer_init: token ids in and out only (benchmarks of models without a tokenizer);
    `token`: the internal token the two services require (contracts.auth)."""
    from kvcache_svc.client import GrpcTransport

    s = config.scheduler
    model = RemoteModel(config.model.address, s.rpc_timeout_s, s.retry_window_s, token)
    deadline = time.monotonic() + s.startup_timeout_s
    model.connect(s.startup_timeout_s)
    kv = KVClient(GrpcTransport(config.kvcache.address, token), s.retry_window_s, s.rpc_timeout_s)
    while True:
        try:
            adopted = kv.connect(pool_config(model, s.enable_prefix_caching))
            break
        except KVUnavailable:
            if time.monotonic() > deadline:
                raise
    leftover = list(kv.seqs) if adopted else []  # a previous scheduler's sequences: nobody will finish them
    for seq_id in leftover:
        kv.free(seq_id)
    kv.commit()
    info = model.info
    assert info is not None
    engine_config = EngineConfig(
        model=config.tokenizer,
        block_size=info.block_size,
        num_gpu_blocks=info.num_device_blocks,
        enable_prefix_caching=s.enable_prefix_caching,
        enable_chunked_prefill=s.enable_chunked_prefill,
        preemption_mode=s.preemption_mode,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
        skip_tokenizer_init=skip_tokenizer_init,
        async_scheduling=s.async_scheduling,
    )
    logger.info(
        "connected: model %s (epoch %s, %d/%d blocks), kvcache %s (%s state)",
        info.model,
        info.epoch,
        info.num_device_blocks,
        info.num_host_blocks,
        config.kvcache.address,
        "adopted" if adopted else "reset",
    )
    engine = ServiceEngine(engine_config, model, kv, None if skip_tokenizer_init else load_tokenizer(config.tokenizer))
    engine.limits = RequestLimits(
        max_logprobs=s.max_logprobs,
        max_n=s.max_n,
        max_stop_strings=s.max_stop_strings,
        max_stop_chars=s.max_stop_chars,
        max_prompt_chars=s.max_prompt_chars,
    )
    engine.scheduler.pending_finished.extend(leftover)  # the model service forgets them with the first step
    freeze_heap()  # start-up is done: full collections would walk torch, gRPC and the tokenizer every few dozen steps
    return engine
