"""Plain-torch references for the paged KV-cache kernels.

These are the contract: every Triton kernel in this package has the same signature as its
reference here and must match it on random inputs. The CPU path of the model service runs
these directly.

Shapes (per layer):
    k_cache, v_cache : (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables     : (B, max_blocks_per_seq) int32, logical block i -> physical block id;
                       entries past a sequence's last block are ignored (may hold anything)
    seq_lens         : (B,) int32, context length of each sequence *including* the tokens of
                       this step (their K/V are already stored when attention runs)
    window           : 0 = full causal attention; W > 0 = sliding window as transformers
                       masks it: the query at position p sees the keys at p - W < k <= p.
                       Table entries of blocks that lie wholly before every query's window
                       are never read (they may hold anything, e.g. a released block's
                       placeholder).

A token at position p of a sequence lives in physical block block_tables[b, p // block_size],
slot p % block_size.
"""

from __future__ import annotations

import torch


def store_kvcache_ref(
    key: torch.Tensor,  # (N, Hkv, D)
    value: torch.Tensor,  # (N, Hkv, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (N,) int64; slot = block_id * block_size + offset; -1 = skip
) -> None:
    """Write each token's K and V into the caches at its slot (in place), as to_cache converts."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache(key[keep], k_cache.dtype)
    v_cache[blocks, offsets] = to_cache(value[keep], v_cache.dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a cache of `dtype`: an FP8 cache (e4m3, scale 1) takes x clamped to its finite
    range (torch's cast alone turns what lies beyond it into NaN), rounded to nearest even."""
    if dtype == torch.float8_e4m3fn:
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def _gather_seq(cache: torch.Tensor, block_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """(end - start, Hkv, D): tokens [start, end) of one sequence, gathered through its table
    (only the blocks holding them are read)."""
    block_size = cache.shape[1]
    first, last = start // block_size, (end + block_size - 1) // block_size
    blocks = block_table[first:last].long()
    tokens = cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])
    return tokens[start - first * block_size : end - first * block_size]


def _key_start(first_query_pos: int, window: int) -> int:
    """The first key position any query from first_query_pos on sees."""
    return max(0, first_query_pos - window + 1) if window > 0 else 0


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_pos0: int,
    k_pos0: int,
    window: int,
) -> torch.Tensor:
    """q (Lq, Hq, D), k/v (Lk, Hkv, D) -> (Lq, Hq, D), computed in fp32.

    Query i sits at context position q_pos0 + i, key j at k_pos0 + j; a query sees the keys at
    positions <= its own and, with window > 0, > its own - window.
    """
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_q_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # (Hq, Lq, D)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, Lk, D)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # (Hq, Lq, Lk)
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + q_pos0
    k_pos = torch.arange(k.shape[0], device=q.device)[None, :] + k_pos0
    hidden = k_pos > q_pos
    if window > 0:
        hidden |= k_pos <= q_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).transpose(0, 1)  # (Lq, Hq, D)


def paged_decode_attention_ref(
    q: torch.Tensor,  # (B, Hq, D): one query token per sequence (the last position)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    seq_lens: torch.Tensor,  # (B,) int32, >= 1
    scale: float,
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # (B, Hq, D), dtype of q
    """The query of sequence b (at position seq_lens[b] - 1) attends to all seq_lens[b] cached
    tokens, or to the last `window` of them (GQA: query head h reads KV head h // (Hq // Hkv))."""
    out = torch.empty_like(q)
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        start = _key_start(seq_len - 1, window)
        k = _gather_seq(k_cache, block_tables[b], start, seq_len)
        v = _gather_seq(v_cache, block_tables[b], start, seq_len)
        out[b] = _attend(q[b : b + 1], k, v, scale, seq_len - 1, start, window)[0].to(q.dtype)
    return out


def cascade_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    prefix_blocks: torch.Tensor,  # (1,) int32: leading table entries every row shares
    max_prefix_blocks: int,  # host-known bound of prefix_blocks
) -> torch.Tensor:
    """Decode attention of a batch whose block tables share their first prefix_blocks entries:
    the same result as paged_decode_attention_ref (the fast path reads the shared prefix once)."""
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # (Nq, Hq, D): new tokens of all sequences, flattened in batch order
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # (B, max_blocks) int32
    cu_seqlens_q: torch.Tensor,  # (B + 1,) int32, prefix sums of the new-token counts
    seq_lens: torch.Tensor,  # (B,) int32, context length incl. the new tokens
    scale: float,
    max_query_len: int = 0,  # the most new tokens of one sequence if known (a hint for kernels' tiling; unused here)
    window: int = 0,  # sliding window (0: full attention)
) -> torch.Tensor:  # (Nq, Hq, D), dtype of q
    """Causal attention for a ragged batch of new tokens whose earlier context (prefix-cache
    hits, earlier prefill chunks) and own K/V are already in the paged cache. The new tokens
    of sequence b occupy context positions seq_lens[b] - q_len_b .. seq_lens[b] - 1; with a
    window each sees only the keys of its window."""
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        q_pos0 = seq_len - q_len
        start = _key_start(q_pos0, window)
        k = _gather_seq(k_cache, block_tables[b], start, seq_len)
        v = _gather_seq(v_cache, block_tables[b], start, seq_len)
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, scale, q_pos0, start, window).to(q.dtype)
    return out


# ---- fused elementwise ops (pico_kernels.triton_fused): the exact math of model_svc.layers ----


def rms_norm_ref(
    x: torch.Tensor,  # (N, hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # (N, hidden)
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual)
    """new residual = x + residual (or x); normed = weight * (fp32 RMSNorm of it, cast back)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def qk_norm_rope_ref(
    q: torch.Tensor,  # (N, Hq, D)
    k: torch.Tensor,  # (N, Hkv, D)
    positions: torch.Tensor,  # (N,)
    cos_sin_cache: torch.Tensor,  # (P, D): [cos | sin] per position
    q_norm_weight: torch.Tensor | None = None,  # (D,)
    k_norm_weight: torch.Tensor | None = None,  # (D,)
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated q (N, Hq, D), k (N, Hkv, D)
    """Optional per-head RMSNorm over head_dim, then neox-style (rotate_half) rotary."""
    if q_norm_weight is not None:
        assert k_norm_weight is not None, "q and k are normed together (Qwen3)"
        q, _ = rms_norm_ref(q, q_norm_weight, eps)
        k, _ = rms_norm_ref(k, k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # (N, 1, D/2) each
    return rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)


def qk_norm_rope_store_ref(
    q: torch.Tensor,  # (N, Hq, D)
    k: torch.Tensor,  # (N, Hkv, D)
    v: torch.Tensor,  # (N, Hkv, D)
    positions: torch.Tensor,  # (N,)
    cos_sin_cache: torch.Tensor,  # (P, D): [cos | sin] per position
    q_norm_weight: torch.Tensor | None,  # (D,)
    k_norm_weight: torch.Tensor | None,  # (D,)
    eps: float,
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (N,) int64; slot = block_id * block_size + offset; -1 = skip
) -> torch.Tensor:  # rotated q (N, Hq, D)
    """qk_norm_rope_ref, then store_kvcache_ref of the rotated k and of v (caches in place)."""
    q, k = qk_norm_rope_ref(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style (rotate_half) rotation. x (N, H, D); cos/sin (N, 1, D/2) in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # (N, 2I) [gate | up] -> (N, I)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
