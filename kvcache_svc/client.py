"""The scheduler's KV-cache client in service mode.

`KVClient` looks like a KVCacheManager to the scheduler (same methods, same answers): it
keeps a local working copy, which answers at once, and records every mutating op. Once per
engine step `commit()` sends the recorded ops in one numbered ApplyStep call; the service
replays them on its authoritative copy, persists them and answers; the answers must equal
the local ones (the manager is deterministic). A mismatch, or a service that lost its
state, raises KVOutOfSync after resyncing the local copy from the service's state.

`start_commit()` is commit() in two halves, so the engine can run the model step while
ApplyStep is on the wire: the caller acts on local answers the service has not confirmed
yet. A mismatch found for such a batch therefore resets the pools instead of adopting the
service's state (the model may have written blocks the service holds as cached prefixes).

The transport is `GrpcTransport` (tests put a KVCacheService in the same process behind the
same `KVTransport` interface). Embedded mode uses KVCacheManager directly and records nothing.

Per step the client's cost grows with the batch (one AppendSlots op per running sequence),
so the hot path avoids per-op work where it can: the gRPC transport builds the request and
checks the answer on its sender thread, while the engine waits for the model, and checks
it on the wire form (the answer serialized as the local results would be: equal bytes,
equal results), decoding it only when the bytes differ.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from contracts.auth import with_token
from contracts.errors import FailedPrecondition, Unavailable
from contracts.rpc import CHANNEL_OPTIONS, call_with_retry
from kvcache_svc import convert
from kvcache_svc.manager import Allocated, Appended, KVCacheManager, NoFreeBlocks
from kvcache_svc.ops import (
    AllocateOp,
    AppendSlotsOp,
    CacheBlocksOp,
    ForkOp,
    FreeOp,
    Op,
    OpResult,
    PoolConfig,
    ResetOp,
    SwapInOp,
    SwapOutOp,
)
from kvcache_svc.state import KVState, import_state
from protos.picovllm.kvcache.v1 import kvcache_pb2 as pb
from protos.picovllm.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class KVUnavailable(Unavailable):
    """The KV-cache service did not answer within the retry window."""


class KVOutOfSync(FailedPrecondition):
    """The service's answers differ from the local copy's (or it lost its state); the local
    copy has been resynced, and the scheduler must recompute its running requests."""


class KVTransport(Protocol):
    def apply_step(self, step: int, ops: list[Op], retry_until: float, timeout: float) -> list[OpResult]: ...

    def start_apply_step(
        self, step: int, ops: list[Op], timeout: float, expected: list[OpResult] | None = None
    ) -> Callable[[float], list[OpResult] | None]:
        """Send now; the returned function (given the retry deadline) waits for the answer:
        the results, or None when the transport has already found them equal to `expected`."""
        ...

    def get_state(self, retry_until: float, timeout: float) -> KVState: ...


@dataclass(slots=True)
class _Batch:
    step: int
    ops: list[Op]
    expected: list[OpResult]


class KVClient:
    def __init__(self, transport: KVTransport, retry_window_s: float = 1.0, rpc_timeout_s: float = 30.0) -> None:
        self._manager: KVCacheManager | None = None
        self.transport = transport
        self.config: PoolConfig | None = None
        self.retry_window_s = retry_window_s
        self.rpc_timeout_s = rpc_timeout_s
        self._ops: list[Op] = []
        self._expected: list[OpResult] = []
        self._batches: deque[_Batch] = deque()
        self._next_step = 1
        self._needs_resync = False
        self._unconfirmed = False  # local answers were acted on before the service confirmed them
        self.num_commits = 0
        self.commit_seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        # Reads (seqs, block_table, num_free_blocks, device, ...) go to the local copy.
        return getattr(self._local(name), name)

    def _local(self, name: str) -> KVCacheManager:
        manager = self.__dict__.get("_manager")
        if manager is None:
            raise AttributeError(f"KVClient has no pools yet (reading {name!r}); call connect() first")
        return manager

    @property
    def manager(self) -> KVCacheManager:
        assert self._manager is not None, "connect() first"
        return self._manager

    # The reads the scheduler makes per sequence and step, forwarded without the __getattr__
    # fallback (which costs a failed lookup first).
    @property
    def seqs(self) -> dict:
        return self._local("seqs").seqs

    def block_table(self, seq_id: str) -> list[int]:
        return self._local("block_table").block_table(seq_id)

    def num_blocks_for(self, num_tokens: int) -> int:
        return self._local("num_blocks_for").num_blocks_for(num_tokens)

    # ----------------------------------------------------------------- recorded ops
    def _record(self, op: Op, expected: OpResult) -> None:
        self._ops.append(op)
        self._expected.append(expected)

    def allocate(
        self,
        seq_id: str,
        token_ids: list[int],
        num_new_tokens: int,
        extra_key: str | None = None,
        token_bytes: bytes | None = None,
    ) -> Allocated | NoFreeBlocks:
        result = self.manager.allocate(seq_id, token_ids, num_new_tokens, extra_key, token_bytes)
        if not isinstance(result, NoFreeBlocks):  # a refusal changes nothing: nothing to send
            # block_ids is the live table: keep a copy of what the answer must be.
            self._record(
                AllocateOp(seq_id, list(token_ids), num_new_tokens, extra_key),
                Allocated(result.num_cached_tokens, result.num_new_tokens, list(result.block_ids)),
            )
        return result

    def append_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> Appended | NoFreeBlocks:
        # Called for every running sequence every step: _record inlined.
        result = self.manager.append_slots(seq_id, num_computed_tokens, num_new_tokens)
        if not isinstance(result, NoFreeBlocks):
            self._ops.append(AppendSlotsOp(seq_id, num_computed_tokens, num_new_tokens))
            self._expected.append(result)
        return result

    def cache_blocks(self, seq_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        manager = self.manager
        seq = manager.seqs[seq_id]
        before = seq.num_hashed_blocks
        bs = manager.block_size
        if num_computed_tokens // bs <= before:  # no block became full: the manager would change nothing
            return
        manager.cache_blocks(seq_id, token_ids, num_computed_tokens)
        after = seq.num_hashed_blocks
        if after != before:  # e.g. no prefix caching, or swapped out: nothing to send
            self._record(
                CacheBlocksOp(seq_id, before * bs, list(token_ids[before * bs : after * bs]), num_computed_tokens), None
            )

    def free(self, seq_id: str) -> None:
        self.manager.free(seq_id)
        self._record(FreeOp(seq_id), None)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.manager.fork(parent_id, child_id)
        self._record(ForkOp(parent_id, child_id), None)

    def swap_out(self, seq_id: str) -> list[tuple[int, int]] | NoFreeBlocks:
        result = self.manager.swap_out(seq_id)
        if not isinstance(result, NoFreeBlocks):
            self._record(SwapOutOp(seq_id), result)
        return result

    def swap_in(self, seq_id: str) -> list[tuple[int, int]] | NoFreeBlocks:
        result = self.manager.swap_in(seq_id)
        if not isinstance(result, NoFreeBlocks):
            self._record(SwapInOp(seq_id), result)
        return result

    def reset(self, config: PoolConfig) -> None:
        """Empty pools of this geometry/epoch, here and (with the next commit) in the service."""
        self._manager, self.config = config.new_manager(), config
        self._record(ResetOp(config), None)

    # ----------------------------------------------------------------- sync
    def connect(self, config: PoolConfig) -> bool:
        """Start from the service's state when it holds pools of exactly this geometry and
        epoch (True: the caller frees sequences it does not know), else reset them."""
        state = self.transport.get_state(time.monotonic() + self.retry_window_s, self.rpc_timeout_s)
        self._drop_pending(state.step)
        if state.config == config:
            self._manager, self.config = import_state(state), config
            return True
        self.reset(config)
        return False

    def has_pending(self) -> bool:
        return bool(self._ops or self._batches or self._needs_resync)

    def commit(self, timeout: float | None = None) -> None:
        """Send what was recorded since the last commit (and any batch a failed commit left),
        in order. Raises KVUnavailable when the service stays down for the retry window
        (the batches are kept and re-sent next time) and KVOutOfSync after a resync."""
        self._commit(timeout, None)

    def start_commit(self, timeout: float | None = None) -> Callable[[], None]:
        """Send the recorded batch now and return a function that waits for its answer and
        raises what commit() raises. The caller may act on the local answers meanwhile (see
        the module docstring); it must call the function before the next commit. Ops
        recorded after this call are not part of it: they go with the next commit (the
        pipelined engine records step k+1's ops before it waits for step k's answer)."""
        start = time.monotonic()
        sent = None
        if not self._needs_resync:
            self._seal()
            if len(self._batches) == 1:  # the usual case; re-sends of older batches go one by one in _commit
                batch = self._batches[0]
                sent = self.transport.start_apply_step(
                    batch.step, batch.ops, self._rpc_timeout(timeout), batch.expected
                )
        self.commit_seconds += time.monotonic() - start
        self._unconfirmed = True
        return lambda: self._commit(timeout, sent, seal=False)

    def _seal(self) -> None:
        if self._ops:
            self._batches.append(_Batch(self._next_step, self._ops, self._expected))
            self._next_step += 1
            self._ops, self._expected = [], []

    def _rpc_timeout(self, timeout: float | None) -> float:
        return self.rpc_timeout_s if timeout is None else min(timeout, self.rpc_timeout_s)

    def _commit(
        self, timeout: float | None, sent: Callable[[float], list[OpResult] | None] | None, seal: bool = True
    ) -> None:
        """`sent`: the answer of the first batch, already sent by start_commit() (None from
        it: the transport found the results equal to the batch's expected ones). `seal`:
        send what was recorded meanwhile too (commit()); start_commit()'s wait does not, so
        it never turns into a blocking call for the next step's ops."""
        if self._needs_resync:  # an earlier resync could not reach the service
            self._resync()
            raise KVOutOfSync("resynced from the service after an earlier mismatch")
        if seal:
            self._seal()
        resumed = time.monotonic()
        retry_until = resumed + self.retry_window_s  # from now: the model step may have outlasted a window
        timeout = self._rpc_timeout(timeout)
        try:
            while self._batches:
                batch = self._batches[0]
                try:
                    if sent is not None:
                        results, sent = sent(retry_until), None
                    else:
                        results = self.transport.apply_step(batch.step, batch.ops, retry_until, timeout)
                except FailedPrecondition as exc:
                    self._out_of_sync(f"the service refused step {batch.step}: {exc}")
                if results is not None and results != batch.expected:
                    self._out_of_sync(f"step {batch.step}: the service answered {_first_diff(results, batch.expected)}")
                self._batches.popleft()
                self.num_commits += 1
            self._unconfirmed = False
        finally:
            self.commit_seconds += time.monotonic() - resumed

    def _out_of_sync(self, why: str) -> None:
        logger.error("KV-cache client out of sync: %s; resyncing from the service", why)
        self._needs_resync = True
        self._resync()  # KVUnavailable leaves _needs_resync set: the next commit resyncs
        raise KVOutOfSync(why)

    def _resync(self) -> None:
        """Adopt the service's state when it is of our geometry and epoch, else reset."""
        state = self.transport.get_state(time.monotonic() + self.retry_window_s, self.rpc_timeout_s)
        self._drop_pending(state.step)
        self._needs_resync = False
        # Blocks the caller acted on before confirmation may be cached prefixes in the
        # service's state, now overwritten on the model side: do not adopt their hashes.
        adopt = not self._unconfirmed
        self._unconfirmed = False
        if self.config is not None and state.config == self.config and adopt:
            self._manager = import_state(state)
        elif self.config is not None:
            self.reset(self.config)

    def _drop_pending(self, service_step: int) -> None:
        self._ops, self._expected = [], []
        self._batches.clear()
        self._next_step = service_step + 1


def _first_diff(got: list[OpResult], want: list[OpResult]) -> str:
    if len(got) != len(want):
        return f"{len(got)} results for {len(want)} ops"
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"op {i}: {a!r}, expected {b!r}"
    return "equal"


# ----------------------------------------------------------------- transport
_SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"]
_APPLY_STEP_PATH = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['ApplyStep'].name}"


@dataclass(slots=True)
class _FirstAttempt:
    """ApplyStep's first attempt, made on the sender thread: the request (for retries), and
    the serialized answer or the call's error; `matched`: the answer is the expected one."""

    request: pb.ApplyStepRequest
    raw: bytes | None = None
    error: grpc.RpcError | None = None
    matched: bool = False

    def answer(self) -> bytes:
        if self.error is not None:
            raise self.error
        assert self.raw is not None
        return self.raw


def _results(raw: bytes) -> list[OpResult]:
    return [convert.result_from_pb(r) for r in pb.ApplyStepResponse.FromString(raw).results]


class GrpcTransport:
    """The KV-cache service over gRPC (a blocking channel: the engine loop runs in a thread).
    ApplyStep's answer is taken serialized (see the module docstring)."""

    def __init__(self, address: str, token: str | None = None) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.KVCacheServiceStub(self.channel)
        # `token`: the internal token, presented on every call (contracts.auth).
        self._apply_step_raw = with_token(
            self.channel.unary_unary(
                _APPLY_STEP_PATH,
                request_serializer=pb.ApplyStepRequest.SerializeToString,
                response_deserializer=None,
                _registered_method=True,
            ),
            token,
        )
        self._get_state = with_token(self.stub.GetState, token)
        self._what = f"kvcache {address} ApplyStep"
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-apply-step")

    def apply_step(self, step: int, ops: list[Op], retry_until: float, timeout: float) -> list[OpResult]:
        raw = call_with_retry(
            self._apply_step_raw, convert.step_request(step, ops), retry_until, timeout, self._what, KVUnavailable
        )
        return _results(raw)

    def start_apply_step(
        self, step: int, ops: list[Op], timeout: float, expected: list[OpResult] | None = None
    ) -> Callable[[float], list[OpResult] | None]:
        # The first attempt runs on a long-lived sender thread while the caller runs the
        # model step; a failed one is retried when awaited. Not a gRPC `.future()`: it starts
        # a thread per call, far slower to issue than the hand-off (bench/NOTES.md).
        job = self._sender.submit(self._first_attempt, step, ops, timeout, expected)

        def wait(retry_until: float) -> list[OpResult] | None:
            first = job.result()
            raw = call_with_retry(
                self._apply_step_raw, first.request, retry_until, timeout, self._what, KVUnavailable, first.answer
            )
            if first.matched and raw is first.raw:
                return None
            return _results(raw)

        return wait

    def _first_attempt(
        self, step: int, ops: list[Op], timeout: float, expected: list[OpResult] | None
    ) -> _FirstAttempt:
        """On the sender thread: build and send the request; compare the answer with what the
        expected results serialize to (the service builds its answer the same way)."""
        first = _FirstAttempt(convert.step_request(step, ops))
        try:
            first.raw = self._apply_step_raw(first.request, timeout=timeout)
        except grpc.RpcError as err:
            first.error = err
            return first
        first.matched = expected is not None and first.raw == convert.step_response(step, expected).SerializeToString()
        return first

    def get_state(self, retry_until: float, timeout: float) -> KVState:
        resp = call_with_retry(
            self._get_state,
            pb.GetStateRequest(),
            retry_until,
            timeout,
            f"kvcache {self.address} GetState",
            KVUnavailable,
        )
        return convert.state_from_pb(resp.state)

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        self.channel.close()
