"""Two replica groups (`serve all` each, stories260k on the CPU) publishing to one throwaway
redis-server, behind `serve router`, real processes on loopback; a third group with the
whole KV pool is the one engine to compare with.

The workload: 8 tenants' 256-token system prompts x 16 requests each, shuffled, 4 at a
time. Each replica's pool holds about half the tenants' prefixes, the one engine's all
of them: the prefix router keeps each tenant on one replica, round-robin spreads every
tenant over both and evicts.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
import uuid

import grpc
import pytest

from bench.router import group_args, make_workload, router_args, run_workload, scheduler_address, summarize
from contracts.block_hash import index_keys, prompt_block_hashes
from contracts.health import check_health
from contracts.service_config import BUNDLED_MODEL
from contracts.tokenizer import load_tokenizer
from scheduler_svc.client import Client
from tests.services.conftest import ServiceProcess, free_port, wait_for

REPLICA_BLOCKS = 112  # 7 tenants' prefixes (16 blocks each) at most, with the running requests' own
WORK = make_workload(tenants=8, per_tenant=16, prefix_tokens=256, max_suffix=24, vocab=512, seed=0)


class Fleet:
    def __init__(self, tmp, redis_url: str) -> None:
        run = uuid.uuid4().hex[:8]
        self.redis_url = redis_url
        env = {"PICOVLLM_REDIS_URL": redis_url}
        self.group_args = {
            "single": group_args(f"single-{run}", 2 * REPLICA_BLOCKS, "cpu", publish=False),
            "a": group_args(f"a-{run}", REPLICA_BLOCKS, "cpu"),
            "b": group_args(f"b-{run}", REPLICA_BLOCKS, "cpu"),
        }
        self.addr = {name: scheduler_address(args) for name, args in self.group_args.items()}
        self.replica_id = {name: args[args.index("--deployment") + 1] for name, args in self.group_args.items()}
        replicas = [self.addr["a"], self.addr["b"]]
        self.router_args = {p: router_args(replicas, p) for p in ("prefix", "round_robin")}
        self.router = {p: args[1] for p, args in self.router_args.items()}
        self.metrics_port = {p: int(args[3]) for p, args in self.router_args.items()}
        self.procs: dict[str, ServiceProcess] = {}
        try:
            for name, args in self.group_args.items():
                self.procs[name] = ServiceProcess("all", args, tmp, env)
            for policy, args in self.router_args.items():
                self.procs[policy] = ServiceProcess("router", args, tmp, env)
            for name in self.group_args:
                self.wait(name, self.addr[name])
            for policy in self.router:
                self.wait(policy, self.router[policy])
                for replica in replicas:
                    wait_for(lambda p=policy, r=replica: self.routable(p, r), 30, f"{policy} router sees {replica}")
        except BaseException:
            self.close()
            raise

    def wait(self, name: str, address: str, timeout: float = 180) -> None:
        proc = self.procs[name]
        try:
            wait_for(lambda: check_health(address, timeout=0.5), timeout, name, proc.proc)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{exc}\n--- {name} log ---\n{proc.tail()}") from None

    def metric(self, policy: str, name: str, replica: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port[policy]}/metrics", timeout=5) as r:
            text = r.read().decode()
        found = re.search(rf'^{name}{{replica="{re.escape(replica)}"}} (\S+)$', text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def routable(self, policy: str, replica: str) -> bool:
        return self.metric(policy, "picovllm_router_replica_up", replica) == 1.0

    def routed(self, policy: str, replica: str) -> float:
        return self.metric(policy, "picovllm_router_requests_total", replica)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, redis_server):
    f = Fleet(tmp_path_factory.mktemp("fleet"), redis_server.url)
    yield f
    f.close()


def test_prefix_routing_keeps_the_single_engines_hit_rate(fleet):
    results, outputs = {}, {}
    for case, address in (
        ("single", fleet.addr["single"]),
        ("prefix", fleet.router["prefix"]),
        ("round_robin", fleet.router["round_robin"]),
    ):
        outcomes, elapsed = run_workload(address, WORK, concurrency=4, max_tokens=8, salt=case, timeout=120)
        results[case] = summarize(outcomes, elapsed)
        outputs[case] = [o.token_ids for o in outcomes]
        assert results[case]["errors"] == 0, (case, [o.error for o in outcomes if o.error])
    print({case: round(s["hit_rate"], 3) for case, s in results.items()})
    single, prefix, rr = (results[c]["hit_rate"] for c in ("single", "prefix", "round_robin"))
    assert single > 0.8  # the one engine holds every tenant's prefix
    assert prefix >= 0.9 * single, results
    assert rr < prefix, results  # the baseline: every tenant on both replicas, evicting each other
    assert outputs["prefix"] == outputs["single"]
    assert outputs["round_robin"] == outputs["single"]
    assert all(len(ids) == 8 for ids in outputs["single"])
    for replica in ("a", "b"):  # both replicas served (the fleet, not one engine)
        assert fleet.routed("prefix", fleet.addr[replica]) > 0


def test_text_prompts_hash_as_the_replica_does(fleet, redis_server):
    """The router's hashes of a text prompt (its tokenizer, the chain of contracts.block_hash)
    are the ones the replica that served it published; the second request hits there."""
    text = "Once upon a time, there was a little girl named Lily who loved to play outside. " * 6
    with Client(fleet.router["prefix"], timeout=60) as c:
        _, _, first = c.complete(text, temperature=0.0, max_tokens=4)
        _, _, second = c.complete(text, temperature=0.0, max_tokens=4)
        info = c.model_info()
        fleet_load = c.load()
    assert fleet_load.replica_id == "" and 0.0 <= fleet_load.kv_usage <= 1.0  # the fleet's
    for name, replica_id in (("a", fleet.replica_id["a"]), ("single", "")):  # publishing or not
        with Client(fleet.addr[name], timeout=10) as c:
            load = c.load()
        assert load.replica_id == replica_id and load.num_waiting >= 0 and 0.0 <= load.kv_usage <= 1.0
    assert info.block_size == 16
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 16 * ((second.usage.prompt_tokens - 1) // 16)  # the same replica
    hashes = prompt_block_hashes(load_tokenizer(BUNDLED_MODEL).encode(text), info.block_size, None)
    assert len(hashes) >= 4

    def published() -> bool:
        return any(all(redis_server.client.smismember(index_keys(fleet.replica_id[r])[0], hashes)) for r in ("a", "b"))

    wait_for(published, 5, "the prompt's blocks in a replica's published index")


def test_abort_and_deadlines_reach_the_replica(fleet):
    with Client(fleet.router["prefix"], timeout=60) as c:
        stream = c.generate([1, 2, 3, 4, 5], request_id="abort-me", max_tokens=400, ignore_eos=True, temperature=0.0)
        first = next(stream)
        assert first.request_id == "abort-me"
        c.abort("abort-me")
        rest = list(stream)
        assert rest and rest[-1].finish_reason == 3  # FINISH_REASON_ABORT
        with pytest.raises(grpc.RpcError) as err:
            c.abort("abort-me")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with Client(fleet.router["prefix"], timeout=0.5) as c, pytest.raises(grpc.RpcError) as err:
        c.complete([1, 2, 3, 4, 5], max_tokens=400, ignore_eos=True, temperature=0.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # the caller's deadline, through the router


def test_the_http_gateway_points_at_the_router_unchanged(fleet, tmp_path):
    import openai

    from tests.http.conftest import http_ok

    port = free_port()
    gateway = ServiceProcess(
        "http", ["--scheduler-addr", fleet.router["prefix"], "--host", "127.0.0.1", "--port", str(port)], tmp_path
    )
    try:
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 60, "the gateway", gateway.proc)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert [m.id for m in api.models.list().data] == ["stories260k"]
        reply = api.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=12, temperature=0)
        with Client(fleet.addr["single"], timeout=60) as c:
            text, _, _ = c.complete("Once upon a time", max_tokens=12, temperature=0.0)
        assert reply.choices[0].text == text  # what one engine answers
    finally:
        gateway.kill()


def test_sigterm_lets_the_streams_in_flight_finish(fleet, tmp_path):
    args = router_args([fleet.addr["a"], fleet.addr["b"]], "prefix")
    router = ServiceProcess("router", args, tmp_path, {"PICOVLLM_REDIS_URL": fleet.redis_url})
    try:
        wait_for(lambda: check_health(args[1], timeout=0.5), 60, "a third router", router.proc)
        with Client(args[1], timeout=60) as c:
            stream = c.generate([7, 8, 9], max_tokens=120, ignore_eos=True, temperature=0.0)
            first = next(stream)
            router.proc.terminate()
            wait_for(lambda: not check_health(args[1], timeout=0.5), 10, "the router not serving")
            with pytest.raises(grpc.RpcError) as err:
                c.complete([1, 2, 3], max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
        assert rest[-1].finish_reason == 2  # LENGTH: it ran to its end
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 120
        assert router.proc.wait(timeout=30) == 0
    finally:
        router.kill()


def test_kill_a_replica_mid_run_then_it_rejoins(fleet, redis_server):
    work = make_workload(tenants=8, per_tenant=6, prefix_tokens=256, max_suffix=24, vocab=512, seed=1)
    victim = fleet.addr["a"]
    done: list = []
    run = threading.Thread(
        target=run_workload, args=(fleet.router["prefix"], work, 4, 24), kwargs={"salt": "kill", "outcomes": done}
    )
    run.start()
    wait_for(lambda: len(done) >= 8, 120, "the first requests")
    fleet.procs["a"].kill()  # SIGKILL to the whole group
    killed = time.monotonic()
    time.sleep(5.0)
    routed_after_5s = fleet.routed("prefix", victim)
    run.join(120)
    assert not run.is_alive(), "the workload hangs"
    assert not redis_server.client.exists(*index_keys(fleet.replica_id["a"]))  # its index entries expired
    assert fleet.routed("prefix", victim) == routed_after_5s  # nothing sent to it after 5 s
    assert not fleet.routable("prefix", victim)
    assert len(done) == len(work)
    for o in done:
        if o.error is not None:  # only a stream that had started may fail, and only UNAVAILABLE
            assert o.error == "UNAVAILABLE" and o.messages > 0, o
    late = [o for o in done if o.start > killed]
    assert late and all(o.error is None for o in late)  # not yet started: completed on the other
    assert sum(o.error is not None for o in done) <= 4  # at most the streams in flight at the kill

    fleet.procs["a"].start()  # the same ports and deployment: it rejoins
    fleet.wait("a", victim)
    wait_for(lambda: fleet.routable("prefix", victim), 15, "the restarted replica routable again")
    before = fleet.routed("prefix", victim)
    fresh = make_workload(tenants=4, per_tenant=2, prefix_tokens=64, max_suffix=16, vocab=512, seed=2)
    outcomes, _ = run_workload(fleet.router["prefix"], fresh, concurrency=4, max_tokens=16, salt="rejoin")
    assert all(o.error is None for o in outcomes)
    assert fleet.routed("prefix", victim) > before
