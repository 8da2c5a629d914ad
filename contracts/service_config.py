"""Service-mode configuration: one YAML file with a section per service, frozen once loaded.

Precedence, lowest first: the defaults here, the YAML file, environment variables, flags.

    scheduler:  {address: "127.0.0.1:50051", metrics_port: 9400, max_waiting: 1024, ...}
    kvcache:    {address: "127.0.0.1:50052", redis_url: null, deployment: default}
    model:      {address: "127.0.0.1:50053", model: <bundled stories260k>, block_size: 16, ...}
    http:       {host: 127.0.0.1, port: 8000, served_model_name: null, chat_template: null, ...}
    router:     {address: "127.0.0.1:50050", replicas: [host:port, ...], policy: prefix, ...}

Environment: PICOVLLM_CONFIG (the YAML path), PICOVLLM_SCHEDULER_ADDR, PICOVLLM_KVCACHE_ADDR,
PICOVLLM_MODEL_ADDR, PICOVLLM_REDIS_URL, PICOVLLM_DEPLOYMENT, PICOVLLM_METRICS_PORT,
PICOVLLM_MODEL, PICOVLLM_HTTP_HOST, PICOVLLM_HTTP_PORT, PICOVLLM_SERVED_MODEL_NAME,
PICOVLLM_ROUTER_ADDR, PICOVLLM_REPLICAS (comma-separated);
PICOVLLM_REDIS_URL_FILE names a file holding the Redis URL (it may carry a
password). Every service listens on loopback unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.auth import REDIS_URL_ENV, mask_url, read_secret
from contracts.engine_fields import check_fields

# The default model (stories260k, shipped inside the model service's package): the model
# section's and the embedded engine's default.
BUNDLED_MODEL = str(Path(__file__).resolve().parent.parent / "model_svc" / "bundled" / "stories260k")

ENV_VARS: dict[str, tuple[str, str]] = {
    "PICOVLLM_SCHEDULER_ADDR": ("scheduler", "address"),
    "PICOVLLM_METRICS_PORT": ("scheduler", "metrics_port"),
    "PICOVLLM_KVCACHE_ADDR": ("kvcache", "address"),
    "PICOVLLM_REDIS_URL": ("kvcache", "redis_url"),
    "PICOVLLM_DEPLOYMENT": ("kvcache", "deployment"),
    "PICOVLLM_MODEL_ADDR": ("model", "address"),
    "PICOVLLM_MODEL": ("model", "model"),
    "PICOVLLM_HTTP_HOST": ("http", "host"),
    "PICOVLLM_HTTP_PORT": ("http", "port"),
    "PICOVLLM_SERVED_MODEL_NAME": ("http", "served_model_name"),
    "PICOVLLM_ROUTER_ADDR": ("router", "address"),
    "PICOVLLM_REPLICAS": ("router", "replicas"),
}


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be host:port, got {value!r}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value > 0:
            raise ValueError(f"{section}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class SchedulerSection:
    address: str = "127.0.0.1:50051"
    metrics_port: int | None = 9400  # Prometheus /metrics on the scheduler's host; None or 0 = off
    tokenizer: str | None = None  # None: the model section's directory
    max_waiting: int = 1024  # queued requests beyond this get RESOURCE_EXHAUSTED
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    preemption_mode: str = "swap"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = (
        None  # pipeline the model steps (two ahead); None: on when the model service runs on a GPU
    )
    rpc_timeout_s: float = 30.0  # one internal call, when no client deadline is shorter
    retry_window_s: float = 1.0  # how long one engine step retries a peer that is down
    startup_timeout_s: float = 600.0  # waiting for the peers at start
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may still run
    # Limits of one request, checked before any work (sampling_params.RequestLimits):
    max_request_bytes: int = 4 << 20  # a larger Generate message gets RESOURCE_EXHAUSTED from gRPC
    max_prompt_chars: int | None = None  # None: max_model_len x 16 characters
    max_logprobs: int = 20  # top-n logprobs per token (never above the vocabulary)
    max_n: int = 128  # completions of one request (SamplingParams.n)
    max_stop_strings: int = 64
    max_stop_chars: int = 4096  # all stop strings of a request together
    # A request waiting on a model or KV-cache service that has been unreachable this long
    # ends with UNAVAILABLE, client deadline or not; health turns NOT_SERVING once one has
    # been unreachable for peer_down_after_s (probed about once a second).
    dependency_timeout_s: float = 30.0
    peer_down_after_s: float = 2.0
    tls_cert: str | None = None  # PEM files: the public API over TLS (both or neither)
    tls_key: str | None = None

    def __post_init__(self) -> None:
        _check_address("scheduler.address", self.address)
        _positive("scheduler", self, "dependency_timeout_s", "peer_down_after_s")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("scheduler.tls_cert and scheduler.tls_key go together: set both or neither")
        check_fields(self, "scheduler.")
        _positive(
            "scheduler",
            self,
            "max_waiting",
            "rpc_timeout_s",
            "retry_window_s",
            "startup_timeout_s",
            "max_request_bytes",
            "max_prompt_chars",
            "max_n",
        )
        for name in ("max_logprobs", "max_stop_strings", "max_stop_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"scheduler.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"scheduler.metrics_port must be a port number, got {self.metrics_port!r}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"scheduler.drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")


@dataclass(frozen=True, slots=True)
class KVCacheSection:
    address: str = "127.0.0.1:50052"
    redis_url: str | None = field(default=None, repr=False)  # None: metadata in memory; may carry a password
    deployment: str = "default"  # namespaces the Redis keys; a replica's id in the router's prefix index
    # Publish the block hashes held on the device to Redis (redis_url) with a heartbeat, for a
    # router in front of several replicas (router_svc); the KV-cache service refuses to start
    # without redis_url (only that service is given the URL).
    publish_prefixes: bool = False

    def __post_init__(self) -> None:
        _check_address("kvcache.address", self.address)
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kvcache.redis_url must be a redis:// URL, got {mask_url(self.redis_url)!r}")
        if not self.deployment or ":" in self.deployment:
            raise ValueError(f"kvcache.deployment must be a non-empty name without ':', got {self.deployment!r}")


@dataclass(frozen=True, slots=True)
class ModelSection:
    address: str = "127.0.0.1:50053"
    model: str = BUNDLED_MODEL
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: measured
    num_cpu_blocks: int | None = None  # None: from swap_space_gib
    swap_space_gib: float = 1.0
    gpu_memory_utilization: float = 0.9
    device: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8_e4m3fn
    kernel_backend: str | None = None
    max_num_batched_tokens: int = 8192
    torch_threads: int | None = None  # CPU threads for torch; None: one for a small model, else one per core
    enforce_eager: bool = False  # True: no CUDA graphs
    tensor_parallel_size: int = 1  # ranks (devices) the model is split over
    tp_master_addr: str = "127.0.0.1"  # where the ranks rendezvous (rank 0's host)
    tp_master_port: int | None = None  # None: a free port

    def __post_init__(self) -> None:
        _check_address("model.address", self.address)
        check_fields(self, "model.")


@dataclass(frozen=True, slots=True)
class HttpSection:
    """The OpenAI-compatible HTTP gateway (http_svc), a client of the scheduler's public API."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: `serve all` starts no gateway
    served_model_name: str | None = None  # None: the basename of the scheduler's model directory
    chat_template: str | None = None  # a Jinja file, for a tokenizer without a chat template
    max_request_bytes: int = 4 << 20  # a larger HTTP body gets 413 before it is parsed
    tls_ca: str | None = None  # PEM the gateway trusts for the scheduler's TLS; None: scheduler.tls_cert
    workers: int | None = None  # gateway processes on the one port; None: one per 4 CPUs, 1 to 4 (http_svc.workers)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("http.host must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"http.port must be a port number, got {self.port!r}")
        _positive("http", self, "max_request_bytes", "workers")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("http.served_model_name must not be blank")


ROUTER_POLICIES = ("prefix", "round_robin")


@dataclass(frozen=True, slots=True)
class RouterSection:
    """The router (router_svc): the public scheduler API in front of several replicas. It reads
    their prefix index from the kvcache section's redis_url."""

    address: str = "127.0.0.1:50050"
    replicas: tuple[str, ...] = ()  # the replicas' public scheduler addresses (a YAML list)
    policy: str = "prefix"  # prefix: the longest cached prefix, traded against load; round_robin
    metrics_port: int | None = 9410  # Prometheus /metrics on the router's host; None or 0 = off
    poll_interval_s: float = 0.5  # how often each replica's load and health are asked
    down_after_s: float = 2.0  # a replica that has not answered for this long is taken out
    # Prefix routing gives way to the least loaded replica once the best-hit one has this many
    # more requests (waiting + running) than it.
    max_imbalance: int = 8
    max_request_bytes: int = 4 << 20  # a larger Generate message gets RESOURCE_EXHAUSTED from gRPC
    drain_timeout_s: float = 30.0  # SIGTERM: how long the streams in flight may still run

    def __post_init__(self) -> None:
        _check_address("router.address", self.address)
        replicas = (self.replicas,) if isinstance(self.replicas, str) else tuple(self.replicas)
        object.__setattr__(self, "replicas", replicas)  # a YAML list, or one address
        for i, replica in enumerate(replicas):
            _check_address(f"router.replicas[{i}]", str(replica))
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"router.replicas names a replica twice: {list(replicas)}")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router.policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        _positive("router", self, "poll_interval_s", "down_after_s", "max_request_bytes")
        for name in ("max_imbalance", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"router.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"router.metrics_port must be a port number, got {self.metrics_port!r}")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    kvcache: KVCacheSection = field(default_factory=KVCacheSection)
    model: ModelSection = field(default_factory=ModelSection)
    http: HttpSection = field(default_factory=HttpSection)
    router: RouterSection = field(default_factory=RouterSection)

    @property
    def tokenizer(self) -> str:
        return self.scheduler.tokenizer or self.model.model


# Each section's dataclass (its ServiceConfig field's default factory), by the section's key.
_SECTIONS: dict[str, Any] = {f.name: f.default_factory for f in dataclasses.fields(ServiceConfig)}


def _coerce(section: str, name: str, raw: Any, annotation: str) -> Any:
    """Env values arrive as strings; YAML values as typed scalars."""
    if not isinstance(raw, str) or annotation.startswith("str"):
        return raw
    if annotation.startswith("tuple"):  # a list from the environment: comma-separated
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    if raw.lower() in ("", "none", "null"):
        return None
    try:
        if annotation.startswith("int"):
            return int(raw)
        if annotation.startswith("float"):
            return float(raw)
        if annotation.startswith("bool"):
            return raw.lower() in ("1", "true", "yes", "on")
    except ValueError:
        raise ValueError(f"{section}.{name} must be {annotation}, got {raw!r}") from None
    return raw


def _merge(values: dict[str, dict[str, Any]], section: str, updates: Mapping[str, Any], source: str) -> None:
    if section not in _SECTIONS:
        raise ValueError(f"{source}: unknown section {section!r} (expected one of {sorted(_SECTIONS)})")
    fields = {f.name: str(f.type) for f in dataclasses.fields(_SECTIONS[section])}
    for name, raw in updates.items():
        if name not in fields:
            raise ValueError(f"{source}: unknown key {section}.{name} (known: {', '.join(sorted(fields))})")
        try:
            value = _coerce(section, name, raw, fields[name])
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        if value is None and "None" not in fields[name]:
            values[section].pop(name, None)  # null for a key that needs a value: its default
        else:
            values[section][name] = value


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
) -> ServiceConfig:
    """Defaults < YAML (`path`, else $PICOVLLM_CONFIG) < environment < `overrides` (flags;
    None values are ignored). Raises ValueError naming the bad key or value."""
    env = os.environ if env is None else env
    values: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    path = path or env.get("PICOVLLM_CONFIG") or None
    if path is not None:
        import yaml

        text = Path(path).read_text()
        doc = yaml.safe_load(text) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: expected a mapping of sections, got {type(doc).__name__}")
        for section, body in doc.items():
            if not isinstance(body, dict):
                raise ValueError(f"{path}: section {section!r} must be a mapping")
            _merge(values, section, body, str(path))
    for var, (section, name) in ENV_VARS.items():
        if var in env:
            _merge(values, section, {name: env[var]}, f"${var}")
    if env.get(f"{REDIS_URL_ENV}_FILE"):  # a secret: from a file by the _FILE convention too
        _merge(
            values, "kvcache", {"redis_url": read_secret(REDIS_URL_ENV, env=env, check=False)}, f"${REDIS_URL_ENV}_FILE"
        )
    for section, body in (overrides or {}).items():
        _merge(values, section, {k: v for k, v in body.items() if v is not None}, "flags")
    sections = {name: factory(**values[name]) for name, factory in _SECTIONS.items()}
    return ServiceConfig(**sections)
