"""What the attention layers need to know about one flattened batch of new tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

# Cascade decode (one read of a batch's shared prefix) is used from these sizes on, as vLLM
# does: below them the saved reads do not pay for the extra launch.
CASCADE_MIN_TOKENS = 256
CASCADE_MIN_SEQS = 8
# The longest shared prefix taken (longer ones are cut): it bounds the prefix kernel's grid
# and scratch, which a CUDA graph fixes at capture.
CASCADE_MAX_TOKENS = 8192


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer.

    The batch is the new tokens of B sequences, flattened in batch order (N tokens in all).
    """

    slot_mapping: torch.Tensor  # (N,) int64: where each new token's K/V goes; -1 = skip
    block_tables: torch.Tensor  # (B, max_blocks) int32: logical -> physical block ids
    seq_lens: torch.Tensor  # (B,) int32: context length incl. this step's tokens
    cu_seqlens_q: torch.Tensor  # (B + 1,) int32: prefix sums of new tokens per sequence
    is_decode: bool  # every sequence has exactly one new token (decode kernel path)
    # Decode only: the number of leading block-table entries every row shares ((1,) int32 on
    # the device; a prefix-cache hit on a common prompt), read once for the whole batch by
    # the cascade kernel; None: plain decode. max_prefix_blocks: its host-known bound.
    prefix_blocks: torch.Tensor | None = None
    max_prefix_blocks: int = 0
    # Prefill only: the most new tokens of one sequence, known on the host (it picks the
    # prefill kernel's tiles); 0 when unknown.
    max_query_len: int = 0


def shared_prefix_blocks(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> int:
    """The leading block-table entries that every row of a decode batch shares and that lie
    within every sequence (prefix-cache hits on a common prompt): how many blocks cascade
    decode may read once for all. 0 when the batch or the shared part is too small."""
    if tables.shape[0] < CASCADE_MIN_SEQS or tables.shape[1] == 0 or not (tables[:, 0] == tables[0, 0]).all():
        return 0  # the usual case, decided on one column
    same = (tables == tables[0]).all(axis=0)
    n = tables.shape[1] if same.all() else int(same.argmin())
    n = min(n, int(seq_lens.min()) // block_size, CASCADE_MAX_TOKENS // block_size)
    return n if n * block_size >= CASCADE_MIN_TOKENS else 0


# A step's attention inputs: one AttentionMetadata for every layer (one KV group), or one per
# KV group, layer i reading the one of its group (contracts.kv_groups).
StepAttention = AttentionMetadata | tuple[AttentionMetadata, ...]


def group_major(tables: np.ndarray, num_groups: int) -> np.ndarray:
    """Rows of group-minor tables (B, W * G: entry i * G + g is group g's block i) as
    group-major rows (B, G * W): group g's table is the columns [g * W, (g + 1) * W), which
    a kernel reads as a (B, W) view with a row stride of G * W."""
    if num_groups == 1:
        return tables
    b, width = tables.shape
    return np.ascontiguousarray(tables.reshape(b, width // num_groups, num_groups).transpose(0, 2, 1)).reshape(b, width)


def group_views(x: Any, num_groups: int) -> list[Any]:
    """The per-group parts of a group-major tensor or array: column blocks of block tables
    (B, G * W), or consecutive runs of a slot mapping (G * N,)."""
    width = x.shape[-1] // num_groups
    return [x[..., g * width : (g + 1) * width] for g in range(num_groups)]


def per_group(meta: AttentionMetadata, slot_mappings: list[torch.Tensor], tables: list[torch.Tensor]) -> StepAttention:
    """`meta` for each KV group: the same batch with the group's slots and block tables
    (`meta` itself with one group)."""
    if len(tables) == 1:
        return meta
    return tuple(replace(meta, slot_mapping=s, block_tables=t) for s, t in zip(slot_mappings, tables))


def shared_prefix_blocks_groups(
    tables: np.ndarray, windows: tuple[int, ...], seq_lens: np.ndarray, block_size: int
) -> int:
    """shared_prefix_blocks over the full-attention groups of group-major tables (the only
    layers cascade decode serves): the fewest any of them shares; 0 without one."""
    if len(windows) == 1:
        return 0 if windows[0] else shared_prefix_blocks(tables, seq_lens, block_size)
    full = [t for t, w in zip(group_views(tables, len(windows)), windows) if not w]
    return min((shared_prefix_blocks(t, seq_lens, block_size) for t in full), default=0)
