"""What the attention layers need to know about one flattened batch of new tokens."""

from __future__ import annotations

from dataclasses import dataclass

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
