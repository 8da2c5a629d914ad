"""Each failure gets OpenAI's error object with its HTTP status: 400 (a bad field, pydantic's
validation included; unsupported best_of > 1; no chat template), 401, 404, 413 (by Content-Length
and chunked), 429 (the scheduler's queue is full), 503 (the scheduler unreachable); and a
client that leaves mid-stream or mid-wait leaves no KV-cache block in use."""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import grpc
import openai
import pytest

from http_svc.errors import from_rpc
from tests.http.conftest import API_KEY, MAX_REQUEST_BYTES, http_ok, raw, wait_until
from tests.services.conftest import ServiceProcess, free_port, wait_for

BASE = {"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 4}
CANCELLED = 'picovllm_requests_total{finish_reason="cancelled"}'


def assert_error(reply: tuple[int, dict], status: int, param: str | None = None, contains: str = "") -> dict:
    got, body = reply
    assert got == status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and contains in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1), ("top_p", 0), ("max_tokens", 0), ("presence_penalty", 3), ("logprobs", 50), ("prompt", [])],
)
def test_400_for_a_bad_field_names_it(bundled, field, value):
    assert_error(raw(bundled, "POST", "/v1/completions", {**BASE, field: value}), 400, field)


def test_400_for_what_the_engine_refuses_or_cannot_do(bundled):
    assert_error(raw(bundled, "POST", "/v1/completions", b"{not json"), 400, contains="not valid JSON")
    assert_error(raw(bundled, "POST", "/v1/completions", {**BASE, "best_of": 2}), 400, "best_of", "not supported")
    assert_error(raw(bundled, "POST", "/v1/completions", {**BASE, "n": 500}), 400, contains="n: a count of 500")
    assert_error(
        raw(bundled, "POST", "/v1/completions", {**BASE, "prompt": [1, 10**6]}), 400
    )  # the scheduler's INVALID_ARGUMENT
    chat = {"model": "stories260k", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(raw(bundled, "POST", "/v1/chat/completions", chat), 400, "messages", "chat template")
    with pytest.raises(openai.BadRequestError):
        bundled.openai().completions.create(model="stories260k", prompt="x", temperature=-1)


def test_401_without_the_key_or_with_a_wrong_one(bundled):
    error = assert_error(raw(bundled, "POST", "/v1/completions", BASE, key=None), 401)
    assert error["code"] == "invalid_api_key"
    assert_error(raw(bundled, "GET", "/v1/models", key="wrong-key-0123456789"), 401)
    wrong = openai.OpenAI(base_url=f"{bundled.url}/v1", api_key="wrong-key-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(**BASE)


def test_404_for_another_model(bundled):
    error = assert_error(raw(bundled, "POST", "/v1/completions", {**BASE, "model": "gpt-4"}), 404, "model")
    assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        bundled.openai().completions.create(**{**BASE, "model": "gpt-4"})


def test_413_for_a_body_over_the_limit(bundled):
    big = {**BASE, "prompt": "a" * (MAX_REQUEST_BYTES + 10)}
    assert_error(raw(bundled, "POST", "/v1/completions", big), 413)
    data = json.dumps(big).encode()
    chunks = iter([data[i : i + 8192] for i in range(0, len(data), 8192)])  # no Content-Length: counted as it comes
    assert_error(raw(bundled, "POST", "/v1/completions", chunks), 413)
    assert raw(bundled, "POST", "/v1/completions", BASE)[0] == 200  # and it keeps serving


def test_429_when_the_queue_is_full(bundled):
    """One sequence runs at a time and two may wait: of a burst, some are refused."""

    async def burst():
        client = bundled.async_openai()
        calls = [
            client.completions.create(
                model="stories260k", prompt="Once upon a time", max_tokens=64, extra_body={"ignore_eos": True}
            )
            for _ in range(6)
        ]
        out = await asyncio.gather(*calls, return_exceptions=True)
        await client.close()
        return out

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert refused and len(refused) < len(results), results
    assert all(not isinstance(r, Exception) or isinstance(r, openai.RateLimitError) for r in results), results
    assert refused[0].status_code == 429 and refused[0].body["type"] == "rate_limit_error"
    bundled.wait_kv_clean()


def _open_stream(stack, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    return conn, conn.getresponse()


def test_a_client_that_leaves_aborts_its_request(bundled):
    """Mid-stream, and while waiting for a whole answer: the scheduler counts the request
    cancelled and every block is free again, long before the request could have finished."""
    before = bundled.scheduler_metric(CANCELLED)
    long = {**BASE, "max_tokens": 480, "temperature": 0.0, "ignore_eos": True}
    conn, reply = _open_stream(bundled, {**long, "stream": True})
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert reply.readline().startswith(b"data: {")  # the first event
    start = time.monotonic()
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_until(lambda: bundled.scheduler_metric(CANCELLED) >= before + 1, 20, "the stream's request cancelled")
    conn, _ = None, None
    whole = http.client.HTTPConnection("127.0.0.1", bundled.http_port, timeout=0.5)
    whole.request(
        "POST",
        "/v1/completions",
        body=json.dumps(long),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with pytest.raises(TimeoutError):
        whole.getresponse()  # gives up while the whole answer is being generated
    whole.close()
    wait_until(lambda: bundled.scheduler_metric(CANCELLED) >= before + 2, 20, "the whole request cancelled")
    bundled.wait_kv_clean()
    assert time.monotonic() - start < 20


def test_503_while_the_scheduler_is_unreachable(tmp_path):
    """A gateway whose scheduler is not there: up, unhealthy, and 503 for API calls."""
    port = free_port()
    gateway = ServiceProcess("http", ["--scheduler-addr", f"127.0.0.1:{free_port()}", "--port", str(port)], tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/health")
                return True
            except OSError:
                return False

        wait_for(up, 60, "the gateway's port", gateway.proc)
        assert not http_ok(f"{url}/health")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps(BASE), headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        body = json.loads(reply.read())
        assert reply.status == 503 and body["error"]["type"] == "service_unavailable_error", body
        with pytest.raises(openai.InternalServerError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).completions.create(**BASE)
    finally:
        gateway.kill()


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.OUT_OF_RANGE, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNAUTHENTICATED, 500),
    ],
)
def test_each_scheduler_status_has_its_http_status(code, status):
    error = from_rpc(_Failed(code, "detail from 10.0.0.7:50052"))
    assert error.status == status
    assert ("10.0.0.7" in error.message) == (status in (400, 429))  # other details stay in the log
