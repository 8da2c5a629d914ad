"""The row-tile numbering every paged prefill kernel shares (pico_kernels.triton_prefill,
pico_kernels.gluon_prefill): sequence b owns tile ids [cu_q[b] // T + b, cu_q[b + 1] // T + b + 1)
for T query tokens a tile, so Nq // T + B programs cover any batch without a device sync."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def find_seq(cu_seqlens_q_ptr, num_seqs, tile_id, BLOCK_M: tl.constexpr):
    """The b with cu_q[b] // BLOCK_M + b <= tile_id < cu_q[b + 1] // BLOCK_M + b + 1."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def row_tiles(num_tokens: int, num_seqs: int, tokens_per_tile: int) -> int:
    """The launch grid's row-tile count (what `find_seq` numbers): every sequence's tiles, its
    last one partial, bounded by one spare tile a sequence."""
    num_tiles = num_tokens // tokens_per_tile + num_seqs
    assert num_tiles < 1 << 16, f"{num_tokens} tokens in one prefill launch: more row tiles than a grid holds"
    return num_tiles
