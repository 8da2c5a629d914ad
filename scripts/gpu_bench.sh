#!/usr/bin/env bash
# The GPU results of bench/results/ in one session, most important first, each bounded.
# Usage: bash scripts/gpu_bench.sh OUTDIR
set -uo pipefail
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() { local name=$1; shift; echo "== $name"; timeout "$@" 2>&1 | grep -v "req/s\]\|it/s\]\|\[transformers\]" | tail -16; }
run throughput-ms8 150 python bench/throughput.py --num-scheduler-steps 8 --check --out "$out/throughput_h200_ms8.md"
run latency 90 python bench/latency.py --out "$out/latency_h200.md"
run prefix 90 python bench/prefix.py --out "$out/prefix_h200.md"
run swap 120 python bench/swap.py --out "$out/swap_h200.md"
run throughput-ms1 90 python bench/throughput.py --out "$out/throughput_h200.md"
run gpu-tests 120 python -m pytest -q -m gpu tests/scheduler tests/model tests/kernels -x
