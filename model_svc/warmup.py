"""The model runner's start-up work on dummy inputs: sizing the device KV pool from the memory
a forward and the sampler leave free, and compiling the Triton kernels of start-up and of the
first requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from model_svc.attention_metadata import AttentionMetadata
from model_svc.models.llama import KVCache, LlamaForCausalLM
from model_svc.sampler import Sampler, SamplingBatch


@dataclass(frozen=True)
class ProfileSampling:
    """Sampling knobs for the profiling forward: every truncation on (the costliest path)."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.9
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None


def dummy_prefill(
    lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of a prefill of token-0 prompts of these lengths
    that writes nothing (slots -1) and whose every sequence reads block 0."""
    n = sum(lens)
    positions = torch.cat([torch.arange(k, device=device) for k in lens])
    cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
        block_tables=torch.zeros((len(lens), -(-max(lens) // block_size)), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu,
        is_decode=False,
        max_query_len=max(lens),
    )
    return torch.zeros(n, dtype=torch.long, device=device), positions, meta


def profile_num_blocks(
    model: LlamaForCausalLM,
    sampler: Sampler,
    device: torch.device,
    block_size: int,
    block_bytes: int,
    fraction: float,
    cpu_bytes: int,
    max_tokens: int,
    max_seqs: int,
) -> int:
    """Device blocks that fit: `cpu_bytes` of them on the CPU; on the GPU, what `fraction` of
    the memory leaves after the weights and the activation peak of the largest step."""
    if device.type != "cuda":
        return max(16, cpu_bytes // block_bytes)
    from pico_kernels.compile_ahead import compile_ahead  # Triton is imported only where it runs

    config = model.config
    n = min(max_tokens, config.max_position_embeddings)
    ids, positions, meta = dummy_prefill([n], block_size, device)
    rows = min(n, max_seqs)
    knobs = ProfileSampling()

    @torch.inference_mode()
    def largest_step() -> None:
        hidden = model(ids, positions, [(None, None)] * config.num_hidden_layers, meta)
        # The sampler at the largest batch with every truncation on (its sorts are the
        # largest temporaries): counted in the peak, and its blocks stay in the allocator.
        sampler(model.compute_logits(hidden[-rows:]), SamplingBatch.build([knobs] * rows, None, None, None, device))

    with compile_ahead():  # its kernels compiled side by side first
        largest_step()
    # One forward at the largest batch without a cache measures the activation peak.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    largest_step()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    in_use = torch.cuda.memory_allocated(device)
    budget = int(total * fraction) - (total - free) - (peak - in_use)
    num = budget // block_bytes
    if num < 16:
        raise RuntimeError(f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after the weights")
    return int(num)


@torch.inference_mode()
def compile_kernels(
    model: LlamaForCausalLM,
    sampler: Sampler,
    device: torch.device,
    layer_caches: list[KVCache],
    block_size: int,
    rehearsals: Sequence[Callable[[], None]] = (),
) -> None:
    """Compile, side by side (pico_kernels.compile_ahead), the Triton kernels of the `rehearsals`
    (the CUDA graphs' work, rehearsed before their capture) and of what the graphs do not
    run: paged prefills with a long and with short new-token runs (the prefill kernel's two
    tilings; nothing written: slots -1; they read block 0, whatever it holds) and
    temperature sampling. So they compile at start-up, all at once, not one after another
    in the graphs' capture or in the middle of the first requests (a second or two each on
    a fresh machine)."""
    from pico_kernels.compile_ahead import compile_ahead  # Triton is imported only where it runs

    with compile_ahead():
        for rehearse in rehearsals:
            rehearse()
        for lens in ([80], [16, 16]):  # the prefill kernel's tiles for long and for short new-token runs
            ids, positions, meta = dummy_prefill(lens, block_size, device)
            hidden = model(ids, positions, layer_caches, meta)
        plain = ProfileSampling(top_k=0, top_p=1.0, min_p=0.0)  # temperature only: the fused kernel
        params = [plain, ProfileSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)]
        sampler(model.compute_logits(hidden[:2]), SamplingBatch.build(params, None, None, None, device))
        torch.cuda.synchronize(device)
