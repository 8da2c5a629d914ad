"""Host values onto the device without waiting for the device's queued work."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def to_device(
    values: np.ndarray | Sequence[Any], dtype: torch.dtype | None, device: torch.device | str, pinned: bool
) -> torch.Tensor:
    """A host array or list on the device. pinned (CUDA): staged in pinned memory and copied
    non-blocking, so queuing a step never waits for the step in flight."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(values))
        if dtype is not None:
            host = host.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    if pinned:
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class PinnedStaging:
    """Host-to-device copies of step inputs through pinned buffers allocated once and reused.

    `to_device` above pins a fresh host block per copy; torch's caching host allocator calls
    cudaHostAlloc whenever no block of that size class is free, which happens inside a step
    (a new batch shape, or every block of the class still held by a copy in flight). Here a
    ring of `slots` pinned buffers serves the copies in turn: a slot is written again only
    after the copy that last read it has finished (an event; with two steps in flight and a
    few copies per step it has finished long before), and grows (doubling) only when an
    array does not fit, so after the first steps of each size nothing is allocated.
    One caller at a time (the runner's launch path)."""

    def __init__(self, device: torch.device, slots: int = 16, min_bytes: int = 1 << 18) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self.num_allocs = 0  # pinned buffers allocated (or grown) so far

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """A new device tensor holding `array`."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if host.numel() == 0:
            return torch.empty(host.shape, dtype=host.dtype, device=self.device)
        return self._copy(host, None)

    def copy_into(self, array: np.ndarray, dst: torch.Tensor) -> None:
        """`array` into the device tensor `dst` of its shape and dtype (a strided view too)."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if host.numel():
            self._copy(host, dst)

    def _copy(self, host: torch.Tensor, dst: torch.Tensor | None) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the slot's last copy; finished already unless the ring wrapped within a step
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            size = max(nbytes, self.min_bytes, 2 * buf.numel() if buf is not None else 0)
            buf = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.num_allocs += 1
        staged = buf[:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        if dst is None:
            dst = staged.to(self.device, non_blocking=True)
        else:
            dst.copy_(staged, non_blocking=True)
        if event is None:
            event = self._events[slot] = torch.cuda.Event()
        event.record()
        return dst
