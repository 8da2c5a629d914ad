"""Scheduler: the policy. Who runs this step, how many prompt tokens, whom to preempt and how.

It asks the KV-cache mechanism for blocks and turns the answers into one model step
(`StepInput`): new tokens per sequence, the table diffs and the copy lists. It never touches
tensors or chooses physical blocks.

Policy (as vLLM's): running requests first (decodes and unfinished prompt chunks, oldest
first); when blocks run out the newest running request is preempted, by swapping it to the
host pool or by dropping its blocks to recompute later (the fallback when the host pool is
full). Swapped requests come back before any new request is admitted; new requests are
admitted first-come-first-served with their longest cached prefix, chunked to the token
budget of the step.

Parallel sampling (n > 1, scheduler_svc.request): the parent is scheduled like any request
until its prompt but the last token is computed; then `_fork` gives each child the parent's
blocks by reference and puts the children in the parent's place. A child's first write into
the shared partial last block copies it (copy-on-write, in the step's `copies`), so of n
children the first n - 1 to write copy it once each and the last one keeps the original.
Children beyond max_num_seqs start alone instead, first in the waiting queue (their prompt
blocks come from the prefix cache, where the parent registered them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from contracts.step import PLACEHOLDER, SeqStep, StepInput
from kvcache_svc import KVCacheManager, NoFreeBlocks, Tier
from scheduler_svc.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's limits, taken from an EngineConfig, which has validated them."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption_mode: str = "swap"  # "swap" | "recompute"
    enable_chunked_prefill: bool = True
    max_model_len: int = 1 << 30

    @classmethod
    def of(cls, config: Any, max_model_len: int) -> SchedulerConfig:
        """The scheduler's share of a validated EngineConfig; max_model_len: the smaller of the
        configured one and what the model and the device pool allow."""
        return cls(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.preemption_mode,
            config.enable_chunked_prefill,
            max_model_len,
        )


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduled step: the step the model side gets, and the request behind each of its
    sequences (a request is scheduled at most once a step)."""

    step: StepInput
    requests: dict[str, Request] = field(default_factory=dict)  # seq_id -> request, for step.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.step.seqs)

    def scheduled(self) -> Iterator[tuple[Request, SeqStep]]:
        """The step's sequences in order, each with its request."""
        requests = self.requests
        for seq in self.step.seqs:
            yield requests[seq.seq_id], seq

    def drop_finished(self) -> None:
        """Leave out the requests finished (aborted) since this step was scheduled."""
        self.step.seqs = [seq for seq in self.step.seqs if not self.requests[seq.seq_id].finished]


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.swapped: deque[Request] = deque()
        self.pending_finished: list[str] = []  # sequences the model side may forget
        self.stats = SchedulerStats()

    # ----------------------------------------------------------------- queue
    def add(self, request: Request) -> None:
        needed = self.kv.blocks_to_hold(request.num_prompt_tokens + 1)
        if needed > self.kv.device.num_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens needs {needed} blocks; "
                f"the device pool has {self.kv.device.num_blocks}"
            )
        if request.children and request.feed_end == 0:  # nothing to prefill: the children start alone
            request.forked, request.status = True, RequestStatus.RUNNING
            self.waiting.extend(request.children)
            return
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, request: Request, reason: str) -> None:
        """Stop a request in any state and release its blocks (a parent's: every child's). A
        parent finishes with its last child."""
        if request.finished:
            return
        if request.forked:
            for child in request.children:
                self.finish(child, reason)
            request.status, request.finish_reason = RequestStatus.FINISHED, reason
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        if request.request_id in self.kv.seqs:
            self.kv.free(request.request_id)
        if request.sent_sampling:
            self.pending_finished.append(request.request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        for child in request.children:  # a parent stopped before its fork: its children never ran
            child.status, child.finish_reason = RequestStatus.FINISHED, reason
        parent = request.parent
        if parent is not None and not parent.finished and all(c.finished for c in parent.children):
            parent.status, parent.finish_reason = RequestStatus.FINISHED, parent.children[0].finish_reason

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(StepInput())
        budget = self.config.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and self._finishes_by_length(req):
                i += 1  # its pending token is its last: it finishes when that is read back
                continue
            num_new = min(req.feed_end - req.num_computed_tokens, budget)
            while True:
                result = self.kv.append_slots(req.request_id, req.num_computed_tokens, num_new)
                if not isinstance(result, NoFreeBlocks):
                    break
                victim = self.running[-1]
                self._preempt(victim, out.step)
                preempted = True
                if victim is req:
                    break
            if isinstance(result, NoFreeBlocks):
                break  # req itself was preempted (it was the newest)
            out.step.copies.extend(result.copies)
            req.table_replaced |= bool(result.replaced)
            self._schedule_seq(out, req, num_new)
            budget -= num_new
            i += 1

        if self.swapped and not preempted:
            budget = self._swap_in(out, budget)
        if not self.swapped and not preempted:
            self._admit(out, budget)
        out.step.finished, self.pending_finished = self.pending_finished, []
        self.stats.num_steps += 1
        return out

    def _diff_table(self, req: Request, seq: SeqStep) -> None:
        """Put into `seq` the blocks the model side lacks. Between preemptions a table only
        grows at the end: the blocks from `num_sent_blocks` on are new. Where copy-on-write or a
        swap-in replaced entries (flagged), the whole table goes, from index 0."""
        table = self.kv.block_table(req.request_id)
        if req.table_replaced:
            req.num_sent_blocks, req.table_replaced = 0, False
        elif len(table) <= req.num_sent_blocks:
            return
        first = req.num_sent_blocks
        seq.table_start, seq.table_blocks = first, table[first:]
        req.num_sent_blocks = len(table)

    def _finishes_by_length(self, req: Request) -> bool:
        return (
            req.num_output_tokens + req.num_pending >= req.sampling.max_tokens
            or req.num_tokens + req.num_pending >= self.config.max_model_len
        )

    def _schedule_seq(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        tokens = req.token_ids[start : start + num_new]
        if len(tokens) < num_new:  # the token sampled by the step in flight: fed on the device
            assert len(tokens) + 1 == num_new and req.num_pending, (
                req.request_id,
                len(tokens),
                num_new,
                req.num_pending,
            )
            tokens.append(PLACEHOLDER)
        sample = start + num_new == req.num_tokens + req.num_pending
        if sample:
            req.num_pending += 1
        seq = SeqStep(req.request_id, tokens, start, sample)
        self._diff_table(req, seq)
        if not req.sent_sampling:
            seq.sampling, seq.prompt_token_ids = req.sampling, req.prompt_token_ids
            req.sent_sampling = True
        out.step.seqs.append(seq)
        out.requests[req.request_id] = req

    def _preempt(self, req: Request, step: StepInput) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        if self.config.preemption_mode == "swap":
            copies = self.kv.swap_out(req.request_id)
            if not isinstance(copies, NoFreeBlocks):
                step.swap_out.extend(copies)
                self.stats.num_swapped_out_blocks += len(copies)
                req.status = RequestStatus.SWAPPED
                self.swapped.append(req)
                return
        # Recompute: drop the blocks; the prompt and what was generated are fed again.
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_sent_blocks = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            # Room for the blocks and for what this step writes (a decode token, or the rest of a
            # prompt that was preempted part-way through its prefill), so it can run now.
            num_new = min(req.feed_end - req.num_computed_tokens, budget)
            if self.kv.blocks_to_resume(req.request_id, req.num_computed_tokens + num_new) > self.kv.num_free_blocks(
                Tier.DEVICE
            ):
                break
            copies = self.kv.swap_in(req.request_id)
            assert not isinstance(copies, NoFreeBlocks)
            self.swapped.popleft()
            out.step.swap_in.extend(copies)
            self.stats.num_swapped_in_blocks += len(copies)
            req.table_replaced = True
            result = self.kv.append_slots(req.request_id, req.num_computed_tokens, num_new)
            assert not isinstance(result, NoFreeBlocks)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._schedule_seq(out, req, num_new)
            budget -= num_new
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:  # preempted while its last token is still being read back
                break
            if not self.config.enable_chunked_prefill and req.num_tokens > budget:
                break
            token_bytes = req.prompt_bytes if req.num_tokens == req.num_prompt_tokens else None
            # A parent prefills its prompt but the last token (feed_end).
            tokens = req.token_ids[: req.feed_end] if req.children else req.token_ids
            result = self.kv.allocate(req.request_id, tokens, budget, req.cache_salt, token_bytes)
            if isinstance(result, NoFreeBlocks):
                break  # first come, first served: later requests wait too
            self.waiting.popleft()
            req.prompt_bytes = None  # not kept longer: a re-admission (recompute preemption) converts the tokens
            req.num_computed_tokens = result.num_cached_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = result.num_cached_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._schedule_seq(out, req, result.num_new_tokens)
            budget -= result.num_new_tokens

    def recompute_all(self) -> list[Request]:
        """Drop every unfinished request's blocks and feed it again from the start (prompt +
        generated tokens), oldest first: the model side lost its KV tensors (a restart) or the
        blocks cannot be trusted (a KV resync). Sequences already finished stay in
        pending_finished; a caller whose model side restarted clears them. Returns the
        requests affected."""
        affected = sorted(self.running + list(self.swapped), key=lambda r: r.arrival_time)
        for req in affected:
            if req.request_id in self.kv.seqs:
                self.kv.free(req.request_id)
            req.num_computed_tokens, req.num_sent_blocks, req.status, req.num_pending = 0, 0, RequestStatus.WAITING, 0
        for req in list(self.waiting):
            req.num_sent_blocks = 0
        for req in affected + list(self.waiting):
            req.sent_sampling = False
        self.running, self.swapped = [], deque()
        self.waiting.extendleft(reversed(affected))
        return affected

    # ----------------------------------------------------------------- results
    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts and register newly full blocks in the prefix cache."""
        for req, seq in out.scheduled():
            if req.finished:
                continue
            req.num_computed_tokens += len(seq.token_ids)
            # Steps still in flight may have fed tokens not read back yet: only known tokens hash.
            self.kv.cache_blocks(req.request_id, req.token_ids, min(req.num_computed_tokens, req.num_tokens))
            if req.children and not req.forked and req.num_computed_tokens >= req.feed_end:
                self._fork(req)

    def _fork(self, parent: Request) -> None:
        """The parent's prompt but its last token is in the cache: each child (as many as
        max_num_seqs has room for) takes the parent's blocks by reference and its place in the
        running queue; the parent's own sequence goes (the children hold the blocks)."""
        room = self.config.max_num_seqs - len(self.running) + 1  # the parent's place is one
        forked, later = parent.children[:room], parent.children[room:]
        for child in forked:
            self.kv.fork(parent.request_id, child.request_id)
            child.num_computed_tokens, child.status = parent.num_computed_tokens, RequestStatus.RUNNING
        for child in parent.children:
            child.num_cached_tokens = parent.num_cached_tokens
        self.kv.free(parent.request_id)
        at = self.running.index(parent)
        self.running[at : at + 1] = forked
        self.waiting.extendleft(reversed(later))
        parent.forked = True
        if parent.sent_sampling:
            self.pending_finished.append(parent.request_id)
