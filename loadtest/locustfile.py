"""Locust load test for pico-vllm: streaming gRPC Generate calls, or streaming chat
completions through the OpenAI-compatible HTTP gateway (--api http).

    locust -f loadtest/locustfile.py --host 127.0.0.1:50051 --workload short_chat
    locust -f loadtest/locustfile.py --host 127.0.0.1:50051 --headless -u 32 -r 8 -t 60s --csv out/run
    locust -f loadtest/locustfile.py --api http --host http://127.0.0.1:8000 --headless -u 32 -r 8 -t 60s

Each call is recorded three times in locust's statistics: `Generate` (end-to-end time, response
length = generated tokens), `TTFT` (time to the first streamed token) and `ITL` (mean
inter-token latency of the call); over HTTP the end-to-end entry is `chat` (a streamed
POST /v1/chat/completions, read as server-sent events; response length = content chunks).
Workloads (--workload or $PICOVLLM_WORKLOAD):
short_chat (short prompt, 32 tokens), long_prompt (a long prompt, 16 tokens), shared_prefix
(one long common prefix with a short distinct suffix, 32 tokens: exercises the prefix cache),
multi_tenant (one of eight long prefixes, a short distinct suffix, 32 tokens: the router's
workload; point --host at the router, e.g. 127.0.0.1:50050).
A server with an API key gets it from $PICOVLLM_API_KEY (or the file named by
$PICOVLLM_API_KEY_FILE).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import grpc
import grpc.experimental.gevent as grpc_gevent
from locust import User, between, events, task
from locust.contrib.fasthttp import FastHttpUser

grpc_gevent.init_gevent()  # grpc's blocking calls must yield to locust's greenlets

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contracts.auth import API_KEY_ENV, call_metadata, read_secret  # noqa: E402
from protos.picovllm.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc  # noqa: E402

METADATA = call_metadata(read_secret(API_KEY_ENV, check=False))

WORDS = [
    "once",
    "upon",
    "a",
    "time",
    "there",
    "was",
    "a",
    "little",
    "girl",
    "named",
    "lily",
    "she",
    "loved",
    "to",
    "play",
    "outside",
    "in",
    "the",
    "park",
    "one",
    "day",
    "she",
    "saw",
    "a",
    "big",
    "red",
    "ball",
    "and",
    "her",
    "friend",
    "tom",
    "came",
    "to",
    "play",
    "with",
    "her",
    "they",
    "were",
    "happy",
]
SHARED_PREFIX = " ".join(random.Random(0).choices(WORDS, k=300))
# Eight tenants' system prompts: the router's workload (cache affinity across replicas).
TENANT_PREFIXES = [" ".join(random.Random(t + 1).choices(WORDS, k=200)) for t in range(8)]


def _prompt(workload: str, rng: random.Random) -> tuple[str, int]:
    if workload == "long_prompt":
        return " ".join(rng.choices(WORDS, k=350)), 16
    if workload == "shared_prefix":
        return SHARED_PREFIX + " " + " ".join(rng.choices(WORDS, k=8)), 32
    if workload == "multi_tenant":
        return rng.choice(TENANT_PREFIXES) + " " + " ".join(rng.choices(WORDS, k=8)), 32
    return " ".join(rng.choices(WORDS, k=rng.randint(4, 12))), 32


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument(
        "--workload",
        choices=["short_chat", "long_prompt", "shared_prefix", "multi_tenant"],
        default=os.environ.get("PICOVLLM_WORKLOAD", "short_chat"),
        help="request mix",
    )
    parser.add_argument(
        "--timeout", type=float, default=float(os.environ.get("PICOVLLM_TIMEOUT", "60")), help="per-call deadline (s)"
    )
    parser.add_argument(
        "--api",
        choices=["grpc", "http"],
        default=os.environ.get("PICOVLLM_API", "grpc"),
        help="grpc: the scheduler's Generate (--host HOST:PORT); http: the gateway's streamed chat "
        "completions (--host http://HOST:PORT)",
    )


@events.init.add_listener
def _pick_api(environment, **kwargs) -> None:
    """Only the user class of --api runs."""
    api = getattr(environment.parsed_options, "api", "grpc")
    environment.user_classes[:] = [c for c in environment.user_classes if getattr(c, "api", None) == api]


class GenerateUser(User):
    api = "grpc"
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host or "127.0.0.1:50051")
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel)
        self.rng = random.Random()

    def on_stop(self) -> None:
        self.channel.close()

    def _fire(self, name: str, ms: float, length: int = 0, exc: BaseException | None = None) -> None:
        events.request.fire(
            request_type="grpc", name=name, response_time=ms, response_length=length, exception=exc, context={}
        )

    @task
    def generate(self) -> None:
        opts = self.environment.parsed_options
        text, max_tokens = _prompt(opts.workload, self.rng)
        request = scheduler_pb2.GenerateRequest(
            text=text,
            sampling=scheduler_pb2.SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True),
        )
        start = time.perf_counter()
        first = last = None
        tokens = 0
        try:
            for msg in self.stub.Generate(request, timeout=opts.timeout, metadata=METADATA):
                now = time.perf_counter()
                if msg.token_ids:
                    first = first or now
                    last = now
                    tokens += len(msg.token_ids)
        except grpc.RpcError as exc:
            self._fire("Generate", (time.perf_counter() - start) * 1e3, tokens, exc)
            return
        self._fire("Generate", (time.perf_counter() - start) * 1e3, tokens)
        if first is not None:
            self._fire("TTFT", (first - start) * 1e3)
            if tokens > 1:
                self._fire("ITL", (last - first) * 1e3 / (tokens - 1))


class ChatUser(FastHttpUser):
    """Streamed chat completions through the HTTP gateway, read as server-sent events."""

    api = "http"
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.rng = random.Random()
        key = read_secret(API_KEY_ENV, check=False)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        with self.client.get("/v1/models", headers=self.headers, name="models", catch_response=True) as reply:
            self.model = reply.json()["data"][0]["id"] if reply.status_code == 200 else "unknown"

    def _fire(self, name: str, ms: float, length: int = 0, exc: BaseException | None = None) -> None:
        events.request.fire(
            request_type="http", name=name, response_time=ms, response_length=length, exception=exc, context={}
        )

    @task
    def chat(self) -> None:
        opts = self.environment.parsed_options
        text, max_tokens = _prompt(opts.workload, self.rng)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": text}],
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "top_p": 0.95,
            "ignore_eos": True,
        }
        start = time.perf_counter()
        first = last = None
        chunks = 0
        try:
            reply = self.client.post(
                "/v1/chat/completions",
                json=body,
                headers=self.headers,
                stream=True,
                name="chat-open",
                timeout=opts.timeout,
            )
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}")
            # Server-sent events: one `data: <json>` line per event, a blank line after each.
            for line in iter(lambda: reply.stream.readline(b"\n"), b""):
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
        except Exception as exc:  # noqa: BLE001 - recorded as the call's failure
            self._fire("chat", (time.perf_counter() - start) * 1e3, chunks, exc)
            return
        self._fire("chat", (time.perf_counter() - start) * 1e3, chunks)
        if first is not None:
            self._fire("TTFT", (first - start) * 1e3)
            if chunks > 1:
                self._fire("ITL", (last - first) * 1e3 / (chunks - 1))
