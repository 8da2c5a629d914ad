#!/usr/bin/env bash
# Install pico-vllm with its test extras and run the test suite on the CPU.
# Installs what a newcomer gets: the newest release inside every range pyproject.toml declares
# (upgrading older copies already on the machine), with the CPU build of torch.
# Service tests start their own redis-server on free loopback ports.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="torch==2.13.0"
# The CPU wheel index: a bare `torch` from the default index is the multi-GB CUDA build.
python3 -m pip install -q --index-url https://download.pytorch.org/whl/cpu "$TORCH"
python3 -m pip install -q --upgrade --upgrade-strategy eager "$TORCH" -e ".[test]"

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 || true
  fi
  command -v redis-server >/dev/null 2>&1 || echo "note: redis-server not found (install it, e.g. apt-get install redis-server); tests that need Redis will be skipped" >&2
fi

python3 -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|grpcio|protobuf|redis|locust) ' | tr -s ' ' | paste -sd ';' | sed 's/^/versions: /'
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
if [ "$#" -gt 0 ]; then
  exec python3 -m pytest -q "$@"
fi
# The whole suite (no arguments, as CI runs it) type-checks the product packages first
# (pyproject.toml's [tool.mypy]); ruff's check and format run inside it (tests/test_style.py).
# The interpreted kernel tests are CPU-bound and share nothing, so they run on up to four
# workers (pytest-xdist); the rest start real processes, bind ports and keep deadlines, and
# run one at a time after them. Both parts always run; the exit status is the first failure's.
python3 -m mypy
kernels=0
python3 -m pytest -q -n auto --maxprocesses 4 tests/kernels || kernels=$?
rest=0
python3 -m pytest -q --ignore=tests/kernels || rest=$?
exit $((kernels ? kernels : rest))
