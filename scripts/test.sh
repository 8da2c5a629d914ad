#!/usr/bin/env bash
# Install pico-vllm with its test extras and run the test suite on the CPU.
# Starts a throwaway redis-server when none answers on 127.0.0.1:6379 (service tests need it).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q "torch==2.13.0" 2>/dev/null || python3 -m pip install -q torch
python3 -m pip install -q -e ".[test]"

# Service tests start their own redis-server on free ports: make sure the binary is there.
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 || true
  fi
  command -v redis-server >/dev/null 2>&1 || echo "note: redis-server not found (install it, e.g. apt-get install redis-server); tests that need Redis will be skipped" >&2
fi

export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python3 -m pytest -q "$@"
