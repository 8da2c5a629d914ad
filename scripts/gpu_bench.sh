#!/usr/bin/env bash
# The GPU results of bench/results/ in parts that each fit one ten-minute run.
# Usage: bash scripts/gpu_bench.sh OUTDIR [a|b|c|d|p|q|f|g|w|h|k|s|u|r|t|v|all]
#   a: GPU tests and numerics, greedy parity (bf16 Qwen3-0.6B shape), per-phase device times
#      (B=1 and B=256), host profile of the engine step
#   b: headline throughput embedded + service mode (with the parity check), batch-1 latency,
#      prefix caching
#   c: kernel tables (decode, prefill, baselines), gemv vs cuBLAS, prefix caching with
#      synchronous scheduling, swap vs recompute, service mode with the pipelined scheduler
#   p: a quick look: GPU tests, parity, batch-1 profile and latency, throughput embedded and pipelined service
#   q: after kernel changes: GPU numerics, parity, batch-1 profile + latency, projections, headline
#   f: a session's headline figures: GPU tests, embedded (pipeline depth 2, and 1 for
#      comparison), service mode (pipelined, with the parity check)
#   g: batch-1 latency, swap vs recompute, prefix caching
#   w: prefill attention at 4k with 0 and 3k cached (the quick tables), start-up to first
#      token with an empty and a warm Triton cache
#   h: GPU tests and the headline (embedded, workload warm-up)
#   k: KV-cache groups: a hybrid sliding-window model vs all-full at 8k-32k contexts, and n=8
#      parallel sampling
#   s: the service as users call it: streaming gRPC (256 and 8 streams) and HTTP vs embedded
#   u: the user path: LLM(model=dir) with defaults and the real Qwen2 tokenizer (then the
#      in-memory row); detokenization's cost on this host's CPU, both decode paths
#   r: two replicas behind the router vs round-robin vs one engine (needs redis-server)
#   d: transformers' continuous batching on the headline workload (BENCHMARKS.md: ~618 tok/s)
#   t: tensor parallelism on 4 GPUs (not in `all`): the multi-GPU tests, greedy parity and
#      throughput of TP=1,2,4 on the headline shape (CUDA graphs, and a short eager run)
#   v: tensor parallelism on 4 GPUs (not in `all`): the same on an 8B-class shape (Qwen3-8B's)
set -uo pipefail
out="${1:-bench/results}"
part="${2:-all}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() { local name=$1; shift; echo "== $name"; timeout "$@" 2>&1 | grep -v "req/s\]\|it/s\]\|s/it\]\|\[transformers\]" | tail -${TAIL:-16}; }
has() { [ "$part" = "$1" ] || [ "$part" = all ]; }
if has a; then
  run gpu-tests 150 python -m pytest -q -m gpu tests/scheduler tests/model tests/kernels -x
  run gpu-kernel-numerics 60 python -m pytest -q tests/kernels/test_linear.py tests/kernels/test_sample.py tests/kernels/test_kernels.py -k "gemv or dispatch or rounds_like or greedy_rows or sampled_rows or seed_decides or sampler"
  run parity 120 python bench/parity.py
  run parity-prefill-2-terms 120 python bench/parity.py --prefill-p-terms 2
  TAIL=40 run profile-b1 90 python bench/profile_gpu.py --batch 1 --context 512 --temperature 0 --rows 30
  run profile-b256 90 python bench/profile_gpu.py --batch 256 --context 600 --skip-eager
  TAIL=45 run profile-step 100 python bench/profile_step.py --top 30
fi
if has b; then
  run throughput 150 python bench/throughput.py --no-user-path --repeats 3 --out "$out/throughput_h200.md"
  run throughput-sync 150 python bench/throughput.py --no-user-path --no-overlap --repeats 3 --out "$out/throughput_h200_sync.md"
  run throughput-service 240 python bench/throughput.py --no-user-path --check --mode service --out "$out/throughput_h200_service.md"
  run latency 90 python bench/latency.py --out "$out/latency_h200.md"
  run prefix 120 python bench/prefix.py --out "$out/prefix_h200.md"
fi
if has c; then
  run kernels 150 python bench/attention.py --flex-budget-s 30 --out "$out/kernels_h200.md"
  run linear 60 python bench/linear.py --out "$out/linear_h200.md"
  run prefix-sync 120 python bench/prefix.py --no-overlap --out "$out/prefix_h200_sync.md"
  run swap 120 python bench/swap.py --out "$out/swap_h200.md"
  run throughput-service-pipelined 200 python bench/throughput.py --no-user-path --mode service --service-pipelined --out "$out/throughput_h200_service_pipelined.md"
fi
if has p; then  # a first look after changes: tests, parity, where batch-1 time goes, one throughput run
  run gpu-tests 150 python -m pytest -q -m gpu tests/scheduler tests/model tests/kernels -x
  run parity 120 python bench/parity.py
  TAIL=40 run latency-profile 90 python bench/latency.py --profile
  run latency 90 python bench/latency.py
  TAIL=40 run profile-b1 90 python bench/profile_gpu.py --batch 1 --context 512 --temperature 0 --rows 30 --skip-eager
  run throughput 150 python bench/throughput.py --no-user-path --repeats 2
  run throughput-service-pipelined 200 python bench/throughput.py --no-user-path --mode service --service-pipelined
fi
if has q; then  # after kernel changes: numerics on the GPU, parity, batch-1 latency, projections, headline
  run gpu-tests 150 python -m pytest -q -m gpu tests/scheduler tests/model tests/kernels -x
  run gpu-kernel-numerics 90 python -m pytest -q -x tests/kernels/test_linear.py tests/kernels/test_fused.py -k "gemv or store"
  run parity 120 python bench/parity.py
  TAIL=36 run latency-profile 90 python bench/latency.py --profile
  run latency 90 python bench/latency.py --out "$out/latency_h200.md"
  TAIL=30 run linear 90 python bench/linear.py --rows 1,2,4,8 --out "$out/linear_h200.md"
  run throughput 150 python bench/throughput.py --no-user-path --repeats 3 --out "$out/throughput_h200.md"
fi
if has f; then  # a session's headline figures in one call: tests, embedded (depth 2 and 1), service
  run gpu-tests 120 python -m pytest -q -m gpu tests/scheduler tests/model tests/kernels -x
  run throughput 150 python bench/throughput.py --no-user-path --repeats 3 --warmup workload --out "$out/throughput_h200.md"
  run throughput-depth-1 90 python bench/throughput.py --no-user-path --warmup workload --pipeline-depth 1
  run throughput-service 200 python bench/throughput.py --no-user-path --check --mode service --warmup workload --out "$out/throughput_h200_service.md"
fi
if has g; then  # the rest of a session's figures: batch-1 latency, swap, prefix caching
  run latency 70 python bench/latency.py --out "$out/latency_h200.md"
  run swap 90 python bench/swap.py --out "$out/swap_h200.md"
  run prefix 120 python bench/prefix.py --out "$out/prefix_h200.md"
fi
if has w; then  # prefill attention's quick tables, LLM() start-up cold and warm
  run prefill-attention 150 python bench/attention.py --quick --no-flex --out "$out/kernels_prefill_h200.md"
  run startup 240 python bench/startup.py --model qwen3-0.6b --warm-runs 2 --out "$out/startup_h200.md"
fi
if has u; then  # the user path first, as bench/throughput.py reports it; detokenization on the host
  run throughput-user-path 420 python bench/throughput.py --user-path-tokenizers qwen2,none,bytes --out "$out/throughput_user_path_h200.md"
  run detok 120 python bench/detok.py --out "$out/detok_h200_host.md"
fi
if has h; then  # GPU tests and the headline alone
  run gpu-tests 150 python -m pytest -q -m gpu tests/scheduler tests/model tests/kernels -x
  run throughput 150 python bench/throughput.py --no-user-path --repeats 3 --warmup workload --out "$out/throughput_h200.md"
fi
if has k; then  # KV-cache groups (bench/hybrid.py) and copy-on-write (parallel sampling)
  run hybrid 420 python bench/hybrid.py --out "$out/hybrid_h200.md"
  run parallel-sampling 150 python bench/parallel_sampling.py --out "$out/parallel_sampling_h200.md"
fi
if has s; then  # the service through its public APIs, each against embedded or gRPC in the same run
  run serve 330 python bench/serve.py --model qwen3-0.6b --device cuda --clients 4 --out "$out/serve_h200.md"
  run http-vs-grpc 250 python bench/http_vs_grpc.py --model qwen3-0.6b --device cuda --repeats 2 --out "$out/http_vs_grpc_h200.md"
fi
if has r; then  # replicas sharing the GPU behind the router, on the multi-tenant workload
  TAIL=12 run router 560 python bench/router.py --model qwen3-0.6b --device cuda --out "$out/router_h200.md"
fi
if [ "$part" = t ]; then  # 4 GPUs of one host; NVLink SHARP (NVLS) off
  export NCCL_NVLS_ENABLE=0
  run gpu-tests-tp 120 python -m pytest -q -m gpu tests/model/test_tensor_parallel.py -x
  run tp 330 python bench/tp.py --out "$out/tp_h200.md"
  run tp-eager 140 python bench/tp.py --enforce-eager --num-seqs 32 --max-len 256 --out "$out/tp_h200_eager.md"
fi
if [ "$part" = v ]; then  # 4 GPUs of one host: the 8B-class shape
  export NCCL_NVLS_ENABLE=0
  run tp-8b 580 python bench/tp.py --model qwen3-8b --num-seqs 128 --out "$out/tp_8b_h200.md"
fi
if has d; then
  run throughput-hf-peer 500 python bench/throughput.py --no-user-path --peer hf --out "$out/throughput_h200_hf_peer.md"
fi
