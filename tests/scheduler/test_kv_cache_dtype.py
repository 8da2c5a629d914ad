"""kv_cache_dtype="fp8" through the public API, the CLI and the service config: the KV pool holds
float8_e4m3fn at a quarter of an fp32 cache's bytes (half a 16-bit one's), generation follows the
exact cache, and a bad value is one clear error."""

from __future__ import annotations

import pytest
import torch

from contracts.sampling_params import SamplingParams
from contracts.service_config import ModelSection
from scheduler_svc.config import EngineConfig
from scheduler_svc.llm import LLM
from tests.test_cli import run_cli

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went", "One day, a bird"]


def greedy_runs(device: str, **engine_kwargs) -> dict[str, tuple]:
    """(runner, greedy token ids of PROMPTS) with the exact cache and with the FP8 one."""
    params = SamplingParams(temperature=0, max_tokens=32)
    runs = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(kv_cache_dtype=kv_cache_dtype, num_cpu_blocks=0, device=device, **engine_kwargs)
        ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        runs[kv_cache_dtype] = (llm.engine.model, ids)
    return runs


def test_fp8_cache_follows_the_exact_one():
    """On the bundled model (fp32 on the CPU) the FP8 cache's greedy tokens start as the exact
    cache's: measured, the four prompts agree for their first 100, 28, 13 and 20 tokens."""
    runs = greedy_runs("cpu")
    (exact, exact_ids), (fp8, fp8_ids) = runs["auto"], runs["fp8"]
    assert exact.pools.layer_caches[0][0].dtype == torch.float32
    assert fp8.pools.layer_caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.pools.num_device_blocks == 4 * exact.pools.num_device_blocks  # the same bytes
    assert exact_ids[0] == fp8_ids[0]
    assert all(a[:12] == b[:12] for a, b in zip(exact_ids, fp8_ids)), (exact_ids, fp8_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_cache_on_the_gpu_follows_the_exact_one():
    """bf16 on the GPU, through the Triton kernels and the CUDA graphs: the FP8 cache's greedy
    tokens start as the bf16 cache's, in a pool of the same bytes twice the blocks."""
    runs = greedy_runs("cuda", num_gpu_blocks=512)
    (exact, exact_ids), (fp8, fp8_ids) = runs["auto"], runs["fp8"]
    assert exact.pools.layer_caches[0][0].dtype == torch.bfloat16
    assert fp8.pools.device_cache.nbytes * 2 == exact.pools.device_cache.nbytes
    assert all(a[:8] == b[:8] for a, b in zip(exact_ids, fp8_ids)), (exact_ids, fp8_ids)


def test_a_bad_kv_cache_dtype_is_one_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="model.kv_cache_dtype must be"):
        ModelSection(kv_cache_dtype="fp16")
    proc = run_cli("generate", "x", "--kv-cache-dtype", "int4")
    assert proc.returncode == 2 and "invalid choice: 'int4'" in proc.stderr and "Traceback" not in proc.stderr
