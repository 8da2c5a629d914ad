#!/usr/bin/env bash
# One GPU session: the GPU tests, then the headline throughput benchmark with its parity check.
# Usage: bash scripts/gpu_check.sh OUTDIR
set -uo pipefail
out="${1:-bench/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
python -m pytest -q -m gpu tests/scheduler tests/model -x 2>&1 | tail -15 | tee "$out/gpu_tests.log"
python bench/throughput.py --check --out "$out/throughput_h200.md" 2>&1 | grep -v "it/s\]\|req/s\]" | tee "$out/throughput.log"
