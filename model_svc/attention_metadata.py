"""What the attention layers need to know about one flattened batch of new tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
