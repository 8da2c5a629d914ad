"""A step's batch flattened on the host: every per-token and per-sequence array in one int64
buffer (one host-to-device copy), the slot mappings computed from the block tables."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from contracts.step import SeqStep
from model_svc.attention_metadata import shared_prefix_blocks_groups


@dataclass(slots=True)
class HostBatch:
    """`packed` holds, in order: token ids (N), positions (N), each KV group's slot mapping
    (N each), context lengths (B), cu_seqlens_q (B + 1), block-table rows (B) and the cascade
    prefix (1)."""

    packed: np.ndarray
    num_tokens: int
    num_seqs: int
    num_groups: int
    seq_index: np.ndarray  # (N,) each token's sequence
    sample_rows: list[tuple[int, SeqStep]]  # (token index, sequence) of the rows that sample
    prefix: int  # shared leading blocks for cascade decode (0: none)
    max_query_len: int

    @property
    def seq_start(self) -> int:
        """Where the per-sequence arrays begin."""
        return (2 + self.num_groups) * self.num_tokens

    @property
    def ids(self) -> np.ndarray:
        return self.packed[: self.num_tokens]


def flatten(
    seqs: list[SeqStep], rows: list[int], tables: np.ndarray, block_size: int, windows: tuple[int, ...]
) -> HostBatch:
    """rows: the sequences' rows of the persistent block table; tables: those rows, as wide as
    the longest, group-major (model_svc.attention_metadata.group_major)."""
    num_seqs, groups = len(seqs), len(windows)
    lens = [len(s.token_ids) for s in seqs]
    num_tokens = sum(lens)
    t = (2 + groups) * num_tokens
    packed = np.empty(t + 3 * num_seqs + 2, dtype=np.int64)
    ids, pos, slots = packed[:num_tokens], packed[num_tokens : 2 * num_tokens], packed[2 * num_tokens : t]
    seq_lens, cu = packed[t : t + num_seqs], packed[t + num_seqs : t + 2 * num_seqs + 1]
    cu[0] = 0
    np.cumsum(lens, out=cu[1:])
    if num_tokens == num_seqs:  # decode: one token each
        ids[:] = [s.token_ids[0] for s in seqs]
        pos[:] = [s.start_pos for s in seqs]
        seq_index = np.arange(num_seqs)
    else:  # no Python loop per token, nor an arange per sequence (a burst of 64 prompts: 2,048 tokens)
        ids[:] = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, num_tokens)
        seq_index = np.repeat(np.arange(num_seqs), lens)
        starts = np.array([s.start_pos for s in seqs], dtype=np.int64)
        pos[:] = np.arange(num_tokens) + (starts - cu[:-1])[seq_index]
    seq_lens[:] = [s.start_pos + n for s, n in zip(seqs, lens)]
    sample_rows = [(int(cu[b + 1]) - 1, s) for b, s in enumerate(seqs) if s.sample]
    packed[t + 2 * num_seqs + 1 : -1] = rows
    bs = block_size
    prefix = shared_prefix_blocks_groups(tables, windows, seq_lens, bs) if num_tokens == num_seqs else 0
    packed[-1] = prefix
    width = tables.shape[1] // groups
    for g in range(groups):
        blocks = tables[seq_index, g * width + pos // bs].astype(np.int64)
        slots[g * num_tokens : (g + 1) * num_tokens] = blocks * bs + pos % bs
    return HostBatch(packed, num_tokens, num_seqs, groups, seq_index, sample_rows, prefix, max(lens))


def longest_first(seqs: list[SeqStep]) -> list[SeqStep]:
    """A decode batch ordered by context length, longest first (stable). The decode kernel's
    programs start in batch order and each takes time in proportion to its sequence's length;
    started longest first, the short ones fill in at the end instead of one long sequence
    running alone (longest-processing-time-first list scheduling). Results are matched to
    sequences by id, so the order is the runner's own business. Other batches keep theirs."""
    if len(seqs) < 2 or any(len(s.token_ids) != 1 for s in seqs):
        return seqs
    return sorted(seqs, key=lambda s: -s.start_pos)
