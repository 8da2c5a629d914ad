"""KVCacheService: the authoritative KVCacheManager behind the KV-cache gRPC service.

Applies each step's recorded block ops in order, persists the step's changes to the
metadata store, and only then answers. Steps are numbered: re-sending the last applied step
returns its stored answer (the crash-after-commit case), a step out of order is refused
(FailedPrecondition: the scheduler resyncs from `get_state`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from contracts.errors import FailedPrecondition, Unavailable
from kvcache_svc import convert
from kvcache_svc.manager import KVCacheManager
from kvcache_svc.ops import (
    Op,
    OpResult,
    PoolConfig,
    ResetOp,
    apply_op,
    seq_ids_of,
)
from kvcache_svc.state import KVState, export_state, import_state, new_manager
from kvcache_svc.store import MemoryStore, RedisStore, clear_dirty
from protos.picovllm.kvcache.v1 import kvcache_pb2 as pb

logger = logging.getLogger(__name__)


class StepOutOfOrder(FailedPrecondition):
    pass


@dataclass(slots=True)
class KVInfo:
    config: PoolConfig | None
    step: int
    num_free_device_blocks: int
    num_free_host_blocks: int
    num_seqs: int
    store: str
    num_prefix_queries: int
    num_prefix_hits: int
    all_free_or_cached: bool


class KVCacheService:
    def __init__(self, store: MemoryStore | RedisStore) -> None:
        self.store = store
        self.config: PoolConfig | None = None
        self.manager: KVCacheManager | None = None
        self.step = 0
        self.last_results: list[OpResult] | None = None
        self.last_response: pb.ApplyStepResponse | None = None  # last_results as sent: built once per step
        self._stale = False  # a failed store write left the manager ahead of the store

    # ----------------------------------------------------------------- load
    def load(self) -> None:
        """Reload the stored state (Redis); with none, or one that does not check out, start
        with no pools (the scheduler's first step resets them)."""
        loaded = self.store.load()
        self.config, self.manager, self.last_results, self.last_response = None, None, None, None
        if loaded is None:
            self._stale = False
            return
        state, blob = loaded
        self.step = state.step
        if state.config is not None:
            try:
                self.manager = import_state(state, tracked=True)
                self.config = state.config
            except ValueError as exc:
                logger.error("stored KV metadata rejected (%s); starting with no pools", exc)
        if blob and self.manager is not None:
            msg = pb.ApplyStepResponse.FromString(blob)
            if msg.step == self.step:
                self.last_results = [convert.result_from_pb(r) for r in msg.results]
                self.last_response = msg
        self._stale = False
        logger.info(
            "KV state loaded: step %d, %s, %d sequences",
            self.step,
            self.config or "no pools",
            len(self.manager.seqs) if self.manager else 0,
        )

    # ----------------------------------------------------------------- steps
    def apply_step(self, step: int, ops: list[Op]) -> list[OpResult]:
        if self._stale:
            self._reload_or_unavailable()
        if step == self.step and self.last_results is not None:
            return self.last_results  # a retry of the step we answered (or crashed answering)
        if step != self.step + 1:
            raise StepOutOfOrder(f"step {step} does not follow the last applied step {self.step}")
        if self.manager is None and not (ops and isinstance(ops[0], ResetOp)):
            raise FailedPrecondition("the KV-cache service has no pools yet: reset first")
        full_write, manager = False, self.manager
        try:
            results: list[OpResult] = []
            for op in ops:
                if isinstance(op, ResetOp):
                    manager, full_write = new_manager(op.config, tracked=True), True
                    self.config, self.manager = op.config, manager
                    results.append(None)
                else:
                    assert manager is not None, "checked above: a step without pools starts with a reset"
                    results.append(apply_op(manager, op))
        except Exception as exc:  # noqa: BLE001 - out of step with the scheduler
            self._drop_state(f"step {step} does not apply: {exc!r}")
            raise FailedPrecondition(f"step {step} does not apply to the KV state ({exc!r}); resync") from None
        response = self._persist(step, ops, results, full_write)
        self.step, self.last_results, self.last_response = step, results, response
        return results

    def response(self, step: int, results: list[OpResult]) -> pb.ApplyStepResponse:
        """The answer to ApplyStep(step): the message persisted with the step when these are
        its results (built once per step, for the store and the reply)."""
        if self.last_response is not None and self.last_response.step == step and results is self.last_results:
            return self.last_response
        return convert.step_response(step, results)

    def _persist(self, step: int, ops: list[Op], results: list[OpResult], full_write: bool) -> pb.ApplyStepResponse:
        response = convert.step_response(step, results)
        try:
            if not self.store.persistent:  # nothing is written: no serialising or exporting
                pass
            elif full_write:
                self.store.write_full(export_state(self.manager, self.config, step), response.SerializeToString())
            else:  # the sequences to rewrite, gathered only for a store that writes them
                assert self.manager is not None, "a step applied to pools"
                dirty_seqs = {seq_id for op in ops for seq_id in seq_ids_of(op)}
                self.store.write_step(self.manager, step, dirty_seqs, response.SerializeToString())
        except Exception as exc:  # redis down or slow: do not answer what is not durable
            self._stale = True
            raise Unavailable(f"metadata store write failed: {exc}") from None
        finally:
            if self.manager is not None:
                clear_dirty(self.manager)
        return response

    def _reload_or_unavailable(self) -> None:
        try:
            self.load()
        except Exception as exc:
            raise Unavailable(f"metadata store unavailable: {exc}") from None

    def _drop_state(self, why: str) -> None:
        """A step that does not apply leaves the manager half changed: go back to what the
        store holds (Redis), or to no pools (memory), and let the scheduler resync."""
        logger.error("%s", why)
        if isinstance(self.store, RedisStore):
            self._stale = True
            try:
                self.load()
                return
            except Exception:  # noqa: BLE001 - retried on the next call
                pass
        self.config, self.manager, self.last_results, self.last_response = None, None, None, None

    # ----------------------------------------------------------------- queries
    def get_state(self) -> KVState:
        if self._stale:
            self._reload_or_unavailable()
        return export_state(self.manager, self.config, self.step)

    def info(self) -> KVInfo:
        m = self.manager
        if m is None:
            return KVInfo(self.config, self.step, 0, 0, 0, self.store.kind, 0, 0, True)
        return KVInfo(
            self.config,
            self.step,
            m.device.num_free_blocks,
            m.host.num_free_blocks,
            len(m.seqs),
            self.store.kind,
            m.num_prefix_queries,
            m.num_prefix_hits,
            m.all_free_or_cached(),
        )

    def check_invariants(self) -> str | None:
        """None when the invariant holds, else the first violation."""
        if self.manager is None:
            return None
        try:
            self.manager.check_invariants()
        except AssertionError as exc:
            return str(exc) or "invariant violated"
        return None
