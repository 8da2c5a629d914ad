#!/usr/bin/env bash
# The GPU results of bench/results/ in one session, most important first, each bounded.
# Usage: bash scripts/gpu_bench.sh OUTDIR
set -uo pipefail
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() { local name=$1; shift; echo "== $name"; timeout "$@" 2>&1 | grep -v "req/s\]\|it/s\]\|\[transformers\]" | tail -16; }
run throughput 240 python bench/throughput.py --check --mode service --out "$out/throughput_h200.md"
run latency 70 python bench/latency.py --out "$out/latency_h200.md"
run prefix 70 python bench/prefix.py --out "$out/prefix_h200.md"
run gpu-tests 100 python -m pytest -q -m gpu tests/scheduler tests/model tests/kernels -x
run kernels 100 python bench/kernels.py --flex-budget-s 30 --out "$out/kernels_h200.md"
run throughput-overlap 60 python bench/throughput.py --overlap --out "$out/throughput_h200_overlapped.md"
