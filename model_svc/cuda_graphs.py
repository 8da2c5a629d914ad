"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with padded inputs.

A decode step launches a few hundred small kernels; replaying a captured graph removes the
launch gaps. Inputs live in static buffers sized for the largest bucket: the per-sequence
values in one byte buffer (GraphInputs) that the runner fills on the host and copies in one
go, the block tables in a second. A token the host does not know yet (PLACEHOLDER: sampled
by a step still in flight) is read inside the graph from `last_token`, each sequence's
latest sample by block-table row. Padded rows write nowhere (slot -1) and attend to one
token of block 0; their outputs are dropped. Block tables keep a fixed width
(max_model_len / block_size), so the decode kernel's split count, chosen from that
host-known width, is the same at capture and at replay.

Batches of at least CASCADE_MIN_SEQS also get a second graph that runs cascade decode (a
shared prefix read once for the batch, model_svc.attention_metadata): its prefix length is a
device value, and its bound, which sizes the prefix kernel's grid, is fixed at capture.
Padded rows (one token) then attend to the prefix only; their outputs are dropped too.

Each of those graphs can have a sampling graph beside it (the LM head, the one-pass sampling
kernel on temperatures, greedy flags and a Philox key from the same byte buffer, the draws
recorded in `last_token`; padded rows draw too and record at a spare row), so that a decode
step of greedy or plain-temperature rows launches nothing between its replays.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from contracts import phase_times
from contracts.step import PLACEHOLDER
from model_svc.attention_metadata import (
    CASCADE_MIN_SEQS,
    AttentionMetadata,
    StepAttention,
    group_views,
    per_group,
    shared_prefix_blocks_groups,
)
from model_svc.models.llama import LlamaForCausalLM
from model_svc.transfer import PinnedStaging

logger = logging.getLogger(__name__)


# Decode graphs of up to this many rows capture programmatic dependent launch (unless
# PICOVLLM_PDL says otherwise, pico_kernels.triton_common.use_pdl): a step of one to a few
# sequences is a chain of latency-bound kernels, where each one's launch overlapping the last
# one's tail pays when steps are queued back to back (batch-1 decode, overlapped scheduling);
# larger steps it made slower, and so it did steps launched one at a time
# (model_svc.runner_factory.small_batch_pdl; bench/NOTES.md, "PDL for small batches").
PDL_MAX_BATCH = 8


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class GraphInputs(NamedTuple):
    """A decode graph's per-step inputs, as views of one byte buffer (host or device), so that
    a step's values travel in one copy. Sized for the largest batch; a step fills its rows and
    the padding rows of its bucket."""

    input_ids: Any  # (max_batch,) int64; PLACEHOLDER: the row's latest sampled token (on the device)
    positions: Any  # (max_batch,) int64
    slot_mapping: Any  # (G * max_batch,) int64: each KV group's, max_batch apart; -1 on padding rows
    rows: Any  # (max_batch,) int64: each sequence's block-table row (where its latest token is kept)
    seq_lens: Any  # (max_batch,) int32; 1 on padding rows
    prefix_blocks: Any  # (1,) int32: the shared prefix of a cascade step
    greedy: Any  # (max_batch,) int32: 1 where the sampling graph takes the argmax
    temperature: Any  # (max_batch,) fp32: the sampling graph's temperatures (1.0 on greedy rows)
    seed: Any  # (1,) int64: the sampling graph's Philox key

    @staticmethod
    def nbytes(max_batch: int, num_groups: int = 1) -> int:
        n = max_batch
        return -(-(8 * ((3 + num_groups) * n + 1) + 4 * (2 * n + 1) + 4 * n) // 8) * 8

    @classmethod
    def views(cls, buf: Any, max_batch: int, num_groups: int = 1) -> GraphInputs:
        """The fields over `buf` (a uint8 numpy array or torch tensor of nbytes(max_batch, num_groups))."""
        numpy = isinstance(buf, np.ndarray)
        i64, i32, f32 = (np.int64, np.int32, np.float32) if numpy else (torch.int64, torch.int32, torch.float32)
        n, s = max_batch, (2 + num_groups) * max_batch  # s: where the slot mappings end
        end64 = 8 * (s + n + 1)
        end32 = end64 + 4 * (2 * n + 1)
        longs = buf[:end64].view(i64)
        ints = buf[end64:end32].view(i32)
        floats = buf[end32 : end32 + 4 * n].view(f32)
        return cls(
            longs[:n],
            longs[n : 2 * n],
            longs[2 * n : s],
            longs[s : s + n],
            ints[:n],
            ints[n : n + 1],
            ints[n + 1 :],
            floats,
            longs[s + n :],
        )

    def pad(self, batch: int, bucket: int, spare_row: int = 0) -> None:
        """Rows batch..bucket as padding: token 0 at position 0, writing nowhere, one token of
        context, block-table row `spare_row` (where the sampling graph leaves their draws),
        greedy."""
        n = self.input_ids.shape[0]
        for g in range(0, self.slot_mapping.shape[0], n):
            self.slot_mapping[g + batch : g + bucket] = -1
        padding = (
            (self.input_ids, 0),
            (self.positions, 0),
            (self.rows, spare_row),
            (self.seq_lens, 1),
            (self.greedy, 1),
            (self.temperature, 1.0),
        )
        for field, value in padding:
            field[batch:bucket] = value


class DecodeReplay(NamedTuple):
    hidden: torch.Tensor  # (n, hidden) the step's last hidden states
    token_ids: torch.Tensor | None  # (n,) int64 sampled in the sampling graph (None: the caller samples)


class DecodeGraphs:
    """sample (optional): sample(logits, temperature, greedy, seed, out=...) writes a batch's draws
    into out (pico_kernels.triton_sample.gumbel_sample's form, the seed a device tensor). With it,
    each graph gets a second graph that samples from its hidden states and records the draws
    at the sequences' rows of last_token: a decode step whose every row the one-pass kernel
    can sample (greedy or plain temperature) is then two replays, with no launch in between
    for the LM head, the sampler or the record of the draws."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list,
        max_batch: int,
        max_blocks_per_seq: int,
        device: torch.device,
        max_prefix_blocks: int = 0,
        last_token_rows: int = 4096,
        capture: bool = True,
        sample: Callable[..., Any] | None = None,
        windows: tuple[int, ...] = (0,),
        pdl_max_batch: int = PDL_MAX_BATCH,
    ) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.max_batch, self.max_blocks = max_batch, max_blocks_per_seq
        self.windows, groups = windows, len(windows)  # the KV groups' (model_svc.attention_metadata.per_group)
        self.max_prefix_blocks = max_prefix_blocks  # cascade graphs: the shared prefix's bound (0: none)
        # Each sequence's latest sampled token by block-table row (the runner writes it after
        # sampling): the graphs read placeholders' tokens from it. Fixed at capture. One row
        # more, the spare: padding rows read and the sampling graph writes there.
        self.last_token = torch.zeros(last_token_rows + 1, dtype=torch.long, device=device)
        self.spare_row = last_token_rows
        # The per-step inputs: one device buffer and its host image (staged, copied in one go).
        self.host_buffer = np.zeros(GraphInputs.nbytes(max_batch, groups), dtype=np.uint8)
        self.host = GraphInputs.views(self.host_buffer, max_batch, groups)
        self.host.pad(0, max_batch, self.spare_row)
        self.buffer = torch.from_numpy(self.host_buffer).to(device, copy=True)
        self.inputs = GraphInputs.views(self.buffer, max_batch, groups)
        self.input_ids, self.positions, self.slot_mapping, self.rows, self.seq_lens, self.prefix_blocks = self.inputs[
            :6
        ]
        # Group-major: group g's tables in columns [g * max_blocks, (g + 1) * max_blocks).
        self.block_tables = torch.zeros((max_batch, groups * max_blocks_per_seq), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # Keyed by (batch bucket, cascade).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.sample = sample
        self.pdl_max_batch = pdl_max_batch  # graphs of up to this many rows capture PDL (0: none)
        self.sample_graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.sampled = torch.zeros(max_batch, dtype=torch.long, device=device)  # the sampling graphs' draws
        self.buckets = batch_buckets(max_batch)
        if capture:  # (tests of the input handling build it without graphs, on any device)
            self.capture()

    def _group_buffers(self, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each KV group's slot mapping and block tables of the first `batch` rows."""
        groups, n = len(self.windows), self.max_batch
        slots = [self.slot_mapping[g * n : g * n + batch] for g in range(groups)]
        return slots, group_views(self.block_tables[:batch], groups)

    def _meta(self, batch: int, cascade: bool) -> StepAttention:
        slots, tables = self._group_buffers(batch)
        meta = AttentionMetadata(
            slot_mapping=slots[0],
            block_tables=tables[0],
            seq_lens=self.seq_lens[:batch],
            cu_seqlens_q=self.cu_seqlens_q[: batch + 1],
            is_decode=True,
            prefix_blocks=self.prefix_blocks if cascade else None,
            max_prefix_blocks=self.max_prefix_blocks if cascade else 0,
        )
        return per_group(meta, slots, tables)

    def _keys(self) -> list[tuple[int, bool]]:
        """The graphs' keys, largest batch first (later graphs reuse its memory)."""
        keys = [(b, False) for b in self.buckets]
        if self.max_prefix_blocks > 0:
            keys += [(b, True) for b in self.buckets if b >= CASCADE_MIN_SEQS]
        return sorted(keys, reverse=True)

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Each graph's work once, eagerly, nothing captured or kept: under
        pico_kernels.compile_ahead, the list of the kernels the capture will compile."""
        from pico_kernels.triton_common import pdl_scope

        for key in self._keys():
            with pdl_scope(key[0] <= self.pdl_max_batch):
                self.outputs[key] = self._forward(*key)
                if self.sample is not None:
                    with contextlib.suppress(Exception):  # capture() meets it again, and falls back
                        self._sample(*key)
        self.outputs.clear()
        self.last_token.zero_()  # what the rehearsal's draws wrote (skipped kernels: garbage)

    @torch.inference_mode()
    def capture(self) -> None:
        from pico_kernels.triton_common import pdl_scope

        pool = None
        for key in self._keys():
            with pdl_scope(key[0] <= self.pdl_max_batch):
                self.graphs[key], self.outputs[key], pool = self._capture_one(self._forward, key, pool)
            if self.sample is not None:
                try:
                    self.sample_graphs[key], _, pool = self._capture_one(self._sample, key, pool)
                except Exception:  # noqa: BLE001 - a sampling kernel that cannot run here: the runner samples
                    logger.warning("sampling in the decode graphs failed; the runner samples after them", exc_info=True)
                    self.sample, self.sample_graphs = None, {}
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes up to %d; cascade from %d sequences; sampling %s)",
            len(self.graphs),
            self.max_batch,
            CASCADE_MIN_SEQS,
            "captured" if self.sample_graphs else "not captured",
        )

    def _capture_one(self, run: Callable[[int, bool], torch.Tensor], key: tuple[int, bool], pool):
        """(graph, its output, the pool) of run(*key), warmed up first (kernels compile,
        allocations settle), in `pool` (a new one when None)."""
        run(*key)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run(*key)
        return graph, out, graph.pool() if pool is None else pool

    def _forward(self, batch: int, cascade: bool) -> torch.Tensor:
        ids = self.input_ids[:batch]
        ids = torch.where(ids == PLACEHOLDER, self.last_token[self.rows[:batch]], ids)
        return self.model(ids, self.positions[:batch], self.kv_caches, self._meta(batch, cascade))

    def _sample(self, batch: int, cascade: bool) -> torch.Tensor:
        """The LM head on graph (batch, cascade)'s hidden states, the draws into `sampled`, and
        each draw recorded at its sequence's row (padding rows: the spare row)."""
        assert self.sample is not None, "sampling graphs are captured only with a sampler"
        logits = self.model.compute_logits(self.outputs[(batch, cascade)])
        tokens = self.sampled[:batch]
        self.sample(logits, self.inputs.temperature[:batch], self.inputs.greedy[:batch], self.inputs.seed, out=tokens)
        self.last_token[self.rows[:batch]] = tokens
        return tokens

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def has_cascade(self, batch: int, prefix_blocks: int) -> bool:
        return (self.bucket(batch), True) in self.graphs and prefix_blocks <= self.max_prefix_blocks

    def replay_decode(
        self,
        token_ids: list[int],
        positions: list[int],
        rows: list[int],
        tables: np.ndarray,
        block_size: int,
        staging: PinnedStaging,
        sampling: tuple[list[float], list[bool], int] | None = None,
    ) -> DecodeReplay:
        """One decode step: its values written into the host image (PLACEHOLDER tokens stay
        so: the graph reads them from last_token), the padding rows of its bucket reset, then
        one staged copy of the image and one of the block tables (rows, as wide as the
        longest), and the replay of the plain or the cascade graph. With sampling (each row's
        temperature and greedy flag, and the step's Philox key) and sampling graphs, the
        matching sampling graph is replayed too and the draws come back (already recorded
        at the rows); else only the hidden states."""
        n, h = len(token_ids), self.host
        h.input_ids[:n] = token_ids
        pos = h.positions[:n]
        pos[:] = positions
        h.rows[:n] = rows
        h.seq_lens[:n] = pos + 1
        groups, width = len(self.windows), tables.shape[1] // len(self.windows)
        for g in range(groups):
            blocks = tables[np.arange(n), g * width + pos // block_size].astype(np.int64)
            h.slot_mapping[g * self.max_batch : g * self.max_batch + n] = blocks * block_size + pos % block_size
        h.pad(n, self.bucket(n), self.spare_row)
        prefix = shared_prefix_blocks_groups(tables, self.windows, h.seq_lens[:n], block_size)
        cascade = prefix > 0 and self.has_cascade(n, prefix)
        h.prefix_blocks[0] = prefix if cascade else 0
        sample = sampling is not None and bool(self.sample_graphs)
        if sampling is not None and sample:
            h.temperature[:n], h.greedy[:n], h.seed[0] = sampling
        staging.copy_into(self.host_buffer, self.buffer)
        for g, part in enumerate(group_views(tables, groups) if groups > 1 else [tables]):
            staging.copy_into(part, self.block_tables[:n, g * self.max_blocks : g * self.max_blocks + width])
        hidden = self.replay(n, cascade)
        if not sample:
            return DecodeReplay(hidden, None)
        t = phase_times.start()
        self.sample_graphs[(self.bucket(n), cascade)].replay()
        phase_times.add("graphs.sample_replay", t)
        return DecodeReplay(hidden, self.sampled[:n])

    def replay(self, batch: int, cascade: bool) -> torch.Tensor:
        """Run the graph of this batch on what the buffers hold (`host` copied into `buffer`,
        and block_tables): the hidden states of the first `batch` rows."""
        key = (self.bucket(batch), cascade)
        t = phase_times.start()
        self.graphs[key].replay()
        phase_times.add("graphs.replay", t)
        return self.outputs[key][:batch]

    def can_run(self, batch: int, meta: StepAttention) -> bool:
        meta = meta[0] if isinstance(meta, tuple) else meta
        if batch > self.max_batch or meta.block_tables.shape[1] > self.max_blocks:
            return False
        return meta.prefix_blocks is None or (
            batch >= CASCADE_MIN_SEQS and meta.max_prefix_blocks <= self.max_prefix_blocks
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, step_attn: StepAttention) -> torch.Tensor:
        """Copy a prepared batch's device inputs into the buffers, then replay (batches the
        runner did not write into `host`)."""
        metas = step_attn if isinstance(step_attn, tuple) else (step_attn,)
        meta, batch = metas[0], input_ids.shape[0]
        bucket = self.bucket(batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        for g, m in enumerate(metas):
            slots = self.slot_mapping[g * self.max_batch : (g + 1) * self.max_batch]
            slots[:batch].copy_(m.slot_mapping, non_blocking=True)
            slots[batch:bucket].fill_(-1)
            width, col = m.block_tables.shape[1], g * self.max_blocks
            self.block_tables[:batch, col : col + width].copy_(m.block_tables, non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[batch:bucket].fill_(1)
        cascade = meta.prefix_blocks is not None
        if cascade:
            self.prefix_blocks.copy_(meta.prefix_blocks, non_blocking=True)
        return self.replay(batch, cascade)
