from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier

class PoolConfig(_message.Message):
    __slots__ = ("num_device_blocks", "num_host_blocks", "block_size", "enable_prefix_caching", "epoch", "group_windows")
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    num_device_blocks: int
    num_host_blocks: int
    block_size: int
    enable_prefix_caching: bool
    epoch: str
    group_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., enable_prefix_caching: _Optional[bool] = ..., epoch: _Optional[str] = ..., group_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class ResetOp(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: PoolConfig
    def __init__(self, config: _Optional[_Union[PoolConfig, _Mapping]] = ...) -> None: ...

class AllocateOp(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_new_tokens", "extra_key")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: int
    extra_key: str
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[int] = ..., extra_key: _Optional[str] = ...) -> None: ...

class AppendSlotsOp(_message.Message):
    __slots__ = ("seq_id", "num_computed_tokens", "num_new_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_computed_tokens: int
    num_new_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., num_computed_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ...) -> None: ...

class CacheBlocksOp(_message.Message):
    __slots__ = ("seq_id", "token_offset", "token_ids", "num_computed_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., token_offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class FreeOp(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class ForkOp(_message.Message):
    __slots__ = ("parent_id", "child_id")
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ID_FIELD_NUMBER: _ClassVar[int]
    parent_id: str
    child_id: str
    def __init__(self, parent_id: _Optional[str] = ..., child_id: _Optional[str] = ...) -> None: ...

class SwapOutOp(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class SwapInOp(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class BlockOp(_message.Message):
    __slots__ = ("reset", "allocate", "append_slots", "cache_blocks", "free", "fork", "swap_out", "swap_in")
    RESET_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    APPEND_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    reset: ResetOp
    allocate: AllocateOp
    append_slots: AppendSlotsOp
    cache_blocks: CacheBlocksOp
    free: FreeOp
    fork: ForkOp
    swap_out: SwapOutOp
    swap_in: SwapInOp
    def __init__(self, reset: _Optional[_Union[ResetOp, _Mapping]] = ..., allocate: _Optional[_Union[AllocateOp, _Mapping]] = ..., append_slots: _Optional[_Union[AppendSlotsOp, _Mapping]] = ..., cache_blocks: _Optional[_Union[CacheBlocksOp, _Mapping]] = ..., free: _Optional[_Union[FreeOp, _Mapping]] = ..., fork: _Optional[_Union[ForkOp, _Mapping]] = ..., swap_out: _Optional[_Union[SwapOutOp, _Mapping]] = ..., swap_in: _Optional[_Union[SwapInOp, _Mapping]] = ...) -> None: ...

class BlockCopies(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateResult(_message.Message):
    __slots__ = ("num_cached_tokens", "num_new_tokens", "block_ids")
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    num_new_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_cached_tokens: _Optional[int] = ..., num_new_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendResult(_message.Message):
    __slots__ = ("new_block_ids", "copies", "replaced_index", "replaced_block")
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    REPLACED_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPLACED_BLOCK_FIELD_NUMBER: _ClassVar[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copies: BlockCopies
    replaced_index: _containers.RepeatedScalarFieldContainer[int]
    replaced_block: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, new_block_ids: _Optional[_Iterable[int]] = ..., copies: _Optional[_Union[BlockCopies, _Mapping]] = ..., replaced_index: _Optional[_Iterable[int]] = ..., replaced_block: _Optional[_Iterable[int]] = ...) -> None: ...

class NoFreeBlocksResult(_message.Message):
    __slots__ = ("needed", "available", "tier")
    NEEDED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    needed: int
    available: int
    tier: Tier
    def __init__(self, needed: _Optional[int] = ..., available: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class OpResult(_message.Message):
    __slots__ = ("allocated", "appended", "swapped", "no_free_blocks")
    ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NO_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    allocated: AllocateResult
    appended: AppendResult
    swapped: BlockCopies
    no_free_blocks: NoFreeBlocksResult
    def __init__(self, allocated: _Optional[_Union[AllocateResult, _Mapping]] = ..., appended: _Optional[_Union[AppendResult, _Mapping]] = ..., swapped: _Optional[_Union[BlockCopies, _Mapping]] = ..., no_free_blocks: _Optional[_Union[NoFreeBlocksResult, _Mapping]] = ...) -> None: ...

class ApplyStepRequest(_message.Message):
    __slots__ = ("step", "ops")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    ops: _containers.RepeatedCompositeFieldContainer[BlockOp]
    def __init__(self, step: _Optional[int] = ..., ops: _Optional[_Iterable[_Union[BlockOp, _Mapping]]] = ...) -> None: ...

class ApplyStepResponse(_message.Message):
    __slots__ = ("step", "results")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    results: _containers.RepeatedCompositeFieldContainer[OpResult]
    def __init__(self, step: _Optional[int] = ..., results: _Optional[_Iterable[_Union[OpResult, _Mapping]]] = ...) -> None: ...

class BlockState(_message.Message):
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    REF_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_id: int
    ref_count: int
    block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_id: _Optional[int] = ..., ref_count: _Optional[int] = ..., block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("num_blocks", "blocks", "free_ids", "lru_ids", "num_evictions")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_IDS_FIELD_NUMBER: _ClassVar[int]
    LRU_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockState]
    free_ids: _containers.RepeatedScalarFieldContainer[int]
    lru_ids: _containers.RepeatedScalarFieldContainer[int]
    num_evictions: int
    def __init__(self, num_blocks: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockState, _Mapping]]] = ..., free_ids: _Optional[_Iterable[int]] = ..., lru_ids: _Optional[_Iterable[int]] = ..., num_evictions: _Optional[int] = ...) -> None: ...

class SeqState(_message.Message):
    __slots__ = ("seq_id", "tier", "block_ids", "extra_key", "num_hashed_blocks", "last_hash")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_HASHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAST_HASH_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    tier: Tier
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    extra_key: str
    num_hashed_blocks: int
    last_hash: int
    def __init__(self, seq_id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., block_ids: _Optional[_Iterable[int]] = ..., extra_key: _Optional[str] = ..., num_hashed_blocks: _Optional[int] = ..., last_hash: _Optional[int] = ...) -> None: ...

class KVState(_message.Message):
    __slots__ = ("config", "step", "device", "host", "seqs", "num_prefix_queries", "num_prefix_hits")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    config: PoolConfig
    step: int
    device: PoolState
    host: PoolState
    seqs: _containers.RepeatedCompositeFieldContainer[SeqState]
    num_prefix_queries: int
    num_prefix_hits: int
    def __init__(self, config: _Optional[_Union[PoolConfig, _Mapping]] = ..., step: _Optional[int] = ..., device: _Optional[_Union[PoolState, _Mapping]] = ..., host: _Optional[_Union[PoolState, _Mapping]] = ..., seqs: _Optional[_Iterable[_Union[SeqState, _Mapping]]] = ..., num_prefix_queries: _Optional[int] = ..., num_prefix_hits: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStateResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: KVState
    def __init__(self, state: _Optional[_Union[KVState, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("config", "step", "num_free_device_blocks", "num_free_host_blocks", "num_seqs", "store", "num_prefix_queries", "num_prefix_hits", "all_free_or_cached")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    ALL_FREE_OR_CACHED_FIELD_NUMBER: _ClassVar[int]
    config: PoolConfig
    step: int
    num_free_device_blocks: int
    num_free_host_blocks: int
    num_seqs: int
    store: str
    num_prefix_queries: int
    num_prefix_hits: int
    all_free_or_cached: bool
    def __init__(self, config: _Optional[_Union[PoolConfig, _Mapping]] = ..., step: _Optional[int] = ..., num_free_device_blocks: _Optional[int] = ..., num_free_host_blocks: _Optional[int] = ..., num_seqs: _Optional[int] = ..., store: _Optional[str] = ..., num_prefix_queries: _Optional[int] = ..., num_prefix_hits: _Optional[int] = ..., all_free_or_cached: _Optional[bool] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...
