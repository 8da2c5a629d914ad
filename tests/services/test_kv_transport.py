"""The KV-cache transport without servers (pure Python, no torch): the recording client is
transparent to the scheduler, the service's authoritative copy equals the local one after
every commit, retries are idempotent, mismatches are caught and resynced, and the Redis
store reloads exactly the state it was given."""

from __future__ import annotations

import dataclasses
import random

import pytest

from contracts.errors import FailedPrecondition, Unavailable
from contracts.sampling_params import SamplingParams
from kvcache_svc import KVCacheManager, Tier
from kvcache_svc.client import KVClient, KVOutOfSync
from kvcache_svc.ops import AllocateOp, FreeOp, PoolConfig
from kvcache_svc.service import KVCacheService, StepOutOfOrder
from kvcache_svc.state import export_state
from kvcache_svc.store import MemoryStore, RedisStore
from scheduler_svc.request import Request
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from tests.services.inprocess_kv import InProcessTransport

BS = 4
CONFIG = PoolConfig(num_device_blocks=24, num_host_blocks=12, block_size=BS, enable_prefix_caching=True, epoch="e1")
# A hybrid model's pools: a full and a sliding-window KV group (contracts.kv_groups).
GROUPS = dataclasses.replace(CONFIG, group_windows=(0, 5))


def state_of(manager: KVCacheManager, config: PoolConfig = CONFIG):
    s = export_state(manager, config, 0)
    s.seqs.sort(key=lambda q: q.seq_id)
    for pool in (s.device, s.host):
        pool.blocks.sort(key=lambda b: b.block_id)
    return dataclasses.asdict(s)


def assert_same(client: KVClient, service: KVCacheService) -> None:
    service.manager.check_invariants()
    assert state_of(client.manager) == state_of(service.manager)


def make_client(store=None, config: PoolConfig = CONFIG) -> tuple[KVClient, KVCacheService]:
    service = KVCacheService(store or MemoryStore())
    service.load()
    client = KVClient(InProcessTransport(service))
    assert client.connect(config) is False
    client.commit()
    return client, service


def drive(kv, steps: int, seed: int, preemption_mode: str, after_commit=None, commit=None) -> tuple[list[str], int]:
    """A scheduler over `kv` with a fake model: random prompts (shared prefixes), random
    lengths, random aborts. Returns every step's model input, as text, and the number of
    preemptions. commit: how a KVClient's step is committed (default `kv.commit()`; the
    engine's overlapped way is `kv.start_commit()()`)."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, preemption_mode=preemption_mode), kv)
    prefix = [rng.randrange(100) for _ in range(2 * BS)]
    log, reqs, n = [], {}, 0
    for _ in range(steps):
        if rng.random() < 0.4 and len(reqs) < 12:
            prompt = (prefix if rng.random() < 0.5 else []) + [
                rng.randrange(100) for _ in range(rng.randrange(1, 3 * BS))
            ]
            req = Request(f"r{n}", prompt, SamplingParams(max_tokens=rng.randrange(1, 20)))
            n += 1
            sched.add(req)
            reqs[req.request_id] = req
        if reqs and rng.random() < 0.05:
            sched.finish(reqs.pop(rng.choice(sorted(reqs))), "abort")
        out = sched.schedule()
        if isinstance(kv, KVClient):
            (commit or kv.commit)()
            if after_commit:
                after_commit()
        log.append(repr(out.step))
        for req, seq in out.scheduled():  # the engine's order: read the tokens back, then update
            if seq.sample and not req.finished:
                req.num_pending -= 1
                req.token_ids.append(rng.randrange(100))
                if req.num_output_tokens >= req.sampling.max_tokens:
                    sched.finish(req, "length")
                    reqs.pop(req.request_id, None)
        sched.update(out)
    for req in list(reqs.values()):
        sched.finish(req, "abort")
    if isinstance(kv, KVClient):
        (commit or kv.commit)()
    assert kv.all_free_or_cached()
    return log, sched.stats.num_preemptions


@pytest.mark.parametrize("config", [CONFIG, GROUPS], ids=["one-group", "full+sliding"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_client_is_transparent_and_service_follows(mode, config):
    plain = config.new_manager()
    client, service = make_client(config=config)
    want = drive(plain, 150, seed=7, preemption_mode=mode)
    got = drive(client, 150, seed=7, preemption_mode=mode, after_commit=lambda: assert_same(client, service))
    assert got == want
    assert state_of(client.manager) == state_of(plain)
    assert_same(client, service)
    assert service.step == client.num_commits  # one numbered step per commit, the reset first
    assert got[1] > 0, "the workload must preempt"


def test_retry_of_last_step_is_idempotent_and_gaps_are_refused():
    client, service = make_client()
    ops = [AllocateOp("a", list(range(10)), 10)]
    first = service.apply_step(service.step + 1, ops)
    before = state_of(service.manager)
    assert service.apply_step(service.step, ops) == first  # the answer was lost: same answer
    assert state_of(service.manager) == before
    with pytest.raises(StepOutOfOrder):
        service.apply_step(service.step + 2, [FreeOp("a")])


def test_mismatch_is_detected_and_resynced():
    client, service = make_client()
    client.allocate("a", list(range(9)), 9)
    client.commit()
    service.apply_step(service.step + 1, [AllocateOp("intruder", [1, 2, 3], 3)])  # behind the client's back
    client.allocate("b", list(range(5)), 5)  # local answer differs from the service's now
    with pytest.raises(KVOutOfSync):
        client.commit()
    assert_same(client, service)  # adopted the service's state
    assert "intruder" in client.seqs
    for seq_id in list(client.seqs):
        client.free(seq_id)
    client.commit()
    assert service.manager.all_free_or_cached()


def test_service_that_lost_its_state_gets_reset():
    client, service = make_client()
    client.allocate("a", list(range(9)), 9)
    client.commit()
    fresh = KVCacheService(MemoryStore())  # a restart without Redis
    fresh.load()
    client.transport = InProcessTransport(fresh)
    client.free("a")
    with pytest.raises(KVOutOfSync):
        client.commit()
    assert not client.seqs  # reset: nothing to recompute against
    client.commit()
    assert fresh.config == CONFIG and fresh.manager.all_free_or_cached()


# ----------------------------------------------------------------- Redis
@pytest.mark.parametrize("config", [CONFIG, GROUPS], ids=["one-group", "full+sliding"])
def test_redis_store_reloads_every_step_exactly(redis_server, deployment, config):
    store = RedisStore(redis_server.url, deployment)
    client, service = make_client(store, config)

    def reload_equals():
        again = KVCacheService(RedisStore(redis_server.url, deployment))
        again.load()
        assert again.step == service.step and again.config == service.config
        assert state_of(again.manager) == state_of(service.manager)
        assert again.last_results == service.last_results

    drive(client, 60, seed=3, preemption_mode="swap", after_commit=reload_equals)


def test_restart_after_commit_before_answer_returns_stored_result(redis_server, deployment):
    client, service = make_client(RedisStore(redis_server.url, deployment))
    client.allocate("a", list(range(13)), 13)
    batch_ops = list(client._ops)
    answer = service.apply_step(service.step + 1, batch_ops)  # committed, then "crashed"
    restarted = KVCacheService(RedisStore(redis_server.url, deployment))
    restarted.load()
    client.transport = InProcessTransport(restarted)
    client.commit()  # re-sends the same step: gets the stored answer, no mismatch
    assert restarted.last_results == answer
    assert_same(client, restarted)


def test_store_write_failure_is_unavailable_then_recovers(redis_server, deployment):
    client, service = make_client(RedisStore(redis_server.url, deployment))
    real = service.store.redis
    broken = RedisStore(redis_server.url, deployment, client=_Broken())
    service.store = broken
    client.allocate("a", list(range(9)), 9)
    with pytest.raises(Unavailable):
        client.commit()
    assert client.has_pending()
    service.store = RedisStore(redis_server.url, deployment, client=real)
    client.commit()  # the service reloads what Redis holds, then applies the step again
    assert_same(client, service)


class _Broken:
    def pipeline(self, transaction=True):
        raise ConnectionError("redis is down")


def test_unknown_sequence_makes_the_service_refuse_the_step():
    client, service = make_client()
    with pytest.raises(FailedPrecondition):
        service.apply_step(service.step + 1, [FreeOp("nobody")])


def test_tracked_pools_report_device_and_host_changes(redis_server, deployment):
    client, service = make_client(RedisStore(redis_server.url, deployment))
    client.allocate("a", list(range(8)), 8)
    client.commit()
    assert client.swap_out("a")
    client.commit()
    again = KVCacheService(RedisStore(redis_server.url, deployment))
    again.load()
    assert again.manager.tier("a") == Tier.HOST
    assert state_of(again.manager) == state_of(client.manager)
