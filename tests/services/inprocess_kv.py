"""A KV-cache transport for tests: a KVCacheService in this process behind the client's
KVTransport interface, so the scheduler's KVClient runs against the real service logic without
a gRPC server."""

from __future__ import annotations

from collections.abc import Callable

from kvcache_svc import convert
from kvcache_svc.ops import Op, OpResult
from kvcache_svc.service import KVCacheService
from kvcache_svc.state import KVState


class InProcessTransport:
    """A KVCacheService in this process; ops and results go through the proto conversion
    as they would on the wire."""

    def __init__(self, service: KVCacheService) -> None:
        self.service = service

    def apply_step(self, step: int, ops: list[Op], retry_until: float, timeout: float) -> list[OpResult]:
        wire_ops = [convert.op_from_pb(convert.op_to_pb(op)) for op in ops]
        results = self.service.apply_step(step, wire_ops)
        return [convert.result_from_pb(r) for r in convert.step_response(step, results).results]

    def start_apply_step(
        self, step: int, ops: list[Op], timeout: float, expected: list[OpResult] | None = None
    ) -> Callable[[float], list[OpResult] | None]:
        # Applied when the answer is awaited, i.e. after the caller's model step: the order
        # a slow wire gives, so tests see the engine act on unconfirmed answers. The results
        # are returned for the client to compare (`expected` is not used).
        return lambda retry_until: self.apply_step(step, ops, retry_until, timeout)

    def get_state(self, retry_until: float, timeout: float) -> KVState:
        return convert.state_from_pb(convert.state_to_pb(self.service.get_state()))
