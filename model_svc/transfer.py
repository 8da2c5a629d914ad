"""Host values onto the device without waiting for the device's queued work."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence[Any], dtype: torch.dtype | None, device: torch.device | str, pinned: bool) -> torch.Tensor:
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
