from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "skip_special_tokens", "n")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    skip_special_tokens: bool
    n: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GeneratedTokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stop_string", "stop_token_id", "usage", "logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    stop_string: str
    stop_token_id: int
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[GeneratedTokenLogprobs]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[GeneratedTokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    abort: AbortRequest
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("responses", "ends")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    ends: _containers.RepeatedCompositeFieldContainer[StreamEnd]
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ..., ends: _Optional[_Iterable[_Union[StreamEnd, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "family", "vocab_size", "max_model_len", "block_size", "num_device_blocks", "num_host_blocks", "eos_token_ids", "enable_prefix_caching")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    model: str
    family: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    enable_prefix_caching: bool
    def __init__(self, model: _Optional[str] = ..., family: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., enable_prefix_caching: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_swapped", "kv_usage", "replica_id")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_usage: float
    replica_id: str
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., kv_usage: _Optional[float] = ..., replica_id: _Optional[str] = ...) -> None: ...
