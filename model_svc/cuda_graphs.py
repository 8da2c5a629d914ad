"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with padded inputs.

A decode step launches a few hundred small kernels; replaying a captured graph removes the
launch gaps. Inputs live in static buffers sized for the largest bucket. Padded rows write
nowhere (slot -1) and attend to one token of block 0; their outputs are dropped. Block
tables keep a fixed width (max_model_len / block_size), so the decode kernel's split count,
chosen from that host-known width, is the same at capture and at replay.
"""

from __future__ import annotations

import logging

import torch

from model_svc.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_batch, self.max_blocks = max_batch, max_blocks_per_seq
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.buckets = batch_buckets(max_batch)
        self._capture()

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], block_tables=self.block_tables[:batch], seq_lens=self.seq_lens[:batch],
            cu_seqlens_q=self.cu_seqlens_q[: batch + 1], is_decode=True,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for batch in reversed(self.buckets):  # largest first: later graphs reuse its memory
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._meta(batch))
            self.model(*args)  # warm-up: compiles kernels, settles allocations
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self.model(*args)
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes up to %d)", len(self.graphs), self.max_batch)

    def can_run(self, batch: int, width: int) -> bool:
        return batch <= self.max_batch and width <= self.max_blocks

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
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch]
