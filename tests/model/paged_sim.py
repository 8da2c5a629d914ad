"""A toy paged cache for model tests: allocates shuffled physical blocks per sequence and
builds the AttentionMetadata a runner would, so the model can be driven step by step."""

from __future__ import annotations

import torch

from model_svc.attention_metadata import AttentionMetadata


class PagedSim:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int = 64,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Random (never zero) contents: a read of a slot nobody wrote shows up in the output.
        self.kv_caches = [
            (torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype))
            for _ in range(num_layers)
        ]
        self.block_size = block_size
        self.device = device
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def step(self, new_tokens: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """new_tokens: (seq_id, token ids) per sequence, in batch order. Allocates blocks, then
        returns input_ids (N,), positions (N,) and the metadata for one forward."""
        input_ids, positions, slots, seq_lens, cu = [], [], [], [], [0]
        for seq_id, tokens in new_tokens:
            table = self.block_tables.setdefault(seq_id, [])
            start = self.seq_lens.get(seq_id, 0)
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size >= len(table):
                    table.append(self.free_blocks.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            input_ids.extend(tokens)
            self.seq_lens[seq_id] = start + len(tokens)
            seq_lens.append(start + len(tokens))
            cu.append(cu[-1] + len(tokens))
        max_blocks = max(len(self.block_tables[s]) for s, _ in new_tokens)
        tables = torch.full((len(new_tokens), max_blocks), 10**6, dtype=torch.int32)  # junk past the end
        for i, (seq_id, _) in enumerate(new_tokens):
            table = self.block_tables[seq_id]
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            is_decode=all(len(t) == 1 for _, t in new_tokens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        return ids, torch.tensor(positions, dtype=torch.int64, device=dev), attn
