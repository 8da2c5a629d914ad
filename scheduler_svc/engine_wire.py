"""The wire between the scheduler's gRPC front end and its engine loop (scheduler_svc.server,
scheduler_svc.engine_client, scheduler_svc.engine_core): length-prefixed pickled frames over
a private stream socket (a socketpair; the engine process inherits its end, nothing else can
reach it, so pickle is safe here).

Front end -> engine, one frame per batch of commands (a list of tuples):

    ("add", request_id, prompt_token_ids, SamplingParams, cache_salt, deadline)
    ("abort", request_id)
    ("stop",)

Engine -> front end:

    ("ready", EngineInfo)            once, when the engine is built
    ("failed", packed error)         instead, when it could not be built
    ("info", EngineInfo)             whenever the model's facts change (a restarted model service)
    ("step", deltas, EngineStats)    once per engine step: every request's output of that step

A delta is a tuple, one per request that produced something in the step (tuples pickle and
unpickle at C speed; a step of 256 requests is one frame):

    running:    (request_id, token_ids, text, logprobs)
    completion: (request_id, token_ids, text, logprobs, index, finish_reason, stop_reason)
    final:      (request_id, token_ids, text, logprobs, finish_reason, stop_reason,
                 num_prompt_tokens, num_output_tokens, num_cached_tokens, packed error or None)

A request of n > 1 completions sends completion deltas only (finish_reason and stop_reason
None but in the one that ends that completion), then a final one with no tokens whose
num_output_tokens counts every completion's.

`logprobs` is None or, per token of `token_ids`, (token_id, logprob, [(token_id, logprob), ...]).
Errors travel as their class names (most derived first) and message, and come back as the
nearest class the front end knows (pack_error / unpack_error): an exception need not pickle.
"""

from __future__ import annotations

import builtins
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from contracts import errors
from contracts.sampling_params import RequestLimits

HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 31


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """The model's facts the front end answers and checks requests with."""

    model: str
    family: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    eos_token_ids: tuple[int, ...]
    enable_prefix_caching: bool
    limits: RequestLimits
    has_tokenizer: bool


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's state after a step: queue lengths (the front end's queue limit and the
    metrics), pool usage and counters (metrics), and why the last step could not reach a
    peer (health, stalled requests)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    device_usage: float = 0.0
    host_usage: float = 0.0
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_preemptions: int = 0
    unavailable: str | None = None
    num_steps: int = 0


def encode(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


def split_frames(buffer: bytearray) -> list[Any]:
    """The whole frames at the start of `buffer`, decoded; their bytes are removed from it."""
    frames, pos = [], 0
    while len(buffer) - pos >= HEADER.size:
        (size,) = HEADER.unpack_from(buffer, pos)
        if len(buffer) - pos - HEADER.size < size:
            break
        frames.append(pickle.loads(memoryview(buffer)[pos + HEADER.size : pos + HEADER.size + size]))
        pos += HEADER.size + size
    del buffer[:pos]
    return frames


_KNOWN: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (*(getattr(errors, n) for n in dir(errors)), *(getattr(builtins, n) for n in dir(builtins)))
    if isinstance(cls, type) and issubclass(cls, Exception)
}


def pack_error(exc: BaseException) -> tuple[tuple[str, ...], str]:
    return tuple(c.__name__ for c in type(exc).__mro__), str(exc)


def unpack_error(packed: tuple[tuple[str, ...], str]) -> Exception:
    """The packed error's own class when the front end knows it, else the nearest base that
    maps to the same status code (errors.status_code_for), else the nearest known base."""
    names, message = packed
    mapped = {cls for cls, _ in errors._CODES}
    known = [_KNOWN[n] for n in names if n in _KNOWN]
    for cls in [c for c in known if c.__name__ == names[0]] + [c for c in known if c in mapped] + known:
        try:
            return cls(message)
        except TypeError:  # a constructor with other arguments (SequenceFailed)
            continue
    return RuntimeError(message)
