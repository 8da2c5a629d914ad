"""The scheduler sends the model side only the blocks it lacks: between preemptions a block
table only grows at the end, so a decode step carries the new block ids alone (counted by
Request.num_sent_blocks); a table whose entries changed (a swap-in) is sent whole."""

from __future__ import annotations

from contracts.sampling_params import SamplingParams
from contracts.step import SeqStep
from kvcache_svc import KVCacheManager
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def apply_tables(mirror: dict[str, list[int]], seqs: list[SeqStep]) -> None:
    """What the model runner does with a step's tables: block_table[start:] = blocks."""
    for s in seqs:
        if s.table_blocks is not None:
            have = mirror.get(s.seq_id, [])
            assert s.table_start <= len(have), (s.seq_id, s.table_start, have)
            mirror[s.seq_id] = have[: s.table_start] + s.table_blocks


def finish_step(sched: Scheduler, out: SchedulerOutput) -> None:
    for req, seq in out.scheduled():
        if seq.sample and not req.finished:
            req.num_pending -= 1
            req.token_ids.append(7)
    sched.update(out)
    for req in out.requests.values():
        if not req.finished and req.num_output_tokens >= req.sampling.max_tokens:
            sched.finish(req, "length")


def test_a_plain_decode_sends_only_the_new_block_ids():
    kv = KVCacheManager(16, 0, 4, False)
    sched = Scheduler(SchedulerConfig(), kv)
    sched.add(Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    sent: list[tuple[int, list[int] | None]] = []
    while sched.has_unfinished():
        out = sched.schedule()
        (seq,) = out.step.seqs
        sent.append((seq.table_start, seq.table_blocks))
        table = list(kv.block_table("a"))
        finish_step(sched, out)
    # The prefill sends its 2 blocks; decodes send nothing until a token starts a new block,
    # then that block alone.
    assert sent[0] == (0, table[:2])
    assert [b for _, b in sent[1:] if b is not None] == [[table[2]], [table[3]]]
    assert [start for start, b in sent[1:] if b is not None] == [2, 3]
    assert sum(b is None for _, b in sent) == len(sent) - 3


def test_a_swap_in_resends_the_whole_table():
    kv = KVCacheManager(8, 32, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, preemption_mode="swap"), kv)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sched.add(Request("a", list(range(1, 13)), params))
    sched.add(Request("b", list(range(1, 27)), params))
    mirror: dict[str, list[int]] = {}
    swapped_in = 0
    for _ in range(500):
        if not sched.has_unfinished():
            break
        was_swapped = {r.request_id for r in sched.swapped}
        out = sched.schedule()
        apply_tables(mirror, out.step.seqs)
        for seq in out.step.seqs:
            table = kv.block_table(seq.seq_id)
            assert mirror[seq.seq_id] == table  # the model side's copy is right after every step
            if seq.seq_id in was_swapped and out.step.swap_in:
                assert seq.table_start == 0 and seq.table_blocks == table and len(table) > 1
                swapped_in += 1
        finish_step(sched, out)
    assert not sched.has_unfinished()
    assert swapped_in > 0 and sched.stats.num_swapped_in_blocks > 0
    kv.check_invariants()
