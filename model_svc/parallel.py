"""Tensor parallelism (Megatron style) over torch.distributed: the rank group, the sharded
layers and the checkpoint slicing. docs/TENSOR_PARALLEL.md has the whole design.

A model of N ranks is N copies of the model code, each built from its rank's ModelConfig
(shard_config: its share of the q heads, KV heads and MLP columns; hidden and vocab sizes
stay whole), so the attention layers, the KV pools and the Triton kernels run per shard
unchanged. q|k|v and gate|up are column-parallel (each rank its heads / columns), o and down
row-parallel (RowParallelLinear: each rank a partial sum, then one all-reduce), the embedding
and the LM head vocab-parallel (each rank a slice of the rows; the embedding all-reduces, the
logits are all-gathered so that every rank samples the same tokens). With fewer KV heads than
ranks each KV head is held by N / Hkv ranks (replicated), each with the q heads that read it.

Rank 0 lives in the process that serves steps; it sends each StepInput to the others over a
CPU (gloo) group before it runs the step itself; every rank then runs the same forward.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from contracts.errors import ModelLost
from contracts.step import StepInput
from model_svc.config import ModelConfig
from model_svc.layers import Linear, linear
from pico_kernels.ops import KernelOps

logger = logging.getLogger(__name__)

# How long a rank waits for the others at the rendezvous and in a collective.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
# After a failed collective: how long to wait for word of which rank died.
LOST_RANK_WAIT_S = 2.0


class TensorParallelError(ModelLost):
    """A rank of the tensor-parallel group died or cannot be reached: the group is unusable."""


class TPGroup:
    """This process's rank in the tensor-parallel group: the device collectives of the model
    (NCCL on CUDA, gloo on the CPU) and the step broadcast over gloo on the CPU."""

    def __init__(self, rank: int, size: int, master_addr: str, master_port: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=size,
            timeout=RENDEZVOUS_TIMEOUT,
        )
        # The step broadcast stays off the device's stream: a separate gloo group on CUDA.
        self.cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        self.failure: str | None = None  # set by whoever learns that a rank died (tp_launch)
        self.stop_ranks: Callable[[], None] | None = None  # rank 0: ends the other ranks (tp_launch)
        self.rank_pids: list[int] = []  # rank 0: the other ranks' processes, by rank
        if device.type == "cuda":  # the communicator exists before any CUDA graph captures a collective
            self.all_reduce(torch.zeros(1, device=device))
        self._share_rng()

    def _share_rng(self) -> None:
        """Every rank's default generators (CPU, and this rank's device) take rank 0's state:
        the ranks run the same work in the same order from here, so their samplers draw the
        same numbers and sample the same tokens from the same gathered logits."""
        cuda = self.device.type == "cuda"
        box = [(torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if cuda else None)]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        cpu_state, device_state = box[0]
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, self.device)

    # ------------------------------------------------------------- the model's collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:  # a rank went away mid-step (gloo says so; NCCL would wait)
            raise self._lost(exc) from exc
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(M, V/N) logits of this rank's vocabulary slice -> (M, V) on every rank."""
        m, part = logits.shape
        out = torch.empty((self.size * m, part), dtype=logits.dtype, device=logits.device)  # rank-major
        try:
            dist.all_gather_single(out, logits.contiguous())
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        return out.view(self.size, m, part).permute(1, 0, 2).reshape(m, self.size * part)[:, :vocab_size]

    def agree_min(self, value: int) -> int:
        """The least of every rank's value (e.g. KV blocks that fit: each rank measures its own device)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ------------------------------------------------------------------- the step broadcast
    def publish(self, inp: StepInput | None) -> None:
        """On rank 0: send the step (None: stop) to the other ranks before running it."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            dist.broadcast_object_list([inp], src=0, group=self.cpu_group)
        except RuntimeError as exc:
            raise self._lost(exc) from exc

    def _lost(self, exc: Exception) -> TensorParallelError:
        """The error for a failed collective, naming the rank that died once rank 0's watcher
        has seen it exit (tp_launch; it follows the broken connection by moments)."""
        deadline = time.monotonic() + LOST_RANK_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return TensorParallelError(self.failure or f"a tensor-parallel collective failed: {exc}")

    def receive(self) -> StepInput | None:
        """On the other ranks: the next step (None: stop)."""
        box: list[StepInput | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def close(self) -> None:
        """Leave the group; on rank 0 the other ranks stop first."""
        if self.stop_ranks is not None:
            self.stop_ranks()
            self.stop_ranks = None
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------- sharded model parts
def kv_heads_of_rank(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) that rank holds: a slice when there are at least
    as many KV heads as ranks, else the one head its q heads read (replicated)."""
    return rank * num_kv_heads // size, max(1, num_kv_heads // size)


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """One rank's ModelConfig: its q heads, KV heads and MLP columns. ValueError when the
    model cannot be split into `size` ranks."""
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"{kv_heads} KV heads (need a multiple or a divisor of it)")
    if inter % size:
        problems.append(f"intermediate size {inter}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {', '.join(problems)}")
    return dataclasses.replace(
        config,
        num_attention_heads=heads // size,
        num_key_value_heads=kv_heads_of_rank(kv_heads, 0, size)[1],
        intermediate_size=inter // size,
    )


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks (o_proj, down_proj): each
    rank's product is a partial sum, all-reduced. Only rank 0 holds the bias (shard_weights)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias, ops=ops)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight, self.bias, self.gemv_ops))


def output_linear(in_features: int, out_features: int, bias: bool, ops: KernelOps, tp: TPGroup | None) -> Linear:
    """o_proj / down_proj: a Linear, or with ranks a RowParallelLinear."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias, ops=ops)
    return RowParallelLinear(in_features, out_features, bias, ops, tp)


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding / LM head per rank (the last rank's slice padded with zeros)."""
    return -(-vocab_size // size)


class VocabParallelEmbedding(nn.Module):
    """This rank's slice of the embedding rows; a token outside it contributes zeros, and the
    all-reduce puts each token's one row together."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        rows = vocab_rows(vocab_size, tp.size)
        self.first = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, hidden)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0.0))


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TPGroup | None) -> nn.Embedding | VocabParallelEmbedding:
    """The token embedding: an nn.Embedding, or with ranks this rank's VocabParallelEmbedding."""
    if tp is None:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


# ---------------------------------------------------------------------- checkpoint slicing
# HF module name -> how its weight is split: rows of q heads / KV heads / MLP columns, the
# input columns of a row-parallel projection, or rows of the vocabulary.
_SPLITS = {
    "q_proj": "q",
    "k_proj": "kv",
    "v_proj": "kv",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "o_proj": "in_q",
    "down_proj": "in_mlp",
    "embed_tokens": "vocab",
    "lm_head": "vocab",
}


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, rank: int, size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's HF-named tensors -> this rank's slices, by the same names (so
    loader.load_weights reads them as it reads a whole checkpoint). config: the whole model's."""
    d = config.head_dim
    q_rows = config.num_attention_heads // size * d
    first_kv, num_kv = kv_heads_of_rank(config.num_key_value_heads, rank, size)
    mlp_cols = config.intermediate_size // size
    spans = {
        "q": (rank * q_rows, q_rows),
        "kv": (first_kv * d, num_kv * d),
        "mlp": (rank * mlp_cols, mlp_cols),
        "in_q": (rank * q_rows, q_rows),
        "in_mlp": (rank * mlp_cols, mlp_cols),
    }
    for name, tensor in weights:
        module_name, _, param_name = name.rpartition(".")
        split = _SPLITS.get(module_name.rpartition(".")[2])
        if split is None:  # norms: whole on every rank
            yield name, tensor
        elif split == "vocab":
            rows = vocab_rows(config.vocab_size, size)
            part = tensor[rank * rows : (rank + 1) * rows]
            yield name, F.pad(part, (0, 0, 0, rows - part.shape[0]))
        elif split.startswith("in_"):
            start, n = spans[split]
            if param_name == "bias":  # added once, after the sum: rank 0's
                yield name, tensor if rank == 0 else torch.zeros_like(tensor)
            else:
                yield name, tensor[:, start : start + n]
        else:
            start, n = spans[split]
            yield name, tensor[start : start + n]
