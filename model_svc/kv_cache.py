"""The KV tensors of both pools and the copy lists that move blocks between them.

Each pool is one tensor (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), so a
swap or copy-on-write of a list of blocks is one indexed copy for all layers. The host pool
is pinned when CUDA is present, so swaps are asynchronous DMA.
"""

from __future__ import annotations

import numpy as np
import torch


class KVCachePools:
    def __init__(self, config, block_size: int, num_device_blocks: int, num_host_blocks: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (config.num_hidden_layers, 2, 0, block_size, config.num_key_value_heads, config.head_dim)
        with_blocks = lambda n: shape[:2] + (n,) + shape[3:]  # noqa: E731
        self.device_cache = torch.empty(with_blocks(num_device_blocks), dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.host_cache = torch.empty(with_blocks(num_host_blocks), dtype=dtype, device="cpu", pin_memory=pin)
        # (k_cache, v_cache) views per layer: (num_blocks, block_size, Hkv, D)
        self.layer_caches = [(self.device_cache[i, 0], self.device_cache[i, 1]) for i in range(config.num_hidden_layers)]

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return config.num_hidden_layers * 2 * block_size * config.num_key_value_heads * config.head_dim * elem

    @property
    def num_device_blocks(self) -> int:
        return self.device_cache.shape[2]

    @property
    def num_host_blocks(self) -> int:
        return self.host_cache.shape[2]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> host blocks."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.device_cache.device, torch.device("cpu"))
        self.host_cache[:, :, dst] = self.device_cache[:, :, src].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host blocks -> device blocks."""
        if not pairs:
            return
        src, dst = self._index(pairs, torch.device("cpu"), self.device_cache.device)
        staged = self.host_cache[:, :, src]
        if self.device_cache.is_cuda:
            staged = staged.pin_memory()
        self.device_cache[:, :, dst] = staged.to(self.device_cache.device, non_blocking=True)

    def copy_device(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write inside the device pool."""
        if not pairs:
            return
        dev = self.device_cache.device
        src, dst = self._index(pairs, dev, dev)
        self.device_cache[:, :, dst] = self.device_cache[:, :, src]

    @staticmethod
    def _index(pairs: list[tuple[int, int]], src_device: torch.device, dst_device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = zip(*pairs)
        return torch.tensor(src, device=src_device), torch.tensor(dst, device=dst_device)


class HostBlockTables:
    """Every live sequence's block table as one row of a host int32 array, updated by the
    diffs the scheduler sends, so building a step's tables is one gather, not a Python loop
    over every block of every sequence."""

    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        self.table = np.zeros((capacity, max_blocks_per_seq), dtype=np.int32)
        self.free_rows = list(range(capacity - 1, -1, -1))

    def acquire(self) -> int:
        if not self.free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def release(self, row: int) -> None:
        self.free_rows.append(row)

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        if start + len(block_ids) > self.table.shape[1]:
            raise ValueError(f"block table of {start + len(block_ids)} blocks exceeds the limit of {self.table.shape[1]}")
        self.table[row, start : start + len(block_ids)] = block_ids

    def rows(self, rows: list[int], width: int) -> np.ndarray:
        return self.table[rows, :width]  # (B, width) copy
