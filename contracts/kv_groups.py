"""KV-cache groups: which layers share a block table, and how a sequence's tables are laid out.

A model whose layers mix full and sliding-window attention keeps one block table per group of
layers (vLLM's hybrid KV-cache manager). The layers of one attention type (one window) are
cut into groups of `group_size` layers, the size of the smallest type; every group holds the
same number of layers, so one page (a block id) has room for one block of any group: the
device pool is `group_size` layer tensors, and layer `i` reads and writes tensor
`layer_slot[i]` at the ids of its group's table. A sliding group frees the blocks that fell
out of its window, which is the saving: at a 32k context a window of 1k holds 1/32 of the
blocks a full group holds. A model with one attention type has one group of all its layers:
today's single table.

A sequence's tables travel as one flat list, group-minor: logical block `i` of group `g` is
entry `i * num_groups + g`. Every table-diff, swap and copy list of the step contract is then
what it was with one group; only the KV manager (which allocates) and the model runner (which
splits the rows per group) read the layout. A released entry holds `NO_BLOCK`; the attention
kernels never read an entry that lies wholly before every query's window.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

NO_BLOCK = -1  # a table entry with no block: out of a sliding group's window


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int, ...]  # per group: its sliding window (0: full attention)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its tensor in the pool (position within its group)
    group_size: int  # layers per group: the pool's layer tensors

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_groups(layer_windows: tuple[int, ...] | list[int], num_layers: int) -> KVGroups:
    """Group the layers by window (layer_windows: per layer, 0 = full; empty: all full). The
    types keep their first layer's order, so a model of one type is one group in layer order."""
    windows = tuple(layer_windows) or (0,) * num_layers
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} layer windows for {num_layers} layers")
    counts = Counter(windows)
    size = min(counts.values())
    group_windows: list[int] = []
    layer_group, layer_slot = [0] * num_layers, [0] * num_layers
    for window in counts:  # first-seen order
        layers = [i for i, w in enumerate(windows) if w == window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)
