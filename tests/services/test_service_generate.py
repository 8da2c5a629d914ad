"""The three services as real processes (metadata in memory): Generate equals embedded mode
token for token, bad input gets its status code while the server keeps serving, 32
concurrent streams finish and cancelled ones free their blocks, Abort, health, reflection,
metrics and the `picovllm client` command."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from tests.services.conftest import FINISH, PROMPTS, REPO, Stack, generate_all

GREEDY = dict(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("svc-memory"))
    yield s
    s.close()


def test_generate_equals_embedded(stack, embedded):
    want = embedded(PROMPTS, **GREEDY)
    assert generate_all(stack, PROMPTS, **GREEDY) == want
    # All at once (one batch in both modes' steps may differ; greedy tokens must not).
    assert generate_all(stack, PROMPTS, concurrent=True, **GREEDY) == want
    with_eos = embedded(PROMPTS[:3], temperature=0.0, max_tokens=200)
    assert generate_all(stack, PROMPTS[:3], temperature=0.0, max_tokens=200) == with_eos
    stack.wait_kv_clean()


def test_stream_carries_deltas_and_usage(stack):
    with stack.client() as c:
        msgs = list(c.generate("Once upon a time", temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 8 == sum(len(m.token_ids) for m in msgs)
    assert last.usage.prompt_tokens > 0
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == [t for m in msgs for t in m.token_ids]
    assert all(lp.logprob <= 0 and len(lp.top) >= 1 for lp in lps)


BAD_INPUT = [
    (dict(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="hello " * 600), grpc.StatusCode.INVALID_ARGUMENT),  # longer than max_model_len
    (dict(prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="hi", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt="hi", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt=[5, 512]), grpc.StatusCode.INVALID_ARGUMENT),  # vocab is 512
    (dict(prompt=[5, -1]), grpc.StatusCode.INVALID_ARGUMENT),
    (dict(prompt=[]), grpc.StatusCode.INVALID_ARGUMENT),
]


@pytest.mark.parametrize("kwargs,code", BAD_INPUT, ids=[str(i) for i in range(len(BAD_INPUT))])
def test_bad_input_gets_status_and_server_keeps_serving(stack, kwargs, code):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    with stack.client(timeout=20) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate(prompt, **kwargs))
        assert err.value.code() == code, err.value.details()
        text, ids, last = c.complete("Once upon a time", temperature=0.0, max_tokens=4)
    assert len(ids) == 4


def test_missing_prompt_and_unknown_abort(stack):
    with stack.client(timeout=20) as c:
        with pytest.raises(grpc.RpcError) as err:
            list(c.stub.Generate(pb.GenerateRequest(), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            c.abort("no-such-request")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_abort_ends_the_stream_and_frees_blocks(stack):
    with stack.client() as c:
        stream = c.generate("Once upon a time", request_id="to-abort", temperature=0.0, max_tokens=400, ignore_eos=True)
        first = next(stream)
        assert first.request_id == "to-abort"
        c.abort("to-abort")
        rest = list(stream)
    assert rest and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(m.token_ids) for m in [first, *rest]) < 400
    stack.wait_kv_clean()


def test_32_concurrent_streams_with_half_cancelled(stack):
    results: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            with stack.client(timeout=120) as c:
                n = 0
                for msg in c.generate(f"Once upon a time {i}", temperature=0.0, max_tokens=120, ignore_eos=True):
                    n += len(msg.token_ids)
                    if i % 2 and n >= 5:  # odd clients walk away mid-stream
                        results[i] = "cancelled"
                        return
                results[i] = (n, msg.finish_reason)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 180
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a client hung"
    for i in range(32):
        assert results[i] == ("cancelled" if i % 2 else (120, pb.FINISH_REASON_LENGTH)), (i, results[i])
    info = stack.wait_kv_clean()
    assert info.num_free_device_blocks == 256


def test_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for kind, service in (
        ("scheduler", "picovllm.scheduler.v1.SchedulerService"),
        ("kvcache", "picovllm.kvcache.v1.KVCacheService"),
        ("model", "picovllm.model.v1.ModelService"),
    ):
        with grpc.insecure_channel(stack.addr[kind]) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            answer = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([req]), timeout=5))
            names = {s.name for s in answer.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_model_info(stack):
    with stack.client() as c:
        info = c.model_info()
    assert (info.family, info.vocab_size, info.block_size, info.num_device_blocks, info.num_host_blocks) == (
        "llama",
        512,
        16,
        256,
        64,
    )
    assert info.max_model_len == 512 and list(info.eos_token_ids) == [2]


def test_metrics_endpoint(stack):
    generate_all(stack, ["Once upon a time"], temperature=0.0, max_tokens=4)
    body = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).read().decode()
    for name in (
        'picovllm_num_requests{state="running"}',
        'picovllm_num_requests{state="waiting"}',
        'picovllm_num_requests{state="swapped"}',
        'picovllm_kv_cache_usage_ratio{pool="device"}',
        'picovllm_kv_cache_usage_ratio{pool="host"}',
        "picovllm_prefix_cache_queries_total",
        "picovllm_prefix_cache_hits_total",
        "picovllm_num_preemptions_total",
        "picovllm_time_to_first_token_seconds_bucket",
        "picovllm_inter_token_latency_seconds_bucket",
        "picovllm_e2e_request_latency_seconds_bucket",
        "picovllm_prompt_tokens_total",
        "picovllm_generation_tokens_total",
    ):
        assert name in body, name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
def test_scheduler_process_never_loads_torch(stack):
    """The running scheduler, tokenizer loaded and requests served, has no torch library mapped
    (tests/test_layers.py checks its imports; this checks the process)."""
    generate_all(stack, ["Once upon a time"], temperature=0.0, max_tokens=4)
    maps = {p: Path(f"/proc/{stack.procs[p].proc.pid}/maps").read_text() for p in ("scheduler", "model")}
    assert "libtorch" in maps["model"]  # what the check looks for is there when torch is
    assert "libtorch" not in maps["scheduler"]
    pid = stack.procs["scheduler"].proc.pid  # and its engine process (scheduler_svc.engine_core)
    engines = [
        c for t in os.listdir(f"/proc/{pid}/task") for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()
    ]
    assert engines and all("libtorch" not in Path(f"/proc/{c}/maps").read_text() for c in engines)


def test_client_command_streams_text(stack, embedded):
    ((ids, text, _),) = embedded(["Once upon a time"], temperature=0.0, max_tokens=12)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc.cli",
            "client",
            "Once upon a time",
            "--addr",
            stack.addr["scheduler"],
            "--max-tokens",
            "12",
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "Once upon a time" + text + "\n"


def test_deadline_shorter_than_the_work(stack):
    start = time.monotonic()
    with stack.client() as c, pytest.raises(grpc.RpcError) as err:
        list(c.generate("Once upon a time", temperature=0.0, max_tokens=480, ignore_eos=True, timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 5
    stack.wait_kv_clean()
    assert FINISH["length"] == pb.FINISH_REASON_LENGTH


def _by_index(msgs) -> dict[int, tuple[list[int], str, int]]:
    """Each completion's (token ids, text, finish reason) from a stream of n > 1."""
    out: dict[int, tuple[list[int], str, int]] = {}
    for m in msgs:
        ids, text, reason = out.get(m.index, ([], "", 0))
        out[m.index] = (ids + list(m.token_ids), text + m.text, m.finish_reason or reason)
    return out


def test_generate_n2_streams_both_indices(stack, embedded):
    prompt = PROMPTS[3]  # longer than a block: the children share full blocks and a partial one
    (want,) = embedded([prompt], **GREEDY)
    with stack.client() as c:
        msgs = list(c.generate(prompt, n=2, **GREEDY))
    assert {m.index for m in msgs} == {0, 1}
    assert _by_index(msgs) == {0: want, 1: want}
    assert msgs[-1].usage.completion_tokens == 2 * len(want[0])
    assert sum(m.usage.prompt_tokens > 0 for m in msgs) == 1  # the usage comes once, last
    with stack.client() as c:  # seeded sampling: the same completions again, and unlike each other
        runs = [_by_index(c.generate(prompt, n=3, seed=11, temperature=1.0, max_tokens=16)) for _ in range(2)]
    assert runs[0] == runs[1] and len({v[0] and tuple(v[0]) for v in runs[0].values()}) > 1
    stack.wait_kv_clean()


def test_abort_of_n4_frees_every_child(stack):
    with stack.client() as c:
        stream = c.generate(PROMPTS[3], request_id="par-abort", n=4, temperature=1.0, max_tokens=400, ignore_eos=True)
        seen = {next(stream).index}
        c.abort("par-abort")
        msgs = list(stream)
    ends = {m.index: m.finish_reason for m in msgs if m.finish_reason}
    assert ends == {i: pb.FINISH_REASON_ABORT for i in range(4)}, (seen, ends)
    stack.wait_kv_clean()
