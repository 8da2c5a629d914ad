"""Service mode with the metadata in a real redis-server: parity with embedded mode, and the
failure cases: kill -9 of the KV-cache service mid-generation (restarted on the same Redis,
every request completes with the undisturbed tokens, nothing recomputed), kill -9 of the
model service (recomputed after it is back, or UNAVAILABLE within the deadline while it is
down), never a hung client or a leaked block."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest

from tests.services.conftest import PROMPTS, Stack, generate_all

LONG = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
STREAM_PROMPTS = [f"Once upon a time {i}" for i in range(6)] + ["Lily and Tom went to the park."] * 2


@pytest.fixture(scope="module", params=["unary", "pipelined"])
def stack(request, tmp_path_factory, redis_server):
    # One unary Step call per step, or the pipelined step stream (embedded runs neither here):
    # the tokens must not change.
    args = ["--async-scheduling"] if request.param == "pipelined" else []
    s = Stack(
        tmp_path_factory.mktemp("svc-redis"),
        redis_url=redis_server.url,
        deployment="failures" + uuid.uuid4().hex[:8],
        scheduler_args=args,
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def undisturbed(embedded):
    return embedded(STREAM_PROMPTS, **LONG)


class Streams:
    """Concurrent streaming clients; `wait_started` returns once each has some tokens."""

    def __init__(self, stack: Stack, prompts: list, timeout: float, **sampling) -> None:
        self.results: dict[int, object] = {}
        self.progress = [0] * len(prompts)
        self.threads = [
            threading.Thread(target=self._run, args=(i, p, stack, timeout, sampling)) for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i, prompt, stack, timeout, sampling) -> None:
        ids, last, start = [], None, time.monotonic()
        try:
            with stack.client() as c:
                for last in c.generate(prompt, timeout=timeout, **sampling):
                    ids.extend(last.token_ids)
                    self.progress[i] = len(ids)
            self.results[i] = (ids, last.finish_reason)
        except grpc.RpcError as err:
            self.results[i] = (err.code(), time.monotonic() - start)

    def wait_started(self, min_tokens: int = 5, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while min(self.progress) < min_tokens:
            assert time.monotonic() < end, f"streams did not start: {self.progress}"
            time.sleep(0.01)

    def join(self, timeout: float) -> dict[int, object]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a client hung"
        return self.results


def test_generate_equals_embedded_with_redis(stack, embedded):
    greedy = dict(temperature=0.0, max_tokens=48)
    assert generate_all(stack, PROMPTS, **greedy) == embedded(PROMPTS, **greedy)
    _, info = stack.kv_info()
    assert info.store == "redis" and info.step > 0


def test_kvcache_kill9_midstream_then_restart_same_tokens(stack, undisturbed):
    streams = Streams(stack, STREAM_PROMPTS, timeout=120, **LONG)
    streams.wait_started()
    stack.kill("kvcache")  # SIGKILL, mid-generation
    time.sleep(0.5)
    stack.restart("kvcache")
    results = streams.join(150)
    for i, (ids, _, _) in enumerate(undisturbed):
        assert results[i] == (ids, 2), i  # FINISH_REASON_LENGTH, same tokens
    assert "KV-cache resync" not in stack.procs["scheduler"].log_path.read_text(), "the reload should need no recompute"
    stack.wait_kv_clean()


def test_kvcache_restart_when_idle_keeps_its_state(stack):
    generate_all(stack, PROMPTS[3:5], temperature=0.0, max_tokens=8)  # leaves hashed blocks in the prefix cache
    _, before = stack.kv_info()
    stack.restart("kvcache")
    _, after = stack.kv_info()
    assert (after.step, after.num_free_device_blocks, after.config.epoch) == (
        before.step,
        before.num_free_device_blocks,
        before.config.epoch,
    )
    assert after.num_prefix_queries == before.num_prefix_queries
    generate_all(stack, PROMPTS[3:4], temperature=0.0, max_tokens=8)
    _, again = stack.kv_info()
    assert again.num_prefix_hits > after.num_prefix_hits  # the reloaded prefix cache still hits


def test_model_kill9_midstream_then_restart_recomputes(stack, undisturbed):
    _, before = stack.kv_info()
    streams = Streams(stack, STREAM_PROMPTS, timeout=120, **LONG)
    streams.wait_started()
    stack.restart("model", wait=False)  # SIGKILL, then a fresh process (a new epoch)
    results = streams.join(150)
    for i, (ids, _, _) in enumerate(undisturbed):
        got_ids, reason = results[i]
        assert reason == 2 and len(got_ids) == len(ids), i
        assert got_ids == ids, f"request {i}: recomputed greedy tokens differ"
    stack.wait_kv_clean()
    _, after = stack.kv_info()
    assert after.config.epoch != before.config.epoch  # the pools were reset for the new epoch


def test_model_down_fails_with_unavailable_within_deadline(stack):
    stack.kill("model")
    try:
        streams = Streams(stack, STREAM_PROMPTS[:4], timeout=4.0, **LONG)
        results = streams.join(30)
        for i, (code, elapsed) in results.items():
            assert code == grpc.StatusCode.UNAVAILABLE, (i, code)
            assert elapsed < 4.0, (i, elapsed)
        stack.wait_kv_clean()
    finally:
        stack.restart("model")
    ((ids, _, reason),) = generate_all(stack, ["Once upon a time"], temperature=0.0, max_tokens=8)
    assert len(ids) == 8
    stack.wait_kv_clean()
