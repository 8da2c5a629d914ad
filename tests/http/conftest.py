"""Fixtures of the HTTP gateway tests: `picovllm serve all` (four processes: the three gRPC
services and the gateway) on free loopback ports, with the bundled model or a tiny random
Qwen3 that carries the real Qwen2 tokenizer (tests/fixtures/qwen2_tokenizer: 151,936 ids, a
ChatML template). Every wait is bounded and every process is killed in teardown."""

from __future__ import annotations

import http.client
import json
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from tests.services.conftest import REPO, ServiceProcess, Stack, free_port, wait_for

QWEN2_TOKENIZER = REPO / "tests" / "fixtures" / "qwen2_tokenizer"
API_KEY = "http-test-key-0123456789abcdef"
# The gateway's body limit in these tests (the default is 4 MiB): small, so 413 is cheap to provoke.
MAX_REQUEST_BYTES = 65536


def http_ok(url: str, timeout: float = 1.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as reply:
            return reply.status == 200
    except OSError:
        return False


class ServeAll(Stack):
    """One `picovllm serve all` on free loopback ports; Stack's KV-cache and client helpers."""

    def __init__(
        self,
        log_dir: Path,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.addr = {k: f"127.0.0.1:{free_port()}" for k in ("scheduler", "kvcache", "model")}
        self.metrics_port, self.http_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.api_key = api_key
        config = log_dir / "picovllm.yaml"
        config.write_text(f"http:\n  max_request_bytes: {MAX_REQUEST_BYTES}\n")
        args = [
            "--config",
            str(config),
            "--scheduler-addr",
            self.addr["scheduler"],
            "--kvcache-addr",
            self.addr["kvcache"],
            "--model-addr",
            self.addr["model"],
            "--metrics-port",
            str(self.metrics_port),
            "--port",
            str(self.http_port),
            "--device",
            "cpu",
            "--torch-threads",
            "1",
            *(extra or []),
        ]
        self.procs = {}
        self.procs["all"] = ServiceProcess("all", args, log_dir, env={**(env or {}), "PICOVLLM_API_KEY": api_key or ""})
        try:
            wait_for(lambda: http_ok(f"{self.url}/health"), 150, "serve all (HTTP health)", self.procs["all"].proc)
        except (TimeoutError, RuntimeError) as exc:
            self.close()
            raise RuntimeError(f"{exc}\n--- log ---\n{self.procs['all'].tail()}") from None

    def client(self, timeout: float | None = 60):
        from scheduler_svc.client import Client

        return Client(self.addr["scheduler"], timeout=timeout, api_key=self.api_key or "")

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=60, **kwargs
        )

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0, timeout=60, **kwargs
        )

    def scheduler_metric(self, line_prefix: str) -> float:
        """The value of the scheduler's Prometheus sample whose line starts with `line_prefix`."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(line_prefix):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


def raw(
    stack: ServeAll,
    method: str,
    path: str,
    body=None,
    headers: dict | None = None,
    key: str | None = "stack",
    timeout: float = 60,
) -> tuple[int, dict]:
    """One plain HTTP request (stdlib, no client library in between): (status, parsed JSON).
    `body`: an object (sent as JSON), bytes, or an iterator of bytes (sent chunked)."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=timeout)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    key = stack.api_key if key == "stack" else key
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    try:
        conn.request(
            method, path, body=data, headers=hdrs, encode_chunked=data is not None and not isinstance(data, bytes)
        )
        reply = conn.getresponse()
        text = reply.read()
    finally:
        conn.close()
    return reply.status, json.loads(text) if text.startswith((b"{", b"[")) else {"text": text.decode()}


def make_tiny_qwen3(path: Path) -> Path:
    """A random-weight Qwen3 small enough for the CPU (one layer, hidden size 32, tied
    embeddings) over the real Qwen2 vocabulary, with the Qwen2 tokenizer files beside it;
    <|im_end|> ends a chat turn."""
    import torch

    from model_svc.config import ModelConfig
    from model_svc.loader import build_random_model, save_model

    config = ModelConfig.from_hf_config(
        dict(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            eos_token_id=[151645, 151643],
            rope_theta=1e6,
            rms_norm_eps=1e-6,
        )
    )
    save_model(build_random_model(config, torch.float32, "cpu", seed=0, std=0.05), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN2_TOKENIZER / name, path / name)
    return path


@pytest.fixture(scope="session")
def bundled(tmp_path_factory):
    """serve all with the bundled stories260k and an API key; one sequence at a time and at
    most two waiting (the prompts of one request among them), so that a burst meets a full queue."""
    stack = ServeAll(
        tmp_path_factory.mktemp("http-bundled"),
        ["--num-gpu-blocks", "128", "--num-cpu-blocks", "16", "--max-num-seqs", "1", "--max-waiting", "2"],
        api_key=API_KEY,
    )
    yield stack
    stack.close()


@pytest.fixture(scope="session")
def qwen(tmp_path_factory):
    """serve all with the tiny Qwen3 and the Qwen2 tokenizer (chat), no API key."""
    tmp = tmp_path_factory.mktemp("http-qwen")
    model = make_tiny_qwen3(tmp / "tiny-qwen3")
    stack = ServeAll(tmp, ["--model", str(model), "--num-gpu-blocks", "512", "--num-cpu-blocks", "16"])
    yield stack
    stack.close()


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.05)
