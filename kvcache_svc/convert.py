"""picovllm.kvcache.v1 messages <-> the KV-cache domain objects (ops, results, state).

Pure functions, used by the gRPC servicer and client and by the metadata store (which
persists a step's results as a serialized ApplyStepResponse). Repeated scalar fields are
copied out with `[:]` (a list, about three times faster than `list()`, which iterates).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcache_svc.block_pool import Tier
from kvcache_svc.manager import Allocated, Appended, NoFreeBlocks
from kvcache_svc.ops import (
    AllocateOp,
    AppendSlotsOp,
    CacheBlocksOp,
    ForkOp,
    FreeOp,
    Op,
    OpResult,
    PoolConfig,
    ResetOp,
    SwapInOp,
    SwapOutOp,
)
from kvcache_svc.state import BlockRecord, KVState, PoolSnapshot, SeqSnapshot
from protos.picovllm.kvcache.v1 import kvcache_pb2 as pb

_TIER_TO_PB = {Tier.DEVICE: pb.TIER_DEVICE, Tier.HOST: pb.TIER_HOST}
_TIER_FROM_PB: dict[int, Tier] = {v: k for k, v in _TIER_TO_PB.items()}


def tier_from_pb(value: int) -> Tier:
    if value not in _TIER_FROM_PB:
        raise ValueError(f"unknown tier {value}")
    return _TIER_FROM_PB[value]


# ----------------------------------------------------------------- config
def config_to_pb(c: PoolConfig) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_device_blocks=c.num_device_blocks,
        num_host_blocks=c.num_host_blocks,
        block_size=c.block_size,
        enable_prefix_caching=c.enable_prefix_caching,
        epoch=c.epoch,
        group_windows=c.group_windows,
    )


def config_from_pb(m: pb.PoolConfig) -> PoolConfig:
    windows = tuple(m.group_windows) or (0,)
    return PoolConfig(m.num_device_blocks, m.num_host_blocks, m.block_size, m.enable_prefix_caching, m.epoch, windows)


# ----------------------------------------------------------------- ops
def op_to_pb(op: Op) -> pb.BlockOp:
    if isinstance(op, AppendSlotsOp):
        return pb.BlockOp(
            append_slots=pb.AppendSlotsOp(
                seq_id=op.seq_id, num_computed_tokens=op.num_computed_tokens, num_new_tokens=op.num_new_tokens
            )
        )
    if isinstance(op, CacheBlocksOp):
        return pb.BlockOp(
            cache_blocks=pb.CacheBlocksOp(
                seq_id=op.seq_id,
                token_offset=op.token_offset,
                token_ids=op.token_ids,
                num_computed_tokens=op.num_computed_tokens,
            )
        )
    if isinstance(op, AllocateOp):
        return pb.BlockOp(
            allocate=pb.AllocateOp(
                seq_id=op.seq_id, token_ids=op.token_ids, num_new_tokens=op.num_new_tokens, extra_key=op.extra_key
            )
        )
    if isinstance(op, FreeOp):
        return pb.BlockOp(free=pb.FreeOp(seq_id=op.seq_id))
    if isinstance(op, SwapOutOp):
        return pb.BlockOp(swap_out=pb.SwapOutOp(seq_id=op.seq_id))
    if isinstance(op, SwapInOp):
        return pb.BlockOp(swap_in=pb.SwapInOp(seq_id=op.seq_id))
    if isinstance(op, ForkOp):
        return pb.BlockOp(fork=pb.ForkOp(parent_id=op.parent_id, child_id=op.child_id))
    if isinstance(op, ResetOp):
        return pb.BlockOp(reset=pb.ResetOp(config=config_to_pb(op.config)))
    raise TypeError(f"not a block op: {op!r}")


def step_request(step: int, ops: list[Op]) -> pb.ApplyStepRequest:
    m = pb.ApplyStepRequest(step=step)
    add = m.ops.add
    for op in ops:
        if type(op) is AppendSlotsOp:  # one per running sequence per step: filled in place, no message copy
            a = add().append_slots
            a.seq_id, a.num_computed_tokens, a.num_new_tokens = op.seq_id, op.num_computed_tokens, op.num_new_tokens
        else:
            m.ops.append(op_to_pb(op))
    return m


def ops_from_pb(ms: Iterable[pb.BlockOp]) -> list[Op]:
    """op_from_pb over a request's ops; the one op every running sequence sends every step
    (append_slots) is read inline."""
    ops: list[Op] = []
    append = ops.append
    for m in ms:
        if m.WhichOneof("op") == "append_slots":
            a = m.append_slots
            append(AppendSlotsOp(a.seq_id, a.num_computed_tokens, a.num_new_tokens))
        else:
            append(op_from_pb(m))
    return ops


def op_from_pb(m: pb.BlockOp) -> Op:
    kind = m.WhichOneof("op")
    if kind == "append_slots":
        a = m.append_slots
        return AppendSlotsOp(a.seq_id, a.num_computed_tokens, a.num_new_tokens)
    if kind == "cache_blocks":
        c = m.cache_blocks
        return CacheBlocksOp(c.seq_id, c.token_offset, c.token_ids[:], c.num_computed_tokens)
    if kind == "allocate":
        a = m.allocate
        return AllocateOp(a.seq_id, a.token_ids[:], a.num_new_tokens, a.extra_key if a.HasField("extra_key") else None)
    if kind == "free":
        return FreeOp(m.free.seq_id)
    if kind == "swap_out":
        return SwapOutOp(m.swap_out.seq_id)
    if kind == "swap_in":
        return SwapInOp(m.swap_in.seq_id)
    if kind == "fork":
        return ForkOp(m.fork.parent_id, m.fork.child_id)
    if kind == "reset":
        return ResetOp(config_from_pb(m.reset.config))
    raise ValueError("a BlockOp with no operation set")


# ----------------------------------------------------------------- results
def _copies_to_pb(pairs: list[tuple[int, int]]) -> pb.BlockCopies:
    return pb.BlockCopies(src=[s for s, _ in pairs], dst=[d for _, d in pairs])


def _copies_from_pb(m: pb.BlockCopies) -> list[tuple[int, int]]:
    return list(zip(m.src, m.dst))


def result_to_pb(r: OpResult) -> pb.OpResult:
    if r is None:
        return pb.OpResult()
    if isinstance(r, Appended):
        if not (r.new_block_ids or r.copies or r.replaced):  # most decode steps: skip building empty lists
            m = pb.OpResult()
            m.appended.SetInParent()
            return m
        return pb.OpResult(
            appended=pb.AppendResult(
                new_block_ids=r.new_block_ids,
                copies=_copies_to_pb(r.copies),
                replaced_index=[i for i, _ in r.replaced],
                replaced_block=[b for _, b in r.replaced],
            )
        )
    if isinstance(r, Allocated):
        return pb.OpResult(
            allocated=pb.AllocateResult(
                num_cached_tokens=r.num_cached_tokens, num_new_tokens=r.num_new_tokens, block_ids=r.block_ids
            )
        )
    if isinstance(r, NoFreeBlocks):
        return pb.OpResult(
            no_free_blocks=pb.NoFreeBlocksResult(needed=r.needed, available=r.available, tier=_TIER_TO_PB[r.tier])
        )
    return pb.OpResult(swapped=_copies_to_pb(r))


def result_from_pb(m: pb.OpResult) -> OpResult:
    kind = m.WhichOneof("result")
    if kind is None:
        return None
    if kind == "appended":
        a = m.appended
        if not (a.new_block_ids or a.replaced_index or a.copies.src):  # most decode steps: nothing to zip
            return Appended([], [], [])
        return Appended(a.new_block_ids[:], _copies_from_pb(a.copies), list(zip(a.replaced_index, a.replaced_block)))
    if kind == "allocated":
        a = m.allocated
        return Allocated(a.num_cached_tokens, a.num_new_tokens, a.block_ids[:])
    if kind == "no_free_blocks":
        n = m.no_free_blocks
        return NoFreeBlocks(n.needed, n.available, tier_from_pb(n.tier))
    return _copies_from_pb(m.swapped)


def step_response(step: int, results: list[OpResult]) -> pb.ApplyStepResponse:
    m = pb.ApplyStepResponse(step=step)
    add = m.results.add
    for r in results:
        if r is None:  # add() in place: about half the cost of building and copying a message per result
            add()
        elif isinstance(r, Appended) and not (r.new_block_ids or r.copies or r.replaced):
            add().appended.SetInParent()
        else:
            m.results.append(result_to_pb(r))
    return m


# ----------------------------------------------------------------- state
def _pool_to_pb(p: PoolSnapshot) -> pb.PoolState:
    blocks = [
        pb.BlockState(block_id=b.block_id, ref_count=b.ref_count, block_hash=b.block_hash, token_ids=b.token_ids or ())
        for b in p.blocks
    ]
    return pb.PoolState(
        num_blocks=p.num_blocks, blocks=blocks, free_ids=p.free_ids, lru_ids=p.lru_ids, num_evictions=p.num_evictions
    )


def _pool_from_pb(m: pb.PoolState) -> PoolSnapshot:
    blocks = [
        BlockRecord(
            b.block_id,
            b.ref_count,
            b.block_hash if b.HasField("block_hash") else None,
            tuple(b.token_ids) if b.HasField("block_hash") else None,
        )
        for b in m.blocks
    ]
    return PoolSnapshot(m.num_blocks, blocks, m.free_ids[:], m.lru_ids[:], m.num_evictions)


def state_to_pb(s: KVState) -> pb.KVState:
    m = pb.KVState(step=s.step, num_prefix_queries=s.num_prefix_queries, num_prefix_hits=s.num_prefix_hits)
    if s.config is not None:
        m.config.CopyFrom(config_to_pb(s.config))
    if s.device is not None and s.host is not None:
        m.device.CopyFrom(_pool_to_pb(s.device))
        m.host.CopyFrom(_pool_to_pb(s.host))
    m.seqs.extend(
        pb.SeqState(
            seq_id=q.seq_id,
            tier=_TIER_TO_PB[q.tier],
            block_ids=q.block_ids,
            extra_key=q.extra_key,
            num_hashed_blocks=q.num_hashed_blocks,
            last_hash=q.last_hash,
        )
        for q in s.seqs
    )
    return m


def state_from_pb(m: pb.KVState) -> KVState:
    if not m.HasField("config"):
        return KVState(None, m.step)
    seqs = [
        SeqSnapshot(
            q.seq_id,
            tier_from_pb(q.tier),
            q.block_ids[:],
            q.extra_key if q.HasField("extra_key") else None,
            q.num_hashed_blocks,
            q.last_hash if q.HasField("last_hash") else None,
        )
        for q in m.seqs
    ]
    return KVState(
        config_from_pb(m.config),
        m.step,
        _pool_from_pb(m.device),
        _pool_from_pb(m.host),
        seqs,
        m.num_prefix_queries,
        m.num_prefix_hits,
    )
