"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with padded inputs.

A decode step launches a few hundred small kernels; replaying a captured graph removes the
launch gaps. Inputs live in static buffers sized for the largest bucket. Padded rows write
nowhere (slot -1) and attend to one token of block 0; their outputs are dropped. Block
tables keep a fixed width (max_model_len / block_size), so the decode kernel's split count,
chosen from that host-known width, is the same at capture and at replay.

Batches of at least CASCADE_MIN_SEQS also get a second graph that runs cascade decode (a
shared prefix read once for the batch, model_svc.attention_metadata): its prefix length is a
device value, and its bound, which sizes the prefix kernel's grid, is fixed at capture.
Padded rows (one token) then attend to the prefix only; their outputs are dropped too.
"""

from __future__ import annotations

import logging

import torch

from model_svc.attention_metadata import CASCADE_MIN_SEQS, AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, max_batch: int, max_blocks_per_seq: int, device: torch.device,
                 max_prefix_blocks: int = 0) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_batch, self.max_blocks = max_batch, max_blocks_per_seq
        self.max_prefix_blocks = max_prefix_blocks  # cascade graphs: the shared prefix's bound (0: none)
        self.prefix_blocks = torch.zeros(1, dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # Keyed by (batch bucket, cascade).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.buckets = batch_buckets(max_batch)
        self._capture()

    def _meta(self, batch: int, cascade: bool) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], block_tables=self.block_tables[:batch], seq_lens=self.seq_lens[:batch],
            cu_seqlens_q=self.cu_seqlens_q[: batch + 1], is_decode=True,
            prefix_blocks=self.prefix_blocks if cascade else None, max_prefix_blocks=self.max_prefix_blocks if cascade else 0,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        keys = [(b, False) for b in self.buckets]
        if self.max_prefix_blocks > 0:
            keys += [(b, True) for b in self.buckets if b >= CASCADE_MIN_SEQS]
        for key in sorted(keys, reverse=True):  # largest first: later graphs reuse its memory
            batch, cascade = key
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._meta(batch, cascade))
            self.model(*args)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.model(*args)
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d; cascade from %d sequences)", len(self.graphs),
                    self.max_batch, CASCADE_MIN_SEQS)

    def can_run(self, batch: int, meta: AttentionMetadata) -> bool:
        if batch > self.max_batch or meta.block_tables.shape[1] > self.max_blocks:
            return False
        return meta.prefix_blocks is None or (batch >= CASCADE_MIN_SEQS and meta.max_prefix_blocks <= self.max_prefix_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        batch = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= batch)
        width = meta.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[batch:bucket].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[batch:bucket].fill_(1)
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        key = (bucket, meta.prefix_blocks is not None)
        if key[1]:
            self.prefix_blocks.copy_(meta.prefix_blocks, non_blocking=True)
        self.graphs[key].replay()
        return self.outputs[key][:batch]
