"""The router's pieces without a fleet: the policy, the recent-routes memory, the hash chain
against the KV manager's, the KV-cache service's publisher against a real redis-server,
the router section of the config, and `serve router` without a replica to route to."""

from __future__ import annotations

import asyncio
import random
import uuid

import grpc
import pytest

from contracts.block_hash import INDEX_TTL_S, index_keys, prompt_block_hashes
from contracts.service_config import load_config
from kvcache_svc.index import PrefixPublisher
from kvcache_svc.manager import KVCacheManager
from kvcache_svc.ops import PoolConfig
from kvcache_svc.service import KVCacheService
from kvcache_svc.state import new_manager
from kvcache_svc.store import MemoryStore
from router_svc.index import PrefixIndex, RecentRoutes, leading
from router_svc.replicas import Replica, ReplicaSet, choose
from scheduler_svc.client import Client
from tests.services.conftest import ServiceProcess, free_port, wait_for


def replica(address: str, load: int = 0, kv_usage: float = 0.0) -> Replica:
    return Replica(address, None, None, up=True, block_size=16, num_running=load, kv_usage=kv_usage)


# ----------------------------------------------------------------- policy
def test_prefix_policy_takes_the_longest_hit_within_the_imbalance():
    a, b, c = replica("a", load=3), replica("b", load=1), replica("c", load=0)
    assert choose([a, b, c], {"a": 5, "b": 2}, "prefix", max_imbalance=8, turn=0) is a
    # a is more than max_imbalance requests above the least loaded: the least loaded wins
    assert choose([a, b, c], {"a": 5, "b": 2}, "prefix", max_imbalance=2, turn=0) is c
    # equal hits: the less loaded of them
    assert choose([a, b, c], {"a": 5, "b": 5}, "prefix", max_imbalance=8, turn=0) is b
    # a full KV pool takes no prefix-routed request
    full = replica("full", kv_usage=0.99)
    assert choose([full, b], {"full": 9}, "prefix", max_imbalance=8, turn=0) is b


def test_no_hit_goes_to_the_least_loaded_ties_in_turn():
    a, b, c = replica("a"), replica("b"), replica("c", load=2)
    picked = [choose([a, b, c], {}, "prefix", max_imbalance=8, turn=t).address for t in range(4)]
    assert picked == ["a", "b", "a", "b"]


def test_a_replica_without_a_heartbeat_is_not_routed_to():
    a, b, plain = replica("a"), replica("b"), replica("plain")
    a.replica_id, b.replica_id = "ra", "rb"  # publishers; `plain` publishes no index
    a.alive = True
    replicas = ReplicaSet([a, b, plain], poll_interval_s=0.5, down_after_s=2.0, index_ok=True)
    assert replicas.routable() == [a, plain]
    assert replicas.routable({"a"}) == [plain]
    replicas.index_ok = False  # Redis does not answer: every replica that is up, by load alone
    assert replicas.routable() == [a, b, plain]
    replicas.recent.add("a", [1, 2])
    replicas.take_out(a, "gone")
    assert replicas.routable() == [b, plain] and replicas.recent.hits("a", [1, 2]) == 0


def test_round_robin_ignores_hits_and_load():
    a, b = replica("a", load=10), replica("b")
    picked = [choose([a, b], {"b": 9}, "round_robin", max_imbalance=0, turn=t).address for t in range(4)]
    assert picked == ["a", "b", "a", "b"]


def test_recent_routes_count_leading_hashes_until_they_expire():
    recent = RecentRoutes(ttl_s=10.0, max_entries=5)
    recent.add("a", [1, 2, 3], now=0.0)
    assert recent.hits("a", [1, 2, 3, 4], now=1.0) == 3
    assert recent.hits("a", [9, 2, 3], now=1.0) == 0  # a chain: a miss ends the run
    assert recent.hits("b", [1], now=1.0) == 0
    assert recent.hits("a", [1, 2], now=11.0) == 0  # expired
    recent.add("a", [1, 2, 3, 4, 5, 6, 7], now=20.0)
    assert recent.hits("a", [3, 4, 5, 6, 7], now=21.0) == 5  # the oldest two went over max_entries
    assert recent.hits("a", [1], now=21.0) == 0
    recent.forget("a")
    assert recent.hits("a", [3], now=21.0) == 0
    assert leading([True, 1, 0, True]) == 2 and leading([]) == 0


# ----------------------------------------------------------------- the hash chain
def test_router_hashes_equal_the_kv_managers():
    rng = random.Random(0)
    manager = KVCacheManager(64, 0, 16)
    for i, salt in enumerate((None, "tenant")):
        prompt = [rng.randrange(512) for _ in range(16 * 5 + 3)]
        manager.allocate(f"s{i}", prompt, len(prompt), extra_key=salt)
        manager.cache_blocks(f"s{i}", prompt, len(prompt))
        held = [manager.device.blocks[b].block_hash for b in manager.block_table(f"s{i}")[:5]]
        assert prompt_block_hashes(prompt, 16, salt) == held
        # exactly full: the last block is never a hit (its last token is computed)
        assert prompt_block_hashes(prompt[: 16 * 5], 16, salt) == held[:4]


# ----------------------------------------------------------------- the publisher
def test_publisher_follows_the_device_pool(redis_server):
    replica_id = "pub" + uuid.uuid4().hex[:8]
    blocks_key, alive_key = index_keys(replica_id)
    service = KVCacheService(MemoryStore())
    publisher = PrefixPublisher(service, redis_server.url, replica_id)
    r = redis_server.client

    def publish() -> None:
        full, changes = publisher.take()
        publisher.write(full, changes)

    service.manager = new_manager(PoolConfig(8, 0, 4), tracked=True)
    publish()  # a new pool: published whole (empty)
    m = service.manager
    prompt = list(range(13))  # 3 full blocks
    m.allocate("x", prompt, 13)
    m.cache_blocks("x", prompt, 13)
    publish()
    hashes = prompt_block_hashes(prompt, 4, None)
    assert {int(h) for h in r.smembers(blocks_key)} == set(hashes)
    assert r.exists(alive_key) and 0 < r.pttl(blocks_key) <= INDEX_TTL_S * 1000
    m.free("x")  # cached, still held
    m.allocate("y", list(range(100, 132)), 32)  # 8 blocks: every cached one is evicted
    publish()
    assert r.smembers(blocks_key) == set()
    m.free("y")
    # a reset pool (or a reload) is published whole: what Redis had is replaced
    r.sadd(blocks_key, 12345)
    service.manager = new_manager(PoolConfig(8, 0, 4), tracked=True)
    m = service.manager
    m.allocate("z", prompt, 13)
    m.cache_blocks("z", prompt, 13)
    publish()
    assert {int(h) for h in r.smembers(blocks_key)} == set(hashes)
    # the set lost from Redis (expired in a stall): the next write sees it and republishes
    r.delete(blocks_key)
    full, changes = publisher.take()
    assert not full and not publisher.write(full, changes)
    publisher._full = True  # what run() does on a write that found no set
    publish()
    assert {int(h) for h in r.smembers(blocks_key)} == set(hashes)
    publisher.withdraw()
    assert not r.exists(blocks_key) and not r.exists(alive_key)


def test_router_reads_what_was_published(redis_server):
    ids = ["read" + uuid.uuid4().hex[:8] for _ in range(2)]
    redis_server.client.sadd(index_keys(ids[0])[0], 1, 2, 3)
    redis_server.client.sadd(index_keys(ids[1])[0], 1, 5)
    redis_server.client.set(index_keys(ids[0])[1], "{}")

    async def read():
        index = PrefixIndex(redis_server.url)
        try:
            return await index.hits(ids, [1, 2, 3, 4]), await index.alive(ids)
        finally:
            await index.close()

    hits, alive = asyncio.run(read())
    assert hits == {ids[0]: 3, ids[1]: 1}
    assert alive == {ids[0]: True, ids[1]: False}


# ----------------------------------------------------------------- config and CLI
def test_router_section_from_yaml_and_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("router:\n  replicas: [127.0.0.1:7001, 127.0.0.1:7002]\n  policy: round_robin\n")
    config = load_config(path, env={})
    assert config.router.replicas == ("127.0.0.1:7001", "127.0.0.1:7002")
    assert config.router.policy == "round_robin"
    assert load_config(None, env={"PICOVLLM_REPLICAS": "h:1, h:2"}).router.replicas == ("h:1", "h:2")
    for bad, words in (
        ("router: {policy: random}", "router.policy must be one of prefix, round_robin"),
        ("router: {replicas: [h:1, h:1]}", "names a replica twice"),
        ("router: {replicas: [nohost]}", "router.replicas[0] must be host:port"),
    ):
        path.write_text(bad)
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_config(path, env={})


def test_serve_router_without_replicas_says_so(tmp_path):
    proc = ServiceProcess("router", ["--router-addr", f"127.0.0.1:{free_port()}"], tmp_path)
    assert proc.proc.wait(timeout=60) == 2
    assert "no replicas: give --replica HOST:PORT" in proc.tail()


def test_a_router_with_no_replica_up_answers_unavailable(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    args = ["--router-addr", address, "--replica", f"127.0.0.1:{free_port()}", "--router-metrics-port", "0"]
    proc = ServiceProcess("router", args, tmp_path)
    try:
        wait_for(lambda: "router ready" in proc.tail(), 60, "router", proc.proc)
        with Client(address, timeout=10) as c:
            assert not c.wait_ready(1.0)  # health NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                c.complete([1, 2, 3], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "no replica is available; try again later"
    finally:
        proc.kill()
