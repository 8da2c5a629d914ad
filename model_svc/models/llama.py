"""Llama-style decoder for the paged cache; also Mistral, Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm) through ModelConfig flags.

The model sees a flat batch of N new tokens (all sequences of a step concatenated), their
positions, one (k_cache, v_cache) pair per layer and the step's AttentionMetadata (one per KV
group when the layers have several: each layer reads its group's). It knows
nothing about requests or tokenization. Parameter names follow the HF checkpoints, except
that q/k/v and gate/up are merged (see packed_modules_mapping).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from model_svc.attention_metadata import AttentionMetadata, StepAttention
from model_svc.config import ModelConfig
from model_svc.layers import (
    Attention,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    RotaryInputs,
    SiluAndMul,
    apply_rotary,
    fused_kernels,
    gemv_kernels,
    triton_module,
)
from model_svc.parallel import TPGroup, output_linear, vocab_embedding, vocab_rows
from pico_kernels.ops import KernelOps

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """qkv projection, per-head q/k norm (Qwen3) + rotary, paged attention, o projection.

    On the Triton ops with a cache, one fused kernel does the norm + rotary of q and k and
    writes this step's K and V into the cache (qk_norm_rope_store); a decode step over a
    shared prefix does that inside the cascade's prefix launch instead (cascade_attend);
    without a cache (the profiling forward) or on the torch ops, q and k are rotated and
    Attention stores K/V.
    """

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup | None = None, window: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=config.attention_bias,
            ops=ops,
        )
        self.o_proj = output_linear(self.q_size, config.hidden_size, config.o_proj_bias, ops, tp)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, ops, window)
        fused = fused_kernels(ops)
        self.fused_qk_norm_rope = fused.qk_norm_rope if fused is not None else None
        self.fused_qk_norm_rope_store = fused.qk_norm_rope_store if fused is not None else None
        # Cascade decode (a shared prefix) with the norm + rotary + K/V store in its prefix launch.
        cascade = triton_module(ops, "triton_cascade")
        # A sliding layer's window starts past a long shared prefix: it never takes the cascade.
        fuses = cascade is not None and cascade.fuses_store(self.head_dim) and window == 0
        self.cascade = cascade if fuses else None

    def forward(
        self,
        x: torch.Tensor,  # (N, hidden)
        rope: RotaryInputs,
        kv_cache: KVCache | None,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # (N, hidden)
        return self.attend(self.qkv_proj(x), rope, kv_cache, attn)

    def attend(
        self,
        qkv: torch.Tensor,  # (N, q_size + 2 * kv_size): the qkv projection's output
        rope: RotaryInputs,
        kv_cache: KVCache | None,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # (N, hidden)
        return self.o_proj(self.attention(qkv, rope, kv_cache, attn).reshape(qkv.shape[0], self.q_size))

    def attention(
        self, qkv: torch.Tensor, rope: RotaryInputs, kv_cache: KVCache | None, attn: AttentionMetadata
    ) -> torch.Tensor:  # (N, Hq, D)
        """attend() without the o projection."""
        n = qkv.shape[0]
        if (
            self.cascade is not None
            and attn.is_decode
            and attn.prefix_blocks is not None
            and self.attn.has_cache(kv_cache)
        ):
            o = self.cascade_attend(qkv, rope, kv_cache, attn)  # (N, Hq, D)
        elif self.fused_qk_norm_rope_store is not None and self.attn.has_cache(kv_cache):
            q = self.query_and_store(qkv, rope, kv_cache, attn.slot_mapping)  # contiguous (N, Hq, D)
            o = self.attn(q, None, None, kv_cache, attn, stored=True)  # (N, Hq, D)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(n, self.num_heads, self.head_dim)  # (N, Hq, D)
            k = k.view(n, self.num_kv_heads, self.head_dim)  # (N, Hkv, D)
            v = v.reshape(n, self.num_kv_heads, self.head_dim).contiguous()  # (N, Hkv, D)
            q, k = self._norm_rope(q, k, rope)  # contiguous (N, Hq, D), (N, Hkv, D)
            o = self.attn(q, k, v, kv_cache, attn)  # (N, Hq, D)
        return o

    def query_and_store(
        self,
        qkv: torch.Tensor,
        rope: RotaryInputs,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (N, Hq, D), contiguous (`out` when given)
        """The qkv projection's output -> q after the per-head norm and rotary, with the rotated
        k and v written into the cache at the slots (one launch; fused Triton ops only)."""
        store = self.fused_qk_norm_rope_store
        assert store is not None, "called on the fused Triton ops only"
        q, k, v = self._heads(qkv)
        k_cache, v_cache = kv_cache
        return store(
            q, k, v, rope.positions, rope.cos_sin_cache, *self._norm_args(), k_cache, v_cache, slot_mapping, out=out
        )

    def cascade_attend(
        self, qkv: torch.Tensor, rope: RotaryInputs, kv_cache: KVCache, attn: AttentionMetadata
    ) -> torch.Tensor:
        """Decode over a shared prefix: query_and_store's work and cascade attention in the
        cascade's two launches (pico_kernels.triton_cascade.cascade_decode_attention_store)."""
        cascade = self.cascade
        assert cascade is not None, "called when the cascade kernels fuse the store (attention())"
        q, k, v = self._heads(qkv)
        step = cascade.StepKV(k, v, rope.positions, rope.cos_sin_cache, *self._norm_args(), attn.slot_mapping)
        k_cache, v_cache = kv_cache
        return cascade.cascade_decode_attention_store(
            q,
            step,
            k_cache,
            v_cache,
            attn.block_tables,
            attn.seq_lens,
            self.attn.scale,
            attn.prefix_blocks,
            attn.max_prefix_blocks,
        )

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (N, Hq, D), (N, Hkv, D), (N, Hkv, D) of q, k and v in the qkv projection's output."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
        )

    def _norm_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q norm weight, k norm weight, eps) for the fused kernels; (None, None, 0.0) without
        a per-head norm."""
        if self.qk_norm:
            return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return None, None, 0.0

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor, rope: RotaryInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k (views into the qkv output) -> per-head norm (Qwen3), then rotary."""
        if self.fused_qk_norm_rope is not None:
            return self.fused_qk_norm_rope(q, k, rope.positions, rope.cos_sin_cache, *self._norm_args())
        if self.qk_norm:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        assert rope.cos is not None and rope.sin is not None, "gathered for the torch path (RotaryEmbedding.inputs)"
        return apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup | None = None) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=config.mlp_bias, ops=ops)
        self.down_proj = output_linear(size, config.hidden_size, config.mlp_bias, ops, tp)
        self.tp = tp
        self.act = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, hidden) -> (N, hidden)
        gate_up, gemv_ops = self.gate_up_proj, self.gate_up_proj.gemv_ops
        if gemv_ops is not None and gate_up.bias is None and gemv_ops.use_silu_mul_linear(x, gate_up.weight):
            return self.down_proj(gemv_ops.silu_mul_linear(x, gate_up.weight))  # decode at tens of rows
        return self.down(gate_up(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:  # (N, 2I) [gate | up] -> (N, hidden)
        down, gemv_ops = self.down_proj, self.down_proj.gemv_ops
        if gemv_ops is not None and gemv_ops.use_gemv(gate_up, down.weight):  # decode at batch <= 4
            out = gemv_ops.gemv(gate_up, down.weight, down.bias, silu_mul=True)  # SiluAndMul fused in
            return out if self.tp is None else self.tp.all_reduce(out)  # row-parallel: the partial sums
        return down(self.act(gate_up))  # via (N, I)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, layer: int = 0, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, ops, tp, config.layer_window(layer))
        self.mlp = LlamaMLP(config, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        x: torch.Tensor,  # (N, hidden): the previous layer's output, not yet added to residual
        residual: torch.Tensor | None,  # (N, hidden) or None before the first layer
        rope: RotaryInputs,
        kv_cache: KVCache | None,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._norms_in_gemv(x):  # decode at batch <= 4: each norm inside the next projection
            qkv, residual = self._norm_linear(x, residual, self.input_layernorm, self.self_attn.qkv_proj)
            x = self.self_attn.attend(qkv, rope, kv_cache, attn)
            gate_up, residual = self._norm_linear(x, residual, self.post_attention_layernorm, self.mlp.gate_up_proj)
            return self.mlp.down(gate_up), residual
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_deferred(
        self,
        h: torch.Tensor,  # (N, hidden): the residual stream, everything added (before layer 0: the embedding)
        sums: torch.Tensor | None,  # (N, P) fp32: its rows' sums of squares in parts; None before layer 0
        rope: RotaryInputs,
        kv_cache: KVCache | None,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the stream, its sums): h is updated in place
        """forward() for decode batches of tens of rows, the norms' weights folded into the
        projections (LlamaModel.fold_norm_weights): no launch for either norm. o_proj and
        down_proj add to the residual stream in their epilogue and leave its rows' sums of
        squares; q|k|v and gate|up scale their rows by the norm's factor from those sums
        (pico_kernels.triton_splitk). Only layer 0's input norm runs as a kernel."""
        attention, mlp = self.self_attn, self.mlp
        qkv_proj, gemv_ops = attention.qkv_proj, attention.qkv_proj.gemv_ops
        assert gemv_ops is not None, "on the Triton gemv ops only (LlamaModel.defers_norms)"
        if sums is None:
            x, h = self.input_layernorm(h, None)  # the new residual is h itself
            qkv = qkv_proj(x)
        else:
            qkv = gemv_ops.splitk_linear(h, qkv_proj.weight, qkv_proj.bias, row_sums=sums, eps=self.input_layernorm.eps)
        o = attention.attention(qkv, rope, kv_cache, attn)
        o_proj, down_proj = attention.o_proj, mlp.down_proj
        sums = gemv_ops.splitk_add_residual(o.reshape(h.shape[0], -1), o_proj.weight, h, o_proj.bias)
        act = gemv_ops.silu_mul_linear(h, mlp.gate_up_proj.weight, row_sums=sums, eps=self.post_attention_layernorm.eps)
        return h, gemv_ops.splitk_add_residual(act, down_proj.weight, h, down_proj.bias)

    # The layer in two halves around its attention (model_svc.prefill_graphs replays each half
    # from a CUDA graph): together they are forward() on the fused Triton path with a cache.
    def before_attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        q_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (q (N, Hq, D), residual (N, hidden))
        x, residual = self.input_layernorm(x, residual)
        attn = self.self_attn
        return attn.query_and_store(attn.qkv_proj(x), rope, kv_cache, slot_mapping, q_out), residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.self_attn.o_proj(o.reshape(o.shape[0], -1))  # o: (N, Hq, D)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _norms_in_gemv(self, x: torch.Tensor) -> bool:
        """The Triton gemv takes these rows, and can apply the norms (their weights in x's dtype)."""
        qkv = self.self_attn.qkv_proj
        return (
            qkv.gemv_ops is not None
            and qkv.gemv_ops.use_gemv(x, qkv.weight)
            and self.input_layernorm.weight.dtype == self.post_attention_layernorm.weight.dtype == x.dtype
        )

    @staticmethod
    def _norm_linear(
        x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, proj: Linear
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """proj(norm(x, residual)) and the new residual, in one launch."""
        assert proj.gemv_ops is not None, "on the Triton gemv ops only (_norms_in_gemv)"
        return proj.gemv_ops.rms_norm_gemv(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, ops, i, tp) for i in range(config.num_hidden_layers))
        self.layer_group = config.kv_groups().layer_group  # which of a step's per-group attention inputs each reads
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.fused = fused_kernels(ops) is not None
        self.gemv_ops = gemv_kernels(ops)
        self.norms_folded = False  # fold_norm_weights() ran: decode batches of tens of rows defer the norms
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )

    def decoder_layers(self) -> Sequence[LlamaDecoderLayer]:
        """self.layers with its items' type (an nn.ModuleList types them as Module)."""
        return cast("Sequence[LlamaDecoderLayer]", self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) int64
        positions: torch.Tensor,  # (N,) int64
        kv_caches: list[KVCache] | None,
        attn: StepAttention,
    ) -> torch.Tensor:  # (N, hidden)
        x = self.embed_tokens(input_ids)  # (N, hidden)
        rope = self.rotary_emb.inputs(positions, gather=not self.fused)  # shared by all layers
        metas = [attn[g] for g in self.layer_group] if isinstance(attn, tuple) else [attn] * len(self.layer_group)
        caches = kv_caches if kv_caches is not None else [None] * len(metas)
        if self.defers_norms(x):
            sums = None
            for layer, cache, meta in zip(self.decoder_layers(), caches, metas):
                x, sums = layer.forward_deferred(x, sums, rope, cache, meta)
            return self.norm(x, None)[0]
        residual = None
        for layer, cache, meta in zip(self.decoder_layers(), caches, metas):
            x, residual = layer(x, residual, rope, cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def defers_norms(self, x: torch.Tensor) -> bool:
        """Whether this batch takes LlamaDecoderLayer.forward_deferred."""
        return self.norms_folded and self.gemv_ops is not None and self.gemv_ops.use_deferred_norms(x)

    @torch.no_grad()
    def fold_norm_weights(self, force: bool = False) -> bool:
        """Fold each layer's RMSNorm weights into the projection that reads the norm's output
        (input norm -> q|k|v, post-attention norm -> gate|up: W[:, j] *= w[j]) and set the
        norms' weights to one. The model computes the same function, the weights rounded once
        more; the deferred norms need it. Only on the Triton ops with 16-bit weights, where
        that path runs (and without an MLP bias, which the fused gate|up lacks), unless forced
        (a reference model that should hold the same weights as a folded one); never across
        ranks (the deferred path adds o and down into the residual before any all-reduce);
        returns whether the weights are folded."""
        layers = self.decoder_layers()
        layer = layers[0]
        if self.norms_folded:
            return True
        if not force and (
            self.tp is not None
            or self.gemv_ops is None
            or layer.mlp.gate_up_proj.bias is not None
            or layer.input_layernorm.weight.dtype not in (torch.bfloat16, torch.float16)
        ):
            return False
        for layer in layers:
            for norm, proj in (
                (layer.input_layernorm, layer.self_attn.qkv_proj),
                (layer.post_attention_layernorm, layer.mlp.gate_up_proj),
            ):
                proj.weight.copy_(proj.weight.float() * norm.weight.float()[None, :])
                norm.weight.fill_(1.0)
        self.norms_folded = True
        return True


class LlamaForCausalLM(nn.Module):
    """hidden = model(input_ids, positions, kv_caches, attn); logits = model.compute_logits(hidden)."""

    # HF checkpoint module name -> (our merged module name, shard)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup | None = None) -> None:
        """config: this rank's (model_svc.parallel.shard_config) with tp."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, ops, tp)
        self.lm_head = None  # tied: logits use the embedding matrix
        if not config.tie_word_embeddings:
            rows = vocab_rows(config.vocab_size, tp.size if tp is not None else 1)  # this rank's
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,  # (N,) int64
        positions: torch.Tensor,  # (N,) int64
        kv_caches: list[KVCache] | None,  # one (k_cache, v_cache) per layer; None/empty = profiling
        attn: StepAttention,
    ) -> torch.Tensor:  # (N, hidden)
        return self.model(input_ids, positions, kv_caches, attn)

    def fold_norm_weights(self, force: bool = False) -> bool:
        return self.model.fold_norm_weights(force)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (M, hidden) -> (M, vocab) fp32
        """Logits in fp32 from the 16-bit product's fp32 accumulator, never rounded to bf16.

        Rounded to bf16, logits near Qwen3's top values (2-4) would move in steps of 1.6e-2, so
        two tokens a hair apart could tie, or swap places between two paths whose hidden
        states differ in the last bit. On CUDA the product writes fp32 directly (cuBLAS
        `out_dtype`); the (M, vocab) fp32 logits are twice the bytes of bf16 ones (156 instead
        of 78 MB at M = 256).
        """
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = logits_fp32(hidden, weight)
        if self.tp is not None:  # each rank's vocabulary slice -> the whole row on every rank
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits


# torch.mm(..., out_dtype=fp32) for 16-bit CUDA inputs (torch >= 2.8)
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def logits_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden (M, H) @ weight (V, H)^T in fp32 without an intermediate 16-bit rounding."""
    if hidden.dtype == torch.float32:
        return F.linear(hidden, weight)
    if hidden.is_cuda and _MM_OUT_DTYPE:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return hidden.float() @ weight.float().t()  # CPU 16-bit (tests), or a torch without out_dtype
