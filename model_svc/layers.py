"""Building blocks shared by the model families: RMSNorm (with fused residual add), rotary
embedding, SiluAndMul, linear and merged linear projections, and the paged Attention layer.

Tokens of all sequences in a step are flattened into one batch of N tokens; there is no
batch or padding dimension anywhere below the model.

With the Triton kernel ops (CUDA), RMSNorm, SiluAndMul and the q/k norm + rotary run as the
fused kernels of pico_kernels.triton_fused, and projections of a few rows (decode at small batch) as
pico_kernels.triton_linear; otherwise the torch code here runs (it is the reference).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import ModuleType
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from model_svc.attention_metadata import AttentionMetadata
from model_svc.config import RopeScaling
from pico_kernels.ops import KernelOps
from pico_kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

# The torch path of these layers is the kernels' reference math, not a copy of it.
apply_rotary = rotary_ref


def triton_module(ops: KernelOps | None, name: str) -> ModuleType | None:
    """pico_kernels.<name> when the model runs the Triton ops, else None (the torch code runs).
    Imported lazily so that the torch path needs no Triton."""
    if ops is None or ops.name != "triton":
        return None
    return importlib.import_module(f"pico_kernels.{name}")


def fused_kernels(ops: KernelOps | None) -> ModuleType | None:
    """pico_kernels.triton_fused (RMSNorm, q/k norm + rotary, SiLU-and-mul) or None."""
    return triton_module(ops, "triton_fused")


def gemv_kernels(ops: KernelOps | None) -> ModuleType | None:
    """pico_kernels.triton_linear (projections of decode batches) or None."""
    return triton_module(ops, "triton_linear")


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 as in HF Llama/Qwen."""

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        fused = fused_kernels(ops)
        self.fused_rms_norm = fused.rms_norm if fused is not None else None

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)[0]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused residual add (vLLM style): x += residual, then norm. Returns (normed, new
        residual); with residual None the new residual is x itself."""
        if self.fused_rms_norm is not None and x.dim() == 2:
            return self.fused_rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)


def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """(D/2,) fp32 inverse frequencies, as transformers' rope init functions compute them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if scaling.rope_type != "default":
        raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")
    return inv_freq


@dataclass(slots=True)
class RotaryInputs:
    """What each layer needs to rotate q/k in one step. The torch path gathers cos/sin once
    per step; the fused kernel indexes the cache by position itself."""

    positions: torch.Tensor  # (N,) int64
    cos_sin_cache: torch.Tensor  # (P, D): [cos | sin]
    cos: torch.Tensor | None = None  # (N, 1, D/2), torch path only
    sin: torch.Tensor | None = None  # (N, 1, D/2), torch path only


class RotaryEmbedding(nn.Module):
    """cos/sin cache for positions [0, max_positions), computed in fp32 once and stored in the
    model dtype (as HF casts cos/sin to the activations' dtype)."""

    cos_sin_cache: torch.Tensor  # (P, D): [cos | sin], a buffer (declared: nn.Module types buffers as Module)

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling = RopeScaling()) -> None:
        super().__init__()
        assert head_dim % 2 == 0, f"rotary head_dim must be even, got {head_dim}"
        inv_freq = _inv_freq(head_dim, theta, scaling)  # (D/2,)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # (P, D): [cos | sin]
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_dtype()), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N,) int64 -> cos, sin each (N, 1, D/2); computed once per step."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def inputs(self, positions: torch.Tensor, gather: bool = True) -> RotaryInputs:
        """positions (N,) -> the step's RotaryInputs; gather=False leaves cos/sin to a kernel."""
        cos, sin = self.cos_sin(positions) if gather else (None, None)
        return RotaryInputs(positions, self.cos_sin_cache, cos, sin)


class SiluAndMul(nn.Module):
    """(N, 2I) [gate | up] -> (N, I) silu(gate) * up."""

    def __init__(self, ops: KernelOps | None = None) -> None:
        super().__init__()
        fused = fused_kernels(ops)
        self.fused_silu_and_mul = fused.silu_and_mul if fused is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_silu_and_mul is not None and x.dim() == 2:
            return self.fused_silu_and_mul(x)
        return silu_and_mul_ref(x)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv_ops: ModuleType | None
) -> torch.Tensor:
    """F.linear, or a Triton kernel for decode batches: gemv for a few 16-bit rows, split-K
    for tens of rows into a narrower output (o_proj, down_proj)."""
    if gemv_ops is not None:
        if gemv_ops.use_gemv(x, weight):
            return gemv_ops.gemv(x, weight, bias)
        if gemv_ops.use_splitk_linear(x, weight):
            return gemv_ops.splitk_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose small-batch 16-bit products take pico_kernels.triton_linear on the Triton ops."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, ops: KernelOps | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_ops = gemv_kernels(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemv_ops)


class MergedLinear(Linear):
    """Several projections of the same input as one Linear (e.g. q|k|v, gate|up). The loader
    fills each checkpoint tensor into its row slice with load_shard."""

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool = False, ops: KernelOps | None = None
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, ops=ops)
        self.shard_slices: dict[str, slice] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_slices[name] = slice(start, start + size)
            start += size

    @torch.no_grad()
    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        param: torch.Tensor = getattr(self, param_name)
        rows = param[self.shard_slices[shard]]
        if rows.shape != tensor.shape:
            raise ValueError(
                f"shard {shard!r} of {param_name}: expected shape {tuple(rows.shape)}, got {tuple(tensor.shape)}"
            )
        rows.copy_(tensor)


def _is_empty(cache: torch.Tensor | None) -> bool:
    return cache is None or cache.numel() == 0


class Attention(nn.Module):
    """Paged attention over one layer's cache: store this step's K/V, then attend.

    With an empty cache (the profiling forward before the pools exist) the store is skipped
    and each sequence attends causally to its own new tokens only. With stored=True the caller
    has already written this step's K/V into the cache (the fused q/k norm + rotary kernel of
    pico_kernels.triton_fused does), so only the attention runs. window > 0: sliding-window
    attention (pico_kernels.reference), which never takes the cascade path.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops: KernelOps, window: int = 0
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"{num_heads} q heads not a multiple of {num_kv_heads} kv heads"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops
        self.window = window

    @staticmethod
    def has_cache(kv_cache: tuple[torch.Tensor, torch.Tensor] | None) -> TypeGuard[tuple[torch.Tensor, torch.Tensor]]:
        """A real cache, not None or the empty tensors of the profiling forward."""
        return kv_cache is not None and not (_is_empty(kv_cache[0]) or _is_empty(kv_cache[1]))

    def forward(
        self,
        q: torch.Tensor,  # (N, Hq, D)
        k: torch.Tensor | None,  # (N, Hkv, D); unused (may be None) when stored
        v: torch.Tensor | None,  # (N, Hkv, D); likewise
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,  # each (num_blocks, block_size, Hkv, D)
        attn: AttentionMetadata,
        stored: bool = False,  # K/V of this step are already in the cache
    ) -> torch.Tensor:  # (N, Hq, D)
        if not self.has_cache(kv_cache):
            assert not stored and k is not None and v is not None, "without a cache K/V come with the step"
            return self._causal_no_cache(q, k, v, attn.cu_seqlens_q)
        k_cache, v_cache = kv_cache
        if not stored:
            self.ops.store_kvcache(k, v, k_cache, v_cache, attn.slot_mapping)
        if attn.is_decode:
            if attn.prefix_blocks is not None and not self.window:
                return self.ops.cascade_decode_attention(
                    q,
                    k_cache,
                    v_cache,
                    attn.block_tables,
                    attn.seq_lens,
                    self.scale,
                    attn.prefix_blocks,
                    attn.max_prefix_blocks,
                )
            return self.ops.paged_decode_attention(
                q, k_cache, v_cache, attn.block_tables, attn.seq_lens, self.scale, self.window
            )
        return self.ops.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            attn.block_tables,
            attn.cu_seqlens_q,
            attn.seq_lens,
            self.scale,
            attn.max_query_len,
            self.window,
        )

    def _causal_no_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor
    ) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        starts = cu_seqlens_q.tolist()
        for start, end in zip(starts[:-1], starts[1:]):
            if end == start:
                continue
            # (1, Hq, L, D): on CUDA, 4-D inputs take SDPA's flash or memory-efficient kernels;
            # 3-D ones took its math path, whose (Hq, L, L) scores made the profiling forward's
            # peak (model_svc.warmup) grow with the square of the step budget.
            qs = q[start:end].transpose(0, 1)[None]
            ks = k[start:end].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            vs = v[start:end].repeat_interleave(group, dim=1).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            out[start:end] = o[0].transpose(0, 1)
        return out
