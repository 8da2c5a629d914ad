"""Piecewise CUDA graphs for prefill and mixed steps: everything in a layer but the attention.

Launched eagerly, a prefill step of a 28-layer model makes about 260 launches through Python
(five Triton kernels and four cuBLAS products a layer, and their glue), half a millisecond a
layer on the host. A step of a few thousand tokens or less takes the device less than that,
so such steps (the first step of a burst of prefix-cache hits above all) wait for the host.
Here each stretch of work between two attentions is captured as a graph per token bucket:
piece 0 is the embedding and layer 0 up to its attention (norm, qkv projection, q/k norm +
rotary + the K/V store), piece i the rest of layer i - 1 and layer i up to its attention, the
last piece the rest of the last layer and the final norm. Every op in a piece works row by
row, so a step of n tokens runs the graphs of the smallest bucket >= n with its rows first
and padding rows after (slot -1: they write no K/V; their outputs are dropped). Only the
attention, whose grid and work depend on the step's sequences, is launched between the
pieces: one launch a layer, reading the piece's queries from a static buffer and writing a
static buffer that the next piece reads.

The pieces of all buckets share one memory pool and are captured in the order they are
replayed (largest bucket first); an intermediate that the next piece has consumed is
released, so the pool holds about one forward's activations, not one per piece. A step
replays one bucket's pieces in order and leaves nothing in the pool that a later step reads
(only each bucket's final hidden states, which stay allocated), so steps of different
buckets may follow each other in any order.
"""

from __future__ import annotations

import logging

import torch

from model_svc.attention_metadata import StepAttention
from model_svc.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Token counts with graphs; larger steps run eagerly (their device time hides the launches).
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


def supports_piecewise(model: LlamaForCausalLM) -> bool:
    """A model on the fused Triton ops (its layers can be split at the attention)."""
    layers = model.model.decoder_layers()
    return bool(layers) and all(layer.self_attn.fused_qk_norm_rope_store is not None for layer in layers)


class PrefillGraphs:
    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list, max_tokens: int, device: torch.device, capture: bool = True
    ) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.inner = model.model
        self.layers = self.inner.decoder_layers()
        self.buckets = [b for b in PREFILL_BUCKETS if b <= max_tokens]
        cfg = model.config
        size = self.buckets[-1] if self.buckets else 0
        dtype = self.inner.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.layer_group = self.inner.layer_group
        # One slot mapping per KV group: piece i writes layer i's K/V at its group's slots.
        self.slot_mapping = torch.full((max(self.layer_group) + 1, size), -1, dtype=torch.long, device=device)
        # Every layer's queries (written by its piece) and attention output (read by the next).
        self.q = torch.zeros((size, cfg.num_attention_heads, cfg.head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # the last piece's output per bucket
        self._residual: torch.Tensor | None = None  # between pieces: the residual stream
        if capture and self.buckets:
            self.capture()

    def bucket(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def _piece(self, i: int, n: int) -> torch.Tensor | None:
        """Piece i on the first n rows of the static buffers; the last one returns the final
        hidden states."""
        if i == 0:
            x, residual = self.inner.embed_tokens(self.input_ids[:n]), None
        else:
            assert self._residual is not None, "piece i - 1 left the residual stream"
            x, residual = self.layers[i - 1].after_attention(self.attn_out[:n], self._residual)
        if i == len(self.layers):
            self._residual = None
            return self.inner.norm(x, residual)[0]
        rope = self.inner.rotary_emb.inputs(self.positions[:n], gather=False)
        _, self._residual = self.layers[i].before_attention(
            x, residual, rope, self.kv_caches[i], self.slot_mapping[self.layer_group[i], :n], q_out=self.q[:n]
        )
        return None

    def _attention(self, i: int, n: int, step_attn: StepAttention) -> None:
        """Layer i's paged prefill attention, straight into the buffer the next piece reads
        (supports_piecewise: the model is on the Triton ops)."""
        from pico_kernels.triton_prefill import prefill_with_config  # Triton is imported only where it runs

        meta = step_attn[self.layer_group[i]] if isinstance(step_attn, tuple) else step_attn
        attn = self.layers[i].self_attn.attn
        k_cache, v_cache = self.kv_caches[i]
        prefill_with_config(
            self.q[:n],
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            attn.scale,
            out=self.attn_out[:n],
            max_query_len=meta.max_query_len,
            window=attn.window,
        )

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Every bucket's pieces once, eagerly, nothing captured (for pico_kernels.compile_ahead;
        they write no K/V: slots -1)."""
        for n in sorted(self.buckets, reverse=True):
            for i in range(len(self.layers) + 1):
                self._piece(i, n)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for n in sorted(self.buckets, reverse=True):
            graphs = []
            for i in range(len(self.layers) + 1):
                carried = self._residual  # the captured residual of piece i - 1, which piece i reads
                self._piece(i, n)  # warm-up (compiles, settles cuBLAS workspaces); writes no K/V (slots -1)
                self._residual = carried
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._piece(i, n)
                graphs.append(graph)
            assert out is not None, "the last piece returns the hidden states"
            self.graphs[n], self.hidden[n] = graphs, out
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured prefill graphs for %d token buckets up to %d (%d pieces each)",
            len(self.buckets),
            self.buckets[-1],
            len(self.layers) + 1,
        )

    def _slots(self, step_attn: StepAttention) -> list[torch.Tensor]:
        """The step's slot mapping of each KV group."""
        metas = step_attn if isinstance(step_attn, tuple) else (step_attn,) * self.slot_mapping.shape[0]
        return [m.slot_mapping for m in metas]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepAttention) -> torch.Tensor:
        """The model's hidden states (n, hidden) for a non-decode step of n <= max bucket tokens."""
        n = input_ids.shape[0]
        bucket = self.bucket(n)
        assert bucket is not None, "called for steps that fit a bucket (ModelRunner._forward)"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        for g, slots in enumerate(self._slots(meta)):
            self.slot_mapping[g, :n].copy_(slots, non_blocking=True)
            if n < bucket:
                self.slot_mapping[g, n:bucket].fill_(-1)
        graphs = self.graphs[bucket]
        for i in range(len(self.layers)):
            graphs[i].replay()
            self._attention(i, n, meta)
        graphs[-1].replay()
        return self.hidden[bucket][:n]

    def run_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepAttention) -> torch.Tensor:
        """run() without graphs (the same pieces called directly): for tests on any device."""
        n = input_ids.shape[0]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        for g, slots in enumerate(self._slots(meta)):
            self.slot_mapping[g, :n] = slots
        for i in range(len(self.layers)):
            self._piece(i, n)
            self._attention(i, n, meta)
        hidden = self._piece(len(self.layers), n)
        assert hidden is not None, "the last piece returns the hidden states"
        return hidden
