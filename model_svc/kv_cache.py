"""The KV tensors of both pools and the copy lists that move blocks between them.

The device pool is one tensor (group_size, 2, num_blocks, block_size, num_kv_heads,
head_dim): a block id holds one block of one KV group (contracts.kv_groups), `group_size`
layers' K and V; layer i's K and V are the (num_blocks, block_size, Hkv, D) views of its slot
(a model of one attention type has one group: a slot per layer). That is the layout the
attention kernels read, and a copy-on-write of a list of blocks is one indexed copy for all
layers. The host pool is block-major instead, (num_blocks, group_size, 2, block_size, Hkv, D),
so that one block is one contiguous chunk of bytes: a swap gathers the blocks on the device
into the host's layout and moves each run of consecutive host blocks with one DMA. With CUDA
the host pool is pinned and every copy is non-blocking, ordered on the device's stream with
the step's other work (a swap-out before the writes into the freed blocks, a swap-in before
the attention that reads them); the host never waits for a swap.
"""

from __future__ import annotations

import numpy as np
import torch

from contracts.kv_groups import KVGroups, kv_groups
from model_svc.transfer import to_device

# Blocks gathered per staging buffer: bounds the transient device memory of a large swap.
SWAP_CHUNK_BLOCKS = 256


def host_pool_blocks(
    num_cpu_blocks: int | None, swap_space_gib: float, num_device_blocks: int, block_bytes: int
) -> int:
    """The host (swap) pool in blocks: `num_cpu_blocks` when given, else the swap space in
    blocks, at most 4x the device pool. ModelRunner calls it (through functools.partial) once
    the device pool and the block's size are known."""
    if num_cpu_blocks is not None:
        return num_cpu_blocks
    return min(int(swap_space_gib * 2**30) // block_bytes, 4 * num_device_blocks)


def _runs(values: list[int]) -> list[tuple[int, int, int]]:
    """(position, first value, length) of each run of consecutive values, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][1] + runs[-1][2] == v:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, v, 1))
    return runs


def last_per_destination(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A copy list as one indexed copy may apply it: where a destination repeats (a block that
    a step's list fills, then frees and hands out again, e.g. a sliding group's block released
    right after its swap-in), only its last copy, the one that counts. An index_copy_ with a
    repeated index keeps an arbitrary one of them on CUDA."""
    last = {dst: src for src, dst in pairs}
    return pairs if len(last) == len(pairs) else [(src, dst) for dst, src in last.items()]


def _as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """A one-byte (FP8) pool as uint8, the same shape; a wider one as it is."""
    return pool.view(torch.uint8) if pool.element_size() == 1 else pool


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """A block-id list on the device (on CUDA without waiting for the device)."""
    return to_device(values, torch.long, device, device.type == "cuda")


class KVCachePools:
    def __init__(
        self,
        config,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        groups: KVGroups | None = None,
    ) -> None:
        block = (block_size, config.num_key_value_heads, config.head_dim)
        self.groups = groups or kv_groups((), config.num_hidden_layers)
        slots = self.groups.group_size
        self.device_cache = torch.empty((slots, 2, num_device_blocks, *block), dtype=dtype, device=device)
        pin = device.type == "cuda"
        self.host_cache = torch.empty((num_host_blocks, slots, 2, *block), dtype=dtype, device="cpu", pin_memory=pin)
        # (k_cache, v_cache) views per layer: (num_blocks, block_size, Hkv, D)
        self.layer_caches = [(self.device_cache[s, 0], self.device_cache[s, 1]) for s in self.groups.layer_slot]
        # The block moves below on the pools' bytes: torch has no indexed copies of FP8 tensors.
        self._device_bytes, self._host_bytes = _as_bytes(self.device_cache), _as_bytes(self.host_cache)

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype, groups: KVGroups | None = None) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        slots = groups.group_size if groups is not None else config.num_hidden_layers
        return slots * 2 * block_size * config.num_key_value_heads * config.head_dim * elem

    @property
    def num_device_blocks(self) -> int:
        return self.device_cache.shape[2]

    @property
    def num_host_blocks(self) -> int:
        return self.host_cache.shape[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> host blocks."""
        device, host = self._device_bytes, self._host_bytes
        for start in range(0, len(pairs), SWAP_CHUNK_BLOCKS):
            chunk = pairs[start : start + SWAP_CHUNK_BLOCKS]
            src = _index([s for s, _ in chunk], device.device)
            staged = device.index_select(2, src).permute(2, 0, 1, 3, 4, 5).contiguous()  # host layout
            for pos, first, n in _runs([d for _, d in chunk]):
                host[first : first + n].copy_(staged[pos : pos + n], non_blocking=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host blocks -> device blocks."""
        device, host = self._device_bytes, self._host_bytes
        pairs = last_per_destination(pairs)
        for start in range(0, len(pairs), SWAP_CHUNK_BLOCKS):
            chunk = pairs[start : start + SWAP_CHUNK_BLOCKS]
            staged = torch.empty((len(chunk), *host.shape[1:]), dtype=host.dtype, device=device.device)
            for pos, first, n in _runs([s for s, _ in chunk]):
                staged[pos : pos + n].copy_(host[first : first + n], non_blocking=True)
            dst = _index([d for _, d in chunk], device.device)
            device.index_copy_(2, dst, staged.permute(1, 2, 0, 3, 4, 5))

    def copy_device(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write inside the device pool."""
        if not pairs:
            return
        device = self._device_bytes
        pairs = last_per_destination(pairs)
        src, dst = _index([s for s, _ in pairs], device.device), _index([d for _, d in pairs], device.device)
        device.index_copy_(2, dst, device.index_select(2, src))


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
            raise ValueError(
                f"block table of {start + len(block_ids)} blocks exceeds the limit of {self.table.shape[1]}"
            )
        self.table[row, start : start + len(block_ids)] = block_ids

    def rows(self, rows: list[int], width: int) -> np.ndarray:
        return self.table[rows, :width]  # (B, width) copy
