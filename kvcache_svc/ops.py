"""The block operations of one engine step, as data: what the scheduler's KV client records
and the KV-cache service replays on its authoritative KVCacheManager.

Replaying the same ops in the same order on the same state gives the same results (the
manager is deterministic), which is what lets the scheduler keep a local working copy and
check the service's answers against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache_svc.manager import Allocated, Appended, KVCacheManager, NoFreeBlocks

# A pool's metadata costs about a hundred bytes a block: the cap keeps a reset that asks for
# absurd pools (a bug, or a crafted call) from taking the KV-cache service's memory, far
# above what a device or host pool of today holds (a pool of 2^24 blocks is ~1.6 GiB here).
MAX_POOL_BLOCKS = 1 << 24
MAX_BLOCK_SIZE = 1 << 16
MAX_GROUPS = 256  # KV-cache groups: at most one per layer


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The pools' geometry and the model-service epoch their contents belong to. ValueError
    for sizes beyond the caps, before any pool is built."""

    num_device_blocks: int
    num_host_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    epoch: str = ""
    group_windows: tuple[int, ...] = (0,)  # per KV-cache group: its sliding window (contracts.kv_groups)

    def __post_init__(self) -> None:
        for name in ("num_device_blocks", "num_host_blocks"):
            n = getattr(self, name)
            if not 0 <= n <= MAX_POOL_BLOCKS:
                raise ValueError(f"{name} must be within 0..{MAX_POOL_BLOCKS}, got {n}")
        if not 0 < self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be within 1..{MAX_BLOCK_SIZE}, got {self.block_size}")
        windows = tuple(self.group_windows)
        if not 0 < len(windows) <= MAX_GROUPS or any(w < 0 for w in windows):
            raise ValueError(f"group_windows must be 1..{MAX_GROUPS} windows >= 0, got {windows[: MAX_GROUPS + 1]}")
        object.__setattr__(self, "group_windows", windows)  # a tuple also when read back from JSON

    def new_manager(self) -> KVCacheManager:
        return KVCacheManager(
            self.num_device_blocks,
            self.num_host_blocks,
            self.block_size,
            self.enable_prefix_caching,
            self.group_windows,
        )


@dataclass(frozen=True, slots=True)
class ResetOp:
    config: PoolConfig


@dataclass(frozen=True, slots=True)
class AllocateOp:
    seq_id: str
    token_ids: list[int]
    num_new_tokens: int
    extra_key: str | None = None


@dataclass(frozen=True, slots=True)
class AppendSlotsOp:
    seq_id: str
    num_computed_tokens: int
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class CacheBlocksOp:
    seq_id: str
    token_offset: int  # position of token_ids[0]; earlier blocks are hashed already
    token_ids: list[int]
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class FreeOp:
    seq_id: str


@dataclass(frozen=True, slots=True)
class ForkOp:
    parent_id: str
    child_id: str


@dataclass(frozen=True, slots=True)
class SwapOutOp:
    seq_id: str


@dataclass(frozen=True, slots=True)
class SwapInOp:
    seq_id: str


Op = ResetOp | AllocateOp | AppendSlotsOp | CacheBlocksOp | FreeOp | ForkOp | SwapOutOp | SwapInOp
# allocate -> Allocated, append -> Appended, swaps -> copy list, short -> NoFreeBlocks, else None.
OpResult = Allocated | Appended | list[tuple[int, int]] | NoFreeBlocks | None


def seq_ids_of(op: Op) -> tuple[str, ...]:
    """The sequences an op touches (what the metadata store must rewrite)."""
    if isinstance(op, ForkOp):
        return (op.parent_id, op.child_id)
    if isinstance(op, ResetOp):
        return ()
    return (op.seq_id,)


def apply_op(manager: KVCacheManager, op: Op) -> OpResult:
    """Replay one recorded op (ResetOp is the caller's business: it replaces the manager)."""
    if isinstance(op, AppendSlotsOp):
        return manager.append_slots(op.seq_id, op.num_computed_tokens, op.num_new_tokens)
    if isinstance(op, CacheBlocksOp):
        # Only the tail is sent; the manager reads blocks from num_hashed_blocks on.
        manager.cache_blocks(op.seq_id, op.token_ids, op.num_computed_tokens, op.token_offset)
        return None
    if isinstance(op, AllocateOp):
        return manager.allocate(op.seq_id, list(op.token_ids), op.num_new_tokens, op.extra_key)
    if isinstance(op, FreeOp):
        manager.free(op.seq_id)
        return None
    if isinstance(op, SwapOutOp):
        return manager.swap_out(op.seq_id)
    if isinstance(op, SwapInOp):
        return manager.swap_in(op.seq_id)
    if isinstance(op, ForkOp):
        manager.fork(op.parent_id, op.child_id)
        return None
    raise TypeError(f"not a replayable block op: {op!r}")
