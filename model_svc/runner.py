"""ModelRunner: weights, the KV tensors of both pools, copy lists, forward and sampling.

The runner sees token ids and block ids only. Per sequence it keeps the block table, the
tokens fed so far (for penalties) and the sampling state; each step brings the diffs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from contracts import phase_times
from contracts.errors import SequenceFailed
from contracts.sampling_params import SamplingParams
from contracts.step import PLACEHOLDER, SeqStep, StepInput, StepOutput
from model_svc.attention_metadata import (
    CASCADE_MAX_TOKENS,
    AttentionMetadata,
    StepAttention,
    group_major,
    group_views,
    per_group,
)
from model_svc.kv_cache import HostBlockTables, KVCachePools
from model_svc.launched_step import LaunchedStep
from model_svc.loader import cpu_threads, load_model, resolve_dtype, resolve_kv_cache_dtype
from model_svc.models.llama import LlamaForCausalLM
from model_svc.prefill_graphs import PrefillGraphs, supports_piecewise
from model_svc.sampler import Sampler, SamplingBatch, make_generator, plain_row, row_problem
from model_svc.step_batch import flatten, longest_first
from model_svc.transfer import PinnedStaging, to_device
from model_svc.warmup import compile_kernels, profile_num_blocks
from pico_kernels import select_ops

if TYPE_CHECKING:
    from model_svc.cuda_graphs import DecodeGraphs, DecodeReplay
    from model_svc.parallel import TPGroup

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _SeqState:
    sampling: SamplingParams
    num_prompt_tokens: int
    row: int = -1  # this sequence's row in the persistent block table
    num_blocks: int = 0  # logical blocks: table entries per KV group
    token_ids: list[int] = field(default_factory=list)  # every token fed, by position
    generator: torch.Generator | None = None
    sampled: bool = False  # a launched step samples it: a placeholder can stand for its latest token
    plain: tuple[float, bool] | None = None  # (temperature, greedy) when the one-pass kernel samples it (plain_row)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        block_size: int = 16,
        num_device_blocks: int | None = None,
        num_host_blocks: int | Callable[[int, int], int] = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        kv_cache_dtype: str = "auto",  # "auto": the model's; "fp8": float8_e4m3fn (loader.resolve_kv_cache_dtype)
        kernel_backend: str | None = None,
        device_memory_fraction: float = 0.9,
        cpu_kv_cache_bytes: int = 256 << 20,
        max_num_batched_tokens: int = 8192,
        model: LlamaForCausalLM | None = None,
        enforce_eager: bool = False,
        max_num_seqs: int = 256,
        pinned_inputs: bool = True,
        # The small-batch decode graphs capture PDL (runner_factory.small_batch_pdl).
        small_batch_pdl: bool = True,
        torch_threads: int | None = None,  # CPU only; None: loader.cpu_threads picks by model size
        tp: TPGroup | None = None,  # this rank of a tensor-parallel group (model_svc.tp_launch)
    ) -> None:
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.ops = select_ops(self.device, kernel_backend)
        self.tp = tp
        if model is None:
            model, _ = load_model(model_path, device=self.device, dtype=self.dtype, ops=self.ops, tp=tp)
        self.model = model
        self.config = model.config
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(model, torch_threads))
        self.block_size = block_size
        self.enforce_eager = enforce_eager
        fused_sample = _fused_sample(self.ops.name)
        self.sampler = Sampler(fused_sample)  # before profiling: the profile runs it
        self.kv_groups = self.config.kv_groups()
        budget = (device_memory_fraction, cpu_kv_cache_bytes, max_num_batched_tokens, max_num_seqs)
        self._build_pools(num_device_blocks, num_host_blocks, budget)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # prefill and mixed steps of up to 2,048 tokens
        # Each sequence's latest sampled token on the device, by block-table row: placeholders
        # read it, so any number of launched steps may be ahead of what the host has read back.
        # The decode graphs' own buffer while it is large enough (_fit_last_token).
        self._last_token = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._rows = torch.zeros(0, dtype=torch.int64, device=self.device)  # the prepared step's rows, in batch order
        self._batch_cache: tuple[list, list, SamplingBatch] | None = None  # see _sampling_batch
        # The model service reads a step back on one thread while it launches the next on
        # another; both touch the sequences' token histories.
        self._state_lock = threading.Lock()
        # Step inputs through pinned host memory (non-blocking copies): launch() then never
        # waits for the step in flight, which overlapped scheduling needs.
        self.pinned_inputs = pinned_inputs and self.device.type == "cuda"
        self._staging = PinnedStaging(self.device) if self.pinned_inputs else None
        if self.device.type == "cuda":
            if not enforce_eager:
                self._build_graphs(max_num_seqs, max_num_batched_tokens, fused_sample, small_batch_pdl)
            rehearsals = [graphs.rehearse for graphs in self._graph_sets()]
            compile_kernels(self.model, self.sampler, self.device, self.pools.layer_caches, block_size, rehearsals)
            self._capture_graphs()
        self.seqs: dict[str, _SeqState] = {}
        logger.info(
            "model runner: %s on %s (%s, KV cache %s), kernels=%s, %d device blocks, %d host blocks",
            self.config.architecture,
            self.device,
            self.dtype,
            self.kv_dtype,
            self.ops.name,
            self.pools.num_device_blocks,
            self.pools.num_host_blocks,
        )

    def _build_pools(
        self,
        num_device_blocks: int | None,
        num_host_blocks: int | Callable[[int, int], int],
        budget: tuple[float, int, int, int],
    ) -> None:
        """The KV pools (the device one measured from what is left after a profiling forward
        under `budget` unless given) and the persistent block tables."""
        bs = self.block_size
        block_bytes = KVCachePools.bytes_per_block(self.config, bs, self.kv_dtype, self.kv_groups)
        if num_device_blocks is None:
            num_device_blocks = profile_num_blocks(self.model, self.sampler, self.device, bs, block_bytes, *budget)
            if self.tp is not None:  # every rank holds every block: the pool that fits on each
                num_device_blocks = self.tp.agree_min(num_device_blocks)
        if callable(num_host_blocks):  # sized from the device pool and the block size in bytes
            num_host_blocks = num_host_blocks(num_device_blocks, block_bytes)
        self.pools = KVCachePools(
            self.config, bs, num_device_blocks, num_host_blocks, self.device, self.kv_dtype, self.kv_groups
        )
        # A sliding group holds only its window: a sequence may then outgrow the pool's blocks.
        slides = all(self.kv_groups.windows)
        max_len = min(self.config.max_position_embeddings, (1 << 62) if slides else num_device_blocks * bs)
        self.max_blocks_per_seq = -(-max_len // bs)  # logical blocks (table entries per group)
        self.block_tables = HostBlockTables(self.kv_groups.num_groups * self.max_blocks_per_seq)

    def _build_graphs(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        fused_sample: Callable[..., torch.Tensor] | None,
        pdl: bool,
    ) -> None:
        """The decode graphs (their sampling graphs with the one-pass kernel) and, where the
        layers split at the attention, the prefill graphs; captured by _capture_graphs."""
        from model_svc.cuda_graphs import PDL_MAX_BATCH, DecodeGraphs

        width = self.max_blocks_per_seq  # blocks of the longest possible sequence
        self.graphs = DecodeGraphs(
            self.model,
            self.pools.layer_caches,
            min(max_num_seqs, 512),
            width,
            self.device,
            windows=self.kv_groups.windows,
            max_prefix_blocks=min(width, CASCADE_MAX_TOKENS // self.block_size),
            capture=False,
            sample=fused_sample,
            pdl_max_batch=PDL_MAX_BATCH if pdl else 0,
        )
        self._last_token = self.graphs.last_token
        if supports_piecewise(self.model):
            self.prefill_graphs = PrefillGraphs(
                self.model, self.pools.layer_caches, max_num_batched_tokens, self.device, capture=False
            )

    def _graph_sets(self) -> list[DecodeGraphs | PrefillGraphs]:
        return [graphs for graphs in (self.graphs, self.prefill_graphs) if graphs is not None]

    def _capture_graphs(self) -> None:
        """The graphs' capture (their kernels compiled by compile_kernels)."""
        for graphs in self._graph_sets():
            graphs.capture()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (nothing to do without one)."""
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    @property
    def num_device_blocks(self) -> int:
        return self.pools.num_device_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.pools.num_host_blocks

    @property
    def kv_group_windows(self) -> tuple[int, ...]:
        return self.kv_groups.windows

    # ----------------------------------------------------------------- the step
    def step(self, inp: StepInput) -> StepOutput:
        return self.launch(inp).result()

    @torch.inference_mode()
    def launch(self, inp: StepInput) -> LaunchedStep:
        """Queue the step's device work and return at once; `result()` waits for the sampled
        tokens. The host can schedule the next step meanwhile: a decode token given as
        PLACEHOLDER is taken on the device from what this runner sampled last."""
        if self.tp is not None and self.tp.rank == 0:  # the other ranks run the same step
            self.tp.publish(inp)
        with self._state_lock:
            for seq_id in inp.finished:
                state = self.seqs.pop(seq_id, None)
                if state is not None:
                    self.block_tables.release(state.row)
        # Swap-outs first: a block they free may be the target of a copy, swap-in or write;
        # copies before swap-ins: a copy's source may have been freed and handed out again.
        self.pools.swap_out(inp.swap_out)
        self.pools.copy_device(inp.copies)
        self.pools.swap_in(inp.swap_in)
        if not inp.seqs:
            return LaunchedStep(self.seqs, self._state_lock, [], None)
        t = phase_times.start()
        with self._state_lock:
            for s in inp.seqs:
                self._update_seq(s)
        self._fit_last_token()
        seqs = longest_first(inp.seqs)
        states = [self.seqs[s.seq_id] for s in seqs]
        rows = [st.row for st in states]
        width = max(st.num_blocks for st in states) * self.kv_groups.num_groups
        tables = group_major(self.block_tables.rows(rows, width), self.kv_groups.num_groups)  # the step's tables
        replay = self._graph_decode(seqs, states, rows, tables)
        if replay is not None:
            phase_times.add("runner.graph_decode", t)
            if replay.token_ids is not None:  # sampled and recorded in the graphs
                return LaunchedStep(self.seqs, self._state_lock, seqs, replay.token_ids)
            hidden = replay.hidden
        else:
            input_ids, positions, meta, sample_rows = self._prepare(seqs, rows, tables)
            phase_times.add("runner.prepare", t)
            t = phase_times.start()
            hidden = self._forward(input_ids, positions, meta)
            phase_times.add("runner.forward", t)
            if not sample_rows:
                return LaunchedStep(self.seqs, self._state_lock, [], None)
            if len(sample_rows) < hidden.shape[0]:
                hidden = hidden[self._h2d(np.asarray([r for r, _ in sample_rows], dtype=np.int64))]
                seqs = [s for _, s in sample_rows]
                states = [self.seqs[s.seq_id] for s in seqs]
        t = phase_times.start()
        logits = self.model.compute_logits(hidden)
        result = self.sampler(logits, self._sampling_batch(states), seqs)  # a row that fails alone: SequenceFailed
        table_rows = (
            self._rows
            if len(seqs) == len(inp.seqs)
            else self._h2d(np.asarray([st.row for st in states], dtype=np.int64))
        )
        self._remember_sampled(table_rows, result.token_ids)
        phase_times.add("runner.sample", t)
        t = phase_times.start()
        launched = LaunchedStep(self.seqs, self._state_lock, seqs, result.token_ids, result)
        phase_times.add("runner.readback_queued", t)
        return launched

    def _graph_decode(
        self, seqs: list[SeqStep], states: list[_SeqState], rows: list[int], tables: np.ndarray
    ) -> DecodeReplay | None:
        """A decode batch that samples every sequence, replayed from the decode graphs with its
        inputs written straight into their buffers (DecodeGraphs.replay_decode); sampled in
        the graphs too when the one-pass kernel takes every row. None when the batch is not
        for the graphs (prefill, no graphs, too large, rows past the graphs' token buffer):
        _prepare builds it then."""
        g = self.graphs
        n = len(seqs)
        if g is None or self._staging is None or n > g.max_batch or self._last_token is not g.last_token:
            return None
        width = tables.shape[1] // self.kv_groups.num_groups  # the tables are group-major: G tables of width
        if width > g.max_blocks or any(len(s.token_ids) != 1 or not s.sample for s in seqs):
            return None
        self._rows = g.rows[:n]
        sampling = None
        plain = [st.plain for st in states if st.plain is not None]
        if g.sample_graphs and len(plain) == len(states):
            sampling = ([p[0] for p in plain], [p[1] for p in plain], self.sampler.next_seed())
        return g.replay_decode(
            [s.token_ids[0] for s in seqs],
            [s.start_pos for s in seqs],
            rows,
            tables,
            self.block_size,
            self._staging,
            sampling,
        )

    def _sampling_batch(self, states: list[_SeqState]) -> SamplingBatch:
        """The step's per-row sampling tensors. A decode batch usually has the rows of the step
        before, so the last batch is reused when every row has the same params and generator
        objects (the cache holds them, so no id is reused) and no row needs the token history."""
        params = [st.sampling for st in states]
        gens = [st.generator for st in states]
        cached = self._batch_cache
        if (
            cached is not None
            and len(cached[0]) == len(params)
            and all(a is b for a, b in zip(cached[0], params))
            and all(a is b for a, b in zip(cached[1], gens))
        ):
            return cached[2]
        prompts = outputs = None
        penalties = any(
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params
        )
        if penalties:
            prompts = [st.token_ids[: st.num_prompt_tokens] for st in states]
            outputs = [st.token_ids[st.num_prompt_tokens :] for st in states]
        batch = SamplingBatch.build(params, prompts, outputs, gens, self.device, self.pinned_inputs)
        self._batch_cache = None if penalties else (params, gens, batch)
        return batch

    def _fill_placeholders(self, ids_dev: torch.Tensor, placeholders: np.ndarray, seq_index: np.ndarray) -> None:
        """Decode inputs the host did not know: each sequence's latest sampled token, read at
        its row (stream order puts every launched step's sample before this step's read;
        _update_seq refused placeholders of sequences never sampled)."""
        n = len(placeholders)
        index = self._h2d(np.concatenate([placeholders, seq_index[placeholders]]))
        ids_dev[index[:n]] = self._last_token[self._rows[index[n:]]]

    def _h2d(self, array: np.ndarray) -> torch.Tensor:
        if self._staging is not None:
            return self._staging.to_device(array)
        return to_device(array, None, self.device, False)

    def _fit_last_token(self) -> None:
        """Keep the buffer of latest samples a row longer than the block table has rows (the
        decode graphs' padding rows use that spare one). Growing it replaces the graphs' own
        buffer, which they were captured on: from then on _graph_decode declines."""
        capacity = self.block_tables.table.shape[0]
        if self._last_token.numel() <= capacity:
            grown = torch.zeros(capacity + 1, dtype=torch.int64, device=self.device)
            grown[: self._last_token.numel()] = self._last_token
            self._last_token = grown

    def _remember_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Record each sampled sequence's token at its block-table row (rows: device, in
        token_ids' order)."""
        self._last_token[rows] = token_ids.reshape(-1).to(torch.int64)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepAttention) -> torch.Tensor:
        first = meta[0] if isinstance(meta, tuple) else meta
        if self.graphs is not None and first.is_decode and self.graphs.can_run(input_ids.shape[0], meta):
            return self.graphs.run(input_ids, positions, meta)
        if self.prefill_graphs is not None and not first.is_decode and self.prefill_graphs.bucket(input_ids.shape[0]):
            return self.prefill_graphs.run(input_ids, positions, meta)
        return self.model(input_ids, positions, self.pools.layer_caches, meta)

    def _update_seq(self, s: SeqStep) -> None:
        state = self.seqs.get(s.seq_id)
        if state is None or s.sampling is not None:
            sampling = s.sampling
            if sampling is None:
                raise SequenceFailed(s.seq_id, "its first step must carry sampling params")
            problem = row_problem(sampling, self.config.vocab_size)
            if problem is not None:
                raise SequenceFailed(s.seq_id, problem)
            if state is None:
                gen = make_generator(sampling.seed, self.device) if sampling.seed is not None else None
                prompt = list(s.prompt_token_ids or [])
                state = _SeqState(
                    sampling,
                    len(prompt),
                    token_ids=prompt,
                    generator=gen,
                    row=self.block_tables.acquire(),
                    plain=plain_row(sampling),
                )
                self.seqs[s.seq_id] = state
        if s.table_blocks is not None:
            self.block_tables.write(state.row, s.table_start, s.table_blocks)
            state.num_blocks = (s.table_start + len(s.table_blocks)) // self.kv_groups.num_groups
        fed = s.token_ids
        end = s.start_pos + len(fed)
        if fed and fed[-1] == PLACEHOLDER:
            if not state.sampled:
                raise SequenceFailed(s.seq_id, "a placeholder token, but no step has sampled it yet")
            if len(state.token_ids) >= end:
                fed = fed[:-1] + [state.token_ids[end - 1]]  # its result was already read back
        state.sampled |= s.sample
        del state.token_ids[s.start_pos :]
        if len(state.token_ids) < s.start_pos:  # history unknown (restart): pad, positions matter
            state.token_ids.extend([-1] * (s.start_pos - len(state.token_ids)))
        state.token_ids.extend(fed)
        if end > state.num_blocks * self.block_size:
            raise SequenceFailed(s.seq_id, f"{end} tokens but only {state.num_blocks} blocks")

    def _prepare(
        self, seqs: list[SeqStep], rows: list[int], tables: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor, StepAttention, list[tuple[int, SeqStep]]]:
        """The batch flattened on the host (model_svc.step_batch), then on the device in one
        copy of its arrays and one of its block tables (group-major)."""
        batch = flatten(seqs, rows, tables, self.block_size, self.kv_groups.windows)
        n, b, t, groups = batch.num_tokens, batch.num_seqs, batch.seq_start, batch.num_groups
        packed_dev = self._h2d(batch.packed)
        self._rows = packed_dev[t + 2 * b + 1 : -1]
        placeholders = np.flatnonzero(batch.ids == PLACEHOLDER)
        if placeholders.size:
            self._fill_placeholders(packed_dev[:n], placeholders, batch.seq_index)
        block_tables = group_views(self._h2d(tables), groups)
        slots = group_views(packed_dev[2 * n : t], groups)
        meta = AttentionMetadata(
            slot_mapping=slots[0],
            block_tables=block_tables[0],
            seq_lens=packed_dev[t : t + b].to(torch.int32),
            cu_seqlens_q=packed_dev[t + b : t + 2 * b + 1].to(torch.int32),
            is_decode=n == b,
            prefix_blocks=packed_dev[-1:].to(torch.int32) if batch.prefix else None,
            max_prefix_blocks=batch.prefix,
            max_query_len=batch.max_query_len,
        )
        return packed_dev[:n], packed_dev[n : 2 * n], per_group(meta, slots, block_tables), batch.sample_rows


def _fused_sample(ops_name: str) -> Callable[..., torch.Tensor] | None:
    """The one-pass sampling kernel on the Triton ops (imported only there), else None."""
    if ops_name != "triton":
        return None
    from pico_kernels.triton_sample import gumbel_sample

    return gumbel_sample
