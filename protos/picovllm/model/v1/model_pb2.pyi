from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockCopies(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ...) -> None: ...

class SeqStep(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_pos", "sample", "table_changed", "table_start", "table_blocks", "sampling", "prompt_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TABLE_CHANGED_FIELD_NUMBER: _ClassVar[int]
    TABLE_START_FIELD_NUMBER: _ClassVar[int]
    TABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_pos: int
    sample: bool
    table_changed: bool
    table_start: int
    table_blocks: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_pos: _Optional[int] = ..., sample: _Optional[bool] = ..., table_changed: _Optional[bool] = ..., table_start: _Optional[int] = ..., table_blocks: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("expected_epoch", "seqs", "swap_out", "copies", "swap_in", "finished", "num_steps", "decode_seq_ids", "decode_token_ids", "decode_start_pos", "decode_sample", "decode_table_rows", "decode_table_starts", "decode_table_lens", "decode_table_blocks", "seqs_at", "columnar_answer")
    EXPECTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_START_POS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TABLE_STARTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TABLE_LENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEQS_AT_FIELD_NUMBER: _ClassVar[int]
    COLUMNAR_ANSWER_FIELD_NUMBER: _ClassVar[int]
    expected_epoch: str
    seqs: _containers.RepeatedCompositeFieldContainer[SeqStep]
    swap_out: BlockCopies
    copies: BlockCopies
    swap_in: BlockCopies
    finished: _containers.RepeatedScalarFieldContainer[str]
    num_steps: int
    decode_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    decode_token_ids: _containers.RepeatedScalarFieldContainer[int]
    decode_start_pos: _containers.RepeatedScalarFieldContainer[int]
    decode_sample: _containers.RepeatedScalarFieldContainer[bool]
    decode_table_rows: _containers.RepeatedScalarFieldContainer[int]
    decode_table_starts: _containers.RepeatedScalarFieldContainer[int]
    decode_table_lens: _containers.RepeatedScalarFieldContainer[int]
    decode_table_blocks: _containers.RepeatedScalarFieldContainer[int]
    seqs_at: _containers.RepeatedScalarFieldContainer[int]
    columnar_answer: bool
    def __init__(self, expected_epoch: _Optional[str] = ..., seqs: _Optional[_Iterable[_Union[SeqStep, _Mapping]]] = ..., swap_out: _Optional[_Union[BlockCopies, _Mapping]] = ..., copies: _Optional[_Union[BlockCopies, _Mapping]] = ..., swap_in: _Optional[_Union[BlockCopies, _Mapping]] = ..., finished: _Optional[_Iterable[str]] = ..., num_steps: _Optional[int] = ..., decode_seq_ids: _Optional[_Iterable[str]] = ..., decode_token_ids: _Optional[_Iterable[int]] = ..., decode_start_pos: _Optional[_Iterable[int]] = ..., decode_sample: _Optional[_Iterable[bool]] = ..., decode_table_rows: _Optional[_Iterable[int]] = ..., decode_table_starts: _Optional[_Iterable[int]] = ..., decode_table_lens: _Optional[_Iterable[int]] = ..., decode_table_blocks: _Optional[_Iterable[int]] = ..., seqs_at: _Optional[_Iterable[int]] = ..., columnar_answer: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "top_logprobs", "extra_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    extra_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., extra_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("epoch", "sampled", "sampled_seq_ids", "sampled_token_ids", "sampled_at")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_AT_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    sampled_seq_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_at: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[str] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., sampled_seq_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., sampled_at: _Optional[_Iterable[int]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("epoch", "model", "family", "vocab_size", "max_position_embeddings", "eos_token_ids", "bos_token_id", "block_size", "num_device_blocks", "num_host_blocks", "device", "dtype", "columnar_step", "kv_group_windows")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COLUMNAR_STEP_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    model: str
    family: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    device: str
    dtype: str
    columnar_step: bool
    kv_group_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[str] = ..., model: _Optional[str] = ..., family: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., columnar_step: _Optional[bool] = ..., kv_group_windows: _Optional[_Iterable[int]] = ...) -> None: ...
