"""No single request can stall, crash or starve the scheduler (real processes on loopback).

Limits come before work: a 20 MB prompt is refused by gRPC's message limit within 2 s while
a stream beside it keeps its pace and the scheduler's memory stays flat; prompt text over
the character cap, logprobs over the cap, too many stop strings and malformed messages get
INVALID_ARGUMENT, and the requests running beside them end with the greedy reference's
tokens. A hypothesis fuzz of Generate requests gets only OK or the client-error codes, and
the server serves correctly afterwards. Cancelled and aborted requests are counted.
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from scheduler_svc.client import generate_request
from tests.services.conftest import Stack

GREEDY = dict(temperature=0.0, max_tokens=24)
NEIGHBOURS = ["Once upon a time", "Lily and Tom went to the park.", "One day, a little dog named Max"]
GENERATE = "/picovllm.scheduler.v1.SchedulerService/Generate"
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("svc-hardening"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(embedded):
    return {p: embedded([p], **GREEDY)[0][0] for p in NEIGHBOURS}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def status_of(stack: Stack, prompt, timeout: float = 30, **sampling) -> grpc.StatusCode:
    """The status of one Generate (OK once it streamed a few messages: then it is cancelled)."""
    with stack.client() as c:
        try:
            for i, _ in enumerate(c.generate(prompt, timeout=timeout, **sampling)):
                if i >= 3:
                    break
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


class Neighbours:
    """Greedy streams running while a bad request arrives: their tokens and the arrival time
    of every message."""

    def __init__(self, stack: Stack, prompts: list[str], **sampling) -> None:
        self.tokens: dict[str, list[int]] = {p: [] for p in prompts}
        self.times: dict[str, list[float]] = {p: [] for p in prompts}
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(stack, p, sampling)) for p in prompts]
        for t in self.threads:
            t.start()

    def _run(self, stack: Stack, prompt: str, sampling) -> None:
        try:
            with stack.client() as c:
                for msg in c.generate(prompt, timeout=120, **sampling):
                    self.times[prompt].append(time.monotonic())
                    self.tokens[prompt].extend(msg.token_ids)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.errors.append(exc)

    def wait_streaming(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while not all(len(t) >= 2 for t in self.times.values()):
            assert time.monotonic() < end and not self.errors, (self.errors, {p: len(t) for p, t in self.times.items()})
            time.sleep(0.01)

    def join(self, timeout: float = 120) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a neighbour hung"
        assert not self.errors, self.errors

    def max_gap(self, start: float, end: float) -> float:
        """The longest wait for a message of any stream between start and end."""
        gaps = [b - a for times in self.times.values() for a, b in zip(times, times[1:]) if b >= start and a <= end]
        return max(gaps, default=0.0)


def test_huge_prompt_refused_fast_without_stalling_others(stack):
    pid = stack.procs["scheduler"].proc.pid
    status_of(stack, "warm up the scheduler's buffers " * 8, **GREEDY)
    rss_before = rss_kib(pid)
    # A slow stream that keeps going while the bad requests arrive.
    streams = Neighbours(stack, ["Once upon a time"], temperature=0.0, max_tokens=400, ignore_eos=True)
    streams.wait_streaming()
    big = generate_request("x" * (20 << 20), temperature=0.0).SerializeToString()
    with grpc.insecure_channel(stack.addr["scheduler"]) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        call = channel.unary_stream(GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(call(big, timeout=10))
        big_seconds = time.monotonic() - start
    code = err.value.code()
    over_chars = status_of(
        stack, "Once upon a time " * 6000, timeout=10
    )  # under the message limit, over the character cap
    end = time.monotonic()
    rss_after = rss_kib(pid)
    streams.join()
    assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), code
    assert big_seconds < 2.0, big_seconds
    assert over_chars == grpc.StatusCode.INVALID_ARGUMENT
    assert streams.max_gap(start, end) < 1.0, streams.max_gap(start, end)
    assert (rss_after - rss_before) < 100 << 10, f"scheduler RSS grew by {(rss_after - rss_before) >> 10} MB"
    assert len(streams.tokens["Once upon a time"]) == 400


@pytest.mark.parametrize(
    "bad",
    [
        dict(logprobs=1000),
        dict(logprobs=21),
        dict(stop=[f"s{i}" for i in range(65)]),
        dict(stop=["x" * 5000]),
        dict(stop=[f"stop{i}" for i in range(500_000)]),  # about 5 MB: refused by the message limit itself
        dict(stop_token_ids=[1] * 2000),
        dict(stop_token_ids=[512]),
    ],
)
def test_bad_request_fails_alone(stack, reference, bad):
    streams = Neighbours(stack, NEIGHBOURS, **GREEDY)
    code = status_of(stack, "Once upon a time", temperature=0.0, max_tokens=8, **bad)
    streams.join()
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), code
    if "logprobs" in bad:
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert streams.tokens == reference


def test_logprobs_within_the_cap_are_served(stack, reference):
    with stack.client() as c:
        _, ids, last = c.complete("Once upon a time", logprobs=20, **GREEDY)
    assert ids == reference["Once upon a time"]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH


def test_malformed_message_is_invalid_argument(stack):
    with grpc.insecure_channel(stack.addr["scheduler"]) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(call(b"\xff\xff\xff\x01", timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed" in err.value.details()


def metric(stack: Stack, name: str, label: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{finish_reason="{label}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_cancelled_and_aborted_requests_are_counted(stack):
    counted = {label: metric(stack, "picovllm_requests_total", label) for label in ("cancelled", "abort", "length")}
    with stack.client() as c:
        for _ in c.generate("Once upon a time", temperature=0.0, max_tokens=300, ignore_eos=True, timeout=60):
            break  # closing the stream cancels the call
        request_id = "abort-" + uuid.uuid4().hex
        stream = c.generate(
            "Once upon a time", request_id=request_id, temperature=0.0, max_tokens=300, ignore_eos=True, timeout=60
        )
        next(stream)
        c.abort(request_id)
        last = list(stream)[-1]
        assert last.finish_reason == pb.FINISH_REASON_ABORT
        c.complete("Once upon a time", **GREEDY)
    deadline = time.monotonic() + 10
    while metric(stack, "picovllm_requests_total", "cancelled") < counted["cancelled"] + 1:
        assert time.monotonic() < deadline, "the cancelled request was not counted"
        time.sleep(0.05)
    assert metric(stack, "picovllm_requests_total", "abort") == counted["abort"] + 1
    assert metric(stack, "picovllm_requests_total", "length") == counted["length"] + 1
    stack.wait_kv_clean()


# ----------------------------------------------------------------- fuzz
_INT32 = st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1)
_EXTREME = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([-1.0, 0.0, 1e-30, 1e30]))


def _sampling(wild: bool) -> st.SearchStrategy:
    """Sampling fields in range, or (wild) anything their wire types hold."""

    def pick(valid: st.SearchStrategy, extreme: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(valid, extreme) if wild else valid

    return st.fixed_dictionaries(
        {},
        optional={
            "temperature": pick(st.sampled_from([0.0, 0.7, 1.0, 1.5]), _EXTREME),
            "top_p": pick(st.floats(0.05, 1.0), _EXTREME),
            "top_k": pick(st.integers(-1, 600), _INT32),
            "min_p": pick(st.floats(0.0, 0.5), _EXTREME),
            "seed": st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
            "max_tokens": pick(st.one_of(st.integers(1, 8), st.just((1 << 31) - 1)), _INT32),
            "stop": pick(
                st.lists(st.text(min_size=1, max_size=8), max_size=4),
                st.lists(st.text(max_size=3), min_size=60, max_size=80),
            ),
            "stop_token_ids": st.lists(pick(st.integers(0, 511), _INT32), max_size=8),
            "ignore_eos": st.booleans(),
            "repetition_penalty": pick(st.floats(0.5, 2.0), _EXTREME),
            "presence_penalty": pick(st.floats(-2.0, 2.0), _EXTREME),
            "frequency_penalty": pick(st.floats(-2.0, 2.0), _EXTREME),
            "logprobs": pick(st.integers(0, 20), _INT32),
            "skip_special_tokens": st.booleans(),
        },
    )


_TEXT = st.one_of(
    st.text(min_size=1, max_size=64),
    st.just("Once upon a time"),
    st.just(""),
    st.text(alphabet=st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), min_size=1, max_size=16),
    st.just("\x00\ud7ff\ufffd\u200b" * 4),
)
_IDS = st.one_of(st.lists(st.integers(0, 511), min_size=1, max_size=40), st.lists(_INT32, max_size=40))


def test_fuzzed_generate_gets_ok_or_a_client_error_and_the_server_keeps_serving(stack, reference):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(
        prompt=st.one_of(_TEXT, _IDS),
        sampling=st.one_of(_sampling(False), _sampling(True)),
        request_id=st.one_of(st.just(""), st.text(max_size=300)),
        cache_salt=st.one_of(st.just(""), st.text(max_size=8)),
    )
    def one(prompt, sampling, request_id, cache_salt):
        request = generate_request(prompt, request_id, cache_salt, **sampling)
        call = channel.unary_stream(
            GENERATE,
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )(request, timeout=30)
        try:
            for i, _ in enumerate(call):
                if i >= 3:
                    break  # it runs: enough (cancelled below)
        except grpc.RpcError as err:
            assert err.code() in CLIENT_ERRORS, (err.code(), err.details())
        finally:
            call.cancel()

    with grpc.insecure_channel(stack.addr["scheduler"]) as channel:
        one()
    with stack.client() as c:
        for prompt in NEIGHBOURS:
            assert c.complete(prompt, **GREEDY)[1] == reference[prompt]
    stack.wait_kv_clean()
