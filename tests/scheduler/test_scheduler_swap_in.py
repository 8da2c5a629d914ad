"""A request swapped out part-way through its chunked prefill comes back only when the device
pool has room for its blocks and for the rest of the chunk it will run (it used to be brought
back with room for one more block, and the chunk's slots then did not fit)."""

from __future__ import annotations

from contracts.sampling_params import SamplingParams
from kvcache_svc import KVCacheManager
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig


def run_to_completion(sched: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        out = sched.schedule()
        for req, seq in out.scheduled():
            if seq.sample and not req.finished:
                req.num_pending -= 1
                req.token_ids.append(7)
        sched.update(out)
        for req in out.requests.values():
            if not req.finished and req.num_output_tokens >= req.sampling.max_tokens:
                sched.finish(req, "length")
    raise AssertionError("the scheduler did not finish its requests")


def test_swap_in_waits_for_room_for_the_rest_of_a_preempted_prefill():
    kv = KVCacheManager(8, 32, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, preemption_mode="swap"), kv)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sched.add(Request("a", list(range(1, 13)), params))
    sched.add(Request("b", list(range(1, 27)), params))
    run_to_completion(sched)
    assert sched.stats.num_preemptions > 0 and sched.stats.num_swapped_in_blocks > 0
    kv.check_invariants()
    assert kv.all_free_or_cached()
