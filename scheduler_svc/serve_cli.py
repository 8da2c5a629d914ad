"""`picovllm serve scheduler|kvcache|model|http|all`: run the gRPC services and the HTTP gateway.

`all` starts the four as child processes (a one-machine deployment; the OpenAI-compatible
HTTP gateway unless --port 0) and stops them together: SIGTERM stops the gateway (its requests
in flight finish), drains the scheduler, then stops the other two. It checks its ports
before it starts anything, and a child that fails at start-up stops the rest.

Secrets never travel in argv, where every local user reads them: the Redis URL (it may carry
a password), the internal token and the API key come from PICOVLLM_* variables or files
(contracts.auth), and `all` hands them to its children in their environment, each child
only what it needs. `all` makes a random internal token per launch when none is configured.
`kvcache`, `model` and `scheduler` run alone need the internal token (the same in each), or
--insecure-no-auth to run without one.

A service that cannot start for a reason an operator can fix (a port that is taken, a missing
model, a bad config value) says so in one line and exits with status 2; when it is ready it
prints one line naming every address it listens on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import time

from contracts.auth import API_KEY_ENV, INTERNAL_TOKEN_ENV, REDIS_URL_ENV, Credentials, read_secret, url_has_credentials
from scheduler_svc.cli_args import UsageError, add_log_flags

logger = logging.getLogger(__name__)

# flag -> (section, key, type, help); flags override the environment and the YAML file. The
# help gets the key's default from the default config appended (_default_text). A table, one
# flag a line: not reformatted.
FLAGS: dict[str, tuple[str, str, type, str]] = {
    "--scheduler-addr": ("scheduler", "address", str, "the scheduler's public gRPC address, host:port"),
    "--kvcache-addr": ("kvcache", "address", str, "the KV-cache service's gRPC address (internal)"),
    "--model-addr": ("model", "address", str, "the model service's gRPC address (internal)"),
    "--redis-url": ("kvcache", "redis_url", str, "Redis URL of the KV-cache metadata, e.g. redis://127.0.0.1:6379/0; "
                    f"one with a password goes in ${REDIS_URL_ENV} or --redis-url-file, never here"),
    "--deployment": ("kvcache", "deployment", str, "namespace of the Redis keys"),
    "--metrics-port": ("scheduler", "metrics_port", int,
                       "HTTP port of the Prometheus /metrics, on the scheduler's host; 0 = off"),
    "--max-waiting": ("scheduler", "max_waiting", int, "queued requests beyond this are refused (RESOURCE_EXHAUSTED)"),
    "--max-num-seqs": ("scheduler", "max_num_seqs", int, "sequences in one step at most"),
    "--max-num-batched-tokens": ("scheduler", "max_num_batched_tokens", int,
                                 "tokens in one step at most (prompt chunks included)"),
    "--max-model-len": ("scheduler", "max_model_len", int, "prompt + output tokens of one request at most"),
    "--preemption-mode": ("scheduler", "preemption_mode", str,
                          "swap | recompute: what a preempted request does with its KV blocks"),
    "--drain-timeout": ("scheduler", "drain_timeout_s", float,
                        "on SIGTERM, seconds the in-flight requests may still run"),
    "--dependency-timeout": ("scheduler", "dependency_timeout_s", float, "seconds a request may wait on an unreachable "
                             "model or KV-cache service before it gets UNAVAILABLE"),
    "--tls-cert": ("scheduler", "tls_cert", str,
                   "PEM certificate chain: serve the public API over TLS (with --tls-key)"),
    "--tls-key": ("scheduler", "tls_key", str, "PEM private key of --tls-cert"),
    "--model": ("model", "model", str, "a local Hugging Face model directory, or a repo id already in the local "
                "Hugging Face cache; never downloaded"),
    "--block-size": ("model", "block_size", int, "tokens per KV-cache block (a power of two)"),
    "--num-gpu-blocks": ("model", "num_gpu_blocks", int, "device KV pool size in blocks"),
    "--num-cpu-blocks": ("model", "num_cpu_blocks", int, "host (swap) KV pool size in blocks"),
    "--device": ("model", "device", str, "cpu or cuda"),
    "--dtype": ("model", "dtype", str, "float32, bfloat16 or float16"),
    "--torch-threads": ("model", "torch_threads", int, "CPU threads for torch"),
    "--host": ("http", "host", str, "the HTTP gateway's (OpenAI-compatible API's) host"),
    "--port": ("http", "port", int, "the HTTP gateway's port; 0: `serve all` starts no gateway"),
    "--served-model-name": ("http", "served_model_name", str, "the model's name in the HTTP API"),
    "--chat-template": ("http", "chat_template", str, "a Jinja chat template file, for a tokenizer without one"),
    "--http-workers": ("http", "workers", int, "HTTP gateway processes sharing its port"),
}  # fmt: skip
# What a default of None means, where the help cannot just show the value.
NONE_MEANS = {
    "redis_url": "none, metadata in memory",
    "max_model_len": "the model's limit",
    "num_gpu_blocks": "measured from free memory",
    "num_cpu_blocks": "1 GiB of blocks, at most 4x the device pool",
    "device": "cuda if available, else cpu",
    "dtype": "bfloat16 on cuda, float32 on cpu",
    "torch_threads": "1 for a model under 100M parameters, else one per core",
    "tls_cert": "none, plaintext",
    "tls_key": "none",
    "served_model_name": "the basename of the model directory",
    "chat_template": "the tokenizer's",
    "workers": "one per 4 CPUs, 1 to 4",
}
# Files of secrets: flag -> (environment variable, help). The variable itself, or VAR_FILE
# naming a file, works as well; the flag wins.
SECRET_FILES: dict[str, tuple[str, str]] = {
    "--redis-url-file": (
        REDIS_URL_ENV,
        "a file holding the Redis URL, which may carry a password "
        "(default: $PICOVLLM_REDIS_URL, else the KV metadata stays in memory)",
    ),
    "--internal-token-file": (
        INTERNAL_TOKEN_ENV,
        "a file holding the internal token, the same for the three services "
        "(default: $PICOVLLM_INTERNAL_TOKEN; `serve all` makes one per launch)",
    ),
    "--api-key-file": (
        API_KEY_ENV,
        "a file holding the API key the public API then requires as 'authorization: Bearer <key>' "
        "(default: $PICOVLLM_API_KEY, else no key)",
    ),
}
SECRET_VARS = tuple(v for var, _ in SECRET_FILES.values() for v in (var, f"{var}_FILE"))
KINDS = ("scheduler", "kvcache", "model", "http", "all")
CHILDREN = ("kvcache", "model", "scheduler", "http")


def _default_text(section: str, key: str) -> str:
    from contracts.service_config import BUNDLED_MODEL, ServiceConfig

    value = getattr(getattr(ServiceConfig(), section), key)
    shown = (
        "the bundled stories260k" if value == BUNDLED_MODEL else NONE_MEANS.get(key, "none") if value is None else value
    )
    return f"(default: {shown}; config key {section}.{key})"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run a gRPC service (scheduler, kvcache, model), the HTTP gateway, or all",
        description="Run a gRPC service, the OpenAI-compatible HTTP gateway, or all four as processes on "
        "this machine. Settings come from the "
        "defaults shown, then --config (or $PICOVLLM_CONFIG), then PICOVLLM_* variables, then flags.",
    )
    p.add_argument("kind", choices=KINDS, help="which service; 'all' runs them all as processes on this machine")
    p.add_argument(
        "--config",
        default=None,
        help="YAML file with scheduler/kvcache/model sections (default: $PICOVLLM_CONFIG, else none)",
    )
    for flag, (section, key, typ, text) in FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=f"{text} {_default_text(section, key)}")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn prefix caching off (default: on; config key scheduler.enable_prefix_caching)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pipeline the model steps, two ahead (default: on when the model service runs on a GPU; "
        "config key scheduler.async_scheduling)",
    )
    p.add_argument(
        "--listen",
        default=None,
        help="bind this address instead of the service's own, e.g. 0.0.0.0:50052 in a container "
        "(default: the service's address)",
    )
    for flag, (_, text) in SECRET_FILES.items():
        p.add_argument(flag, default=None, metavar="FILE", help=text)
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="let the internal services run without the internal token: anyone who reaches them can read and "
        "corrupt other users' state (default: off; docs/SECURITY.md)",
    )
    add_log_flags(p)
    p.set_defaults(func=cmd_serve)


def config_from_args(args: argparse.Namespace):
    from contracts.service_config import load_config

    overrides: dict[str, dict] = {"scheduler": {}, "kvcache": {}, "model": {}, "http": {}}
    for flag, (section, key, _, _) in FLAGS.items():
        overrides[section][key] = getattr(args, flag[2:].replace("-", "_"))
    if url_has_credentials(args.redis_url):
        raise ValueError(
            f"--redis-url carries a password, which every local user can read in the process list: "
            f"put the URL in ${REDIS_URL_ENV} or a file (--redis-url-file FILE)"
        )
    if args.redis_url_file:
        overrides["kvcache"]["redis_url"] = read_secret(REDIS_URL_ENV, args.redis_url_file, check=False)
    if args.no_prefix_caching:
        overrides["scheduler"]["enable_prefix_caching"] = False
    if args.async_scheduling is not None:
        overrides["scheduler"]["async_scheduling"] = args.async_scheduling
    return load_config(args.config, overrides)


def with_local_model(config, kind: str):
    """The config with its model and tokenizer as local directories (a repo id resolved from
    the local Hugging Face cache), for the services of `kind` that load them."""
    from scheduler_svc.config import resolve_model

    model, scheduler = config.model, config.scheduler
    if kind in ("model", "all"):
        model = dataclasses.replace(model, model=resolve_model(model.model))
    if kind in ("scheduler", "http", "all"):  # the gateway renders chat templates with the scheduler's tokenizer
        scheduler = dataclasses.replace(scheduler, tokenizer=resolve_model(config.tokenizer))
    return dataclasses.replace(config, model=model, scheduler=scheduler)


def child_argv(args: argparse.Namespace, kind: str) -> list[str]:
    argv = [sys.executable, "-m", "scheduler_svc.cli"] + (["-v"] if args.verbose else [])
    argv += (["--log-level", args.log_level] if args.log_level else []) + ["serve", kind]
    if args.config:
        argv += ["--config", args.config]
    for flag in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and flag != "--redis-url":  # the Redis URL goes by the environment (child_env)
            argv += [flag, str(value)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if args.insecure_no_auth:
        argv.append("--insecure-no-auth")
    if args.async_scheduling is not None:
        argv.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    return argv


def child_env(kind: str, config, creds: Credentials) -> dict[str, str]:
    """The environment of `serve all`'s `kind` child: this one without secrets, then the
    secrets that child needs (never in its argv)."""
    # PICOVLLM_LISTEN is one service's bind address: three children must not share it.
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARS and k != "PICOVLLM_LISTEN"}
    env["PICOVLLM_QUIET_READY"] = "1"  # one readiness line, from serve all, for the three
    if creds.internal_token:
        env[INTERNAL_TOKEN_ENV] = creds.internal_token
    if kind == "kvcache" and config.kvcache.redis_url:
        env[REDIS_URL_ENV] = config.kvcache.redis_url
    if kind in ("scheduler", "http") and creds.api_key:
        env[API_KEY_ENV] = creds.api_key
    if kind == "http":  # it calls only the public API
        env.pop(INTERNAL_TOKEN_ENV, None)
    return env


def credentials_from_args(args: argparse.Namespace) -> Credentials:
    """The internal token and API key of `args.kind` (SecretError: unreadable or unusable)."""
    token = (
        None if args.kind == "http" else read_secret(INTERNAL_TOKEN_ENV, args.internal_token_file)
    )  # public API only
    if token is None and not args.insecure_no_auth and args.kind != "http":
        if args.kind != "all":
            raise UsageError(
                f"{args.kind} service: no internal token: set ${INTERNAL_TOKEN_ENV} or --internal-token-file FILE "
                f"(the same for the three services), or --insecure-no-auth to run without one"
            )
        token = secrets.token_urlsafe(32)  # this launch's: the children get it by environment
    api_key = read_secret(API_KEY_ENV, args.api_key_file) if args.kind in ("scheduler", "http", "all") else None
    return Credentials(token, api_key)


def cmd_serve(args: argparse.Namespace) -> int:
    from contracts.errors import PicoError
    from contracts.rpc import ListenError

    config = _config_or_usage_error(args)
    try:
        creds = credentials_from_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.listen:
        if args.kind == "all":
            raise UsageError("--listen applies to one service, not 'all'")
        os.environ["PICOVLLM_LISTEN"] = args.listen
    if args.kind == "all":
        return serve_all(args, config, creds)
    try:
        if args.kind == "http":
            from http_svc.workers import run as run_http

            return run_http(config, creds)
        asyncio.run(_serve_one(args.kind, config, creds))
    except (OSError, ValueError, PicoError) as exc:  # a taken port, a model that cannot load, peers that never came up
        logger.debug("the %s service failed to start", args.kind, exc_info=True)
        raise UsageError(str(exc) if isinstance(exc, ListenError) else f"{args.kind} service: {exc}") from None
    return 0


def _config_or_usage_error(args: argparse.Namespace):
    """The config with a local model directory; any error in it as one line (UsageError)."""
    import yaml

    try:
        return with_local_model(config_from_args(args), args.kind)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        if isinstance(exc, OSError) and exc.filename:  # the --config file
            raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None
        if isinstance(exc, yaml.YAMLError):  # its message spans lines
            path = args.config or os.environ.get("PICOVLLM_CONFIG")
            raise UsageError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        raise UsageError(str(exc)) from None


async def _serve_one(kind: str, config, creds: Credentials) -> None:
    if kind == "kvcache":
        from kvcache_svc.server import serve

        await serve(config.kvcache, token=creds.internal_token)
    elif kind == "model":
        from model_svc.server import serve as serve_model

        s = config.scheduler
        await serve_model(config.model, s.max_num_seqs, creds.internal_token, async_scheduling=s.async_scheduling)
    else:
        from scheduler_svc.server import serve as serve_scheduler

        await serve_scheduler(config, creds)


def _addresses(config) -> dict[str, str]:
    """What `serve all` listens on, by what: the three services' gRPC, the metrics, the gateway."""
    s = config.scheduler
    found = {kind: getattr(config, kind).address for kind in ("scheduler", "kvcache", "model")}
    if s.metrics_port:
        found["metrics"] = f"{s.address.rpartition(':')[0]}:{s.metrics_port}"
    if config.http.port:
        host = config.http.host
        found["http"] = f"[{host}]:{config.http.port}" if ":" in host else f"{host}:{config.http.port}"
    return found


def _dial(address: str) -> str:
    """An address to connect to for one a server listens on (a wildcard host: loopback)."""
    host, _, port = address.rpartition(":")
    return f"{ {'0.0.0.0': '127.0.0.1', '[::]': '[::1]'}.get(host, host) }:{port}"


def serve_all(args: argparse.Namespace, config, creds: Credentials) -> int:
    """The services as children; the first to exit (or a signal) stops the rest."""
    from contracts.rpc import ListenError, announce, check_can_listen

    addresses = _addresses(config)
    try:  # before any child starts: a second copy must not get half-way up
        for what, address in addresses.items():
            check_can_listen(address, {"metrics": "metrics", "http": "HTTP"}.get(what, ""))
    except ListenError as exc:
        raise UsageError(str(exc)) from None
    try:
        tls_root = _read(config.scheduler.tls_cert)  # its own certificate: trusted by the readiness check
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None
    children = {
        kind: subprocess.Popen(child_argv(args, kind), env=child_env(kind, config, creds), preexec_fn=_die_with_parent)
        for kind in CHILDREN
        if kind != "http" or "http" in addresses
    }
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code, ready = 0, False
    ready_children: set[str] = set()  # each gets its drain time on a stop, even before all are up

    def look() -> None:
        ready_children.update(
            k for k in children if k not in ready_children and _child_ready(k, _dial(addresses[k]), tls_root)
        )

    while not stopping:
        exited = [(k, p.returncode) for k, p in children.items() if p.poll() is not None]
        if exited:
            kind, code = exited[0]
            if code != 2:  # 2: the child has said why in its one line
                when = "" if ready else " while starting"
                print(
                    f"picovllm: error: the {kind} service exited{when} (status {code}); stopping the others",
                    file=sys.stderr,
                )
            code = code if code > 0 else 1
            break
        if not ready:
            look()
        if not ready and len(ready_children) == len(children):
            ready = True
            metrics = f", metrics http://{addresses['metrics']}/metrics" if "metrics" in addresses else ""
            gateway = f"HTTP API (OpenAI-compatible) http://{addresses['http']}/v1; " if "http" in addresses else ""
            announce(
                f"ready: {gateway}scheduler gRPC {addresses['scheduler']}{metrics}; "
                f"kvcache gRPC {addresses['kvcache']}; model gRPC {addresses['model']}"
            )
        time.sleep(0.2)
    # The gateway first (its requests in flight finish), then the scheduler drains while its
    # peers still run.
    if not ready:  # a signal may come between a child's start and the loop's last look
        look()
    for kind in ("http", "scheduler", "model", "kvcache"):
        if kind in children:
            # A child that never came up has nothing to drain: the operator gets the prompt back soon.
            _stop(
                children[kind], timeout=(60 if kind in ("http", "scheduler") else 15) if kind in ready_children else 3
            )
    return code


def _child_ready(kind: str, address: str, tls_root: bytes | None) -> bool:
    from contracts.health import check_health

    if kind == "http":
        from http_svc.health import check

        return check(address, timeout=0.5)
    return check_health(address, timeout=0.5, root_certificates=tls_root if kind == "scheduler" else None)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _die_with_parent() -> None:
    """Linux: a child gets SIGTERM when `serve all` dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
