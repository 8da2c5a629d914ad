"""The flags of `picovllm serve` that set config keys, and the files of secrets: tables that
scheduler_svc.serve_cli turns into arguments, overrides and the children's argv."""

from __future__ import annotations

from contracts.auth import API_KEY_ENV, INTERNAL_TOKEN_ENV, REDIS_URL_ENV

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
    "--kv-cache-dtype": ("model", "kv_cache_dtype", str, "auto (the model's dtype) or fp8 (float8_e4m3fn, "
                         "half the bytes a token; not bit-exact)"),
    "--torch-threads": ("model", "torch_threads", int, "CPU threads for torch"),
    "--tensor-parallel-size": ("model", "tensor_parallel_size", int,
                               "split the model over this many devices (one process each)"),
    "--tp-master-addr": ("model", "tp_master_addr", str, "where the tensor-parallel ranks rendezvous"),
    "--tp-master-port": ("model", "tp_master_port", int, "the rendezvous port of the tensor-parallel ranks"),
    "--host": ("http", "host", str, "the HTTP gateway's (OpenAI-compatible API's) host"),
    "--port": ("http", "port", int, "the HTTP gateway's port; 0: `serve all` starts no gateway"),
    "--served-model-name": ("http", "served_model_name", str, "the model's name in the HTTP API"),
    "--chat-template": ("http", "chat_template", str, "a Jinja chat template file, for a tokenizer without one"),
    "--http-workers": ("http", "workers", int, "HTTP gateway processes sharing its port"),
    "--router-addr": ("router", "address", str, "the router's public gRPC address, host:port"),
    "--policy": ("router", "policy", str, "the router's policy: prefix (cache affinity, traded against load) "
                 "or round_robin"),
    "--router-metrics-port": ("router", "metrics_port", int, "HTTP port of the router's Prometheus /metrics; 0 = off"),
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
    "tp_master_port": "a free port",
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
