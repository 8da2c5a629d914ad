"""The same workload through transformers' continuous batching (`bench/throughput.py --peer hf`):
the same weights (written to the model directory first when they are random), the same
prompts, each request with its own max_new_tokens, sampling at the workload's temperature.
BENCHMARKS.md quotes 618 tok/s for it on the H200.

transformers' continuous-batching API is young and changes between releases; this uses its
common subset (init_continuous_batching, add_request with max_new_tokens, get_result, stop).
"""

from __future__ import annotations

import time

import torch


def run_hf_continuous_batching(
    model_dir: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    temperature: float,
    device: torch.device,
    dtype: torch.dtype,
    timeout_s: float = 1800.0,
    cache_blocks: int | None = None,
) -> tuple[float, int]:
    """Returns (seconds, output tokens) for all requests, from the first add to the last result.
    cache_blocks None lets transformers size its cache from the free memory (on a CPU, from
    the RAM: tens of seconds before the first token); a number fixes it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    gen = GenerationConfig(
        max_new_tokens=max(max_tokens),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0 if temperature > 0 else None,
        top_p=1.0 if temperature > 0 else None,
        eos_token_id=None,
        pad_token_id=0,  # the workload ignores EOS
    )
    if cache_blocks is None:
        manager = model.init_continuous_batching(generation_config=gen)
    else:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        sizes = ContinuousBatchingConfig(num_blocks=cache_blocks, max_batch_tokens=max(map(len, prompts)) + 16)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=sizes)
    manager.start()
    try:
        warm = manager.add_request(prompts[0][:16], request_id="warm-up", max_new_tokens=4)
        manager.get_result(request_id=warm, timeout=600)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        ids = [
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
            for i, (p, n) in enumerate(zip(prompts, max_tokens))
        ]
        pending, tokens = set(ids), 0
        deadline = time.monotonic() + timeout_s
        while pending:
            result = manager.get_result(timeout=max(0.1, deadline - time.monotonic()))
            if result is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"transformers continuous batching: {len(pending)} requests unfinished after {timeout_s:.0f} s"
                    )
                continue
            if result.request_id in pending:
                pending.discard(result.request_id)
                tokens += len(result.generated_tokens)
        return time.perf_counter() - start, tokens
    finally:
        manager.stop(block=True)
