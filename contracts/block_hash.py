"""The prefix cache's chained block hash, one form for every process that computes it.

The KV-cache service hashes full blocks as they are computed (kvcache_svc.manager); the
router hashes a prompt's blocks to look them up in the replicas' published prefix index
(router_svc). Both must agree bit for bit, and the hashes are persisted (the metadata
store), so this is stable across processes and versions: blake2b (8 bytes) of the parent's
hash, the block's tokens as little-endian int64 and the extra key (the cache salt).

The prefix index's Redis keys, under `picovllm:{replica id}:prefix:` (the replica id is its
deployment name): `blocks`, a set of the hashes (decimal) of the blocks the replica holds on
its device, and `alive`, its heartbeat. Both expire INDEX_TTL_S after the last heartbeat,
so a replica that stops leaves no entries behind.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from hashlib import blake2b

HEARTBEAT_S = 1.0  # a publishing replica writes its heartbeat this often
INDEX_TTL_S = 3.0  # ... and its keys expire this long after the last one


def index_keys(replica_id: str) -> tuple[str, str]:
    """(blocks key, heartbeat key) of a replica's prefix index."""
    prefix = f"picovllm:{replica_id}:prefix:"
    return prefix + "blocks", prefix + "alive"


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_key: str | None) -> int:
    """The chain hash of one block whose parent block hashed to `parent_hash` (None: the first)."""
    return next(chain_hashes(token_ids, len(token_ids), 0, 1, parent_hash, extra_key))


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    start_block: int,
    end_block: int,
    parent_hash: int | None,
    extra_key: str | None,
) -> Iterator[int]:
    """hash_block of blocks start_block .. end_block - 1 of token_ids, each chained to the one
    before (the first to parent_hash)."""
    data = array("q", token_ids[start_block * block_size : end_block * block_size]).tobytes()
    return chain_bytes(data, 8 * block_size, parent_hash, extra_key)


def chain_bytes(data: bytes, width: int, parent_hash: int | None, extra_key: str | None) -> Iterator[int]:
    """chain_hashes over tokens already in int64 bytes (`width` bytes a block): one blake2b
    call per block, no per-block conversion (a burst of 64 prompts of 1,056 tokens on arrival
    would otherwise convert 4,160 blocks one by one)."""
    salt = extra_key.encode() if extra_key else b""
    parent = (parent_hash or 0).to_bytes(8, "little")
    for offset in range(0, len(data), width):
        parent = blake2b(parent + data[offset : offset + width] + salt, digest_size=8).digest()
        yield int.from_bytes(parent, "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, extra_key: str | None) -> list[int]:
    """The chain hashes of the blocks a prefix-cache lookup of this prompt can hit: its full
    blocks, except that the last prompt token is always computed (its logits are needed)."""
    return list(chain_hashes(token_ids, block_size, 0, (len(token_ids) - 1) // block_size, None, extra_key))
