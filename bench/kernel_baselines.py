"""The baselines bench/attention.py times the Triton decode kernel against: torch SDPA on
contiguous K/V, and FlexAttention straight over the paged pool. Shapes come from the tensors:
caches (num_blocks, PAGE, Hkv, D), block tables (B, blocks per sequence)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(B, Hkv, L, D) copy of each sequence's tokens, gathered in chunks to bound the peak."""
    batch = block_tables.shape[0]
    _, _, hkv, d = cache.shape
    out = torch.empty((batch, hkv, seq_len, d), dtype=cache.dtype, device=cache.device)
    chunk = max(1, (1 << 30) // (seq_len * hkv * d * 2))
    for b0 in range(0, batch, chunk):
        rows = cache[block_tables[b0 : b0 + chunk].long()]  # (c, blocks, PAGE, Hkv, D)
        out[b0 : b0 + chunk] = rows.flatten(1, 2)[:, :seq_len].transpose(1, 2)
    return out


SDPA_BACKENDS = None  # the first backend that runs decode with GQA, found on the first cell


def sdpa_decode_fn(q, k, v, scale: float):
    """SDPA on contiguous (B, Hkv, L, D) K/V with enable_gqa; returns (fn, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    global SDPA_BACKENDS
    q4 = q.unsqueeze(2)  # (B, Hq, 1, D)
    candidates = SDPA_BACKENDS or [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    for backend in candidates:

        def fn(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True).squeeze(2)

        try:
            fn()
        except RuntimeError:
            continue
        SDPA_BACKENDS = [backend]
        return fn, backend.name.lower()
    raise RuntimeError("no SDPA backend ran GQA decode")


_FLEX = None


def compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        # Static shapes: flex only takes its decoding kernel when batch and heads are static.
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_paged_decode_fn(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """FlexAttention straight over the paged pool: K/V viewed as one (1, Hkv, blocks*PAGE, D)
    sequence, and a BlockMask whose KV blocks (of PAGE tokens) for batch row b are that
    sequence's physical blocks, in order. Full blocks skip the mask; a partial last block is
    masked through a physical slot -> (sequence, logical position) table (the layout of
    torch's experimental PagedAttention)."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, blocks_per_seq = block_tables.shape
    num_blocks, PAGE, hkv, d = k_cache.shape  # noqa: N806 - the page size, as in the docstring
    device = q.device
    k = k_cache.view(1, num_blocks * PAGE, hkv, d).transpose(1, 2)
    v = v_cache.view(1, num_blocks * PAGE, hkv, d).transpose(1, 2)
    lens = seq_lens.long()
    num_full = lens // PAGE
    has_partial = (lens % PAGE != 0).to(torch.int32)
    # Physical slot -> (owning sequence, logical position); the mask_mod decides with these.
    slot_seq = torch.full((num_blocks, PAGE), -1, dtype=torch.int32, device=device)
    slot_pos = torch.full((num_blocks, PAGE), -1, dtype=torch.int32, device=device)
    owned = block_tables.long()
    slot_seq[owned] = torch.arange(batch, dtype=torch.int32, device=device)[:, None, None]
    logical = torch.arange(blocks_per_seq * PAGE, dtype=torch.int32, device=device).view(blocks_per_seq, PAGE)
    slot_pos[owned] = logical.expand(batch, -1, -1)
    slot_seq, slot_pos = slot_seq.view(-1), slot_pos.view(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (slot_seq[kv_idx] == b) & (slot_pos[kv_idx] < seq_lens[b])

    # Index rows are as wide as the pool (BlockMask sizes its dense form by them); entries past
    # each row's block count are never read.
    full_idx = torch.zeros((batch, 1, 1, num_blocks), dtype=torch.int32, device=device)
    full_idx[:, 0, 0, :blocks_per_seq] = block_tables
    partial_idx = torch.zeros((batch, 1, 1, num_blocks), dtype=torch.int32, device=device)
    partial_idx[:, 0, 0, 0] = block_tables.gather(1, num_full.clamp(max=blocks_per_seq - 1)[:, None]).view(-1)
    block_mask = BlockMask.from_kv_blocks(
        has_partial.view(batch, 1, 1),
        partial_idx,
        num_full.to(torch.int32).view(batch, 1, 1),
        full_idx,
        BLOCK_SIZE=(128, PAGE),
        mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * PAGE),
        compute_q_blocks=False,
    )
    from torch.nn.attention.flex_attention import flex_attention

    flex = compiled_flex() if q.is_cuda else flex_attention  # eager (slow, exact) off the GPU
    q4 = q.unsqueeze(2)
    return lambda: flex(q4, k, v, block_mask=block_mask, scale=scale, enable_gqa=True).squeeze(2)
