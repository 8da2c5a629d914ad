"""A request's state as the scheduler sees it.

A request of n > 1 completions (parallel sampling) is a parent with n children, made when it
is added. The parent's own sequence prefills the prompt but its last token; then the
scheduler forks it: each child shares the parent's blocks by reference, feeds the last
prompt token itself and samples its first token with its own parameters
(SamplingParams.child), and the parent's sequence is dropped. The request is finished when
every child is.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from contracts.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + generated, grows in place
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_pending: int = 0  # tokens sampled (or being sampled) on the device, not yet read back
    num_sent_blocks: int = 0  # the model side has the table's first blocks (it only grows between preemptions)
    table_replaced: bool = False  # entries of the table changed (copy-on-write, swap-in): send it whole
    sent_sampling: bool = False  # the model side knows this sequence
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    first_token_time: float | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # The prompt as int64 bytes, made by add_request's check of given ids, for the prefix-cache
    # lookup of its first admission (None: the lookup converts the tokens itself).
    prompt_bytes: bytes | None = None
    index: int = 0  # the completion a child is (0 for a request of one completion)
    parent: Request | None = None  # a child's parent request
    children: list[Request] = field(default_factory=list)  # n > 1: the completions, in index order
    forked: bool = False  # a parent whose children run (its own sequence is gone)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        n = self.sampling.n
        if n > 1 and not self.children:
            self.children = [
                Request(
                    child_seq_id(self.request_id, i),
                    self.prompt_token_ids,
                    self.sampling.child(i),
                    self.eos_token_ids,
                    self.cache_salt,
                    self.arrival_time,
                    index=i,
                    parent=self,
                )
                for i in range(n)
            ]

    @property
    def feed_end(self) -> int:
        """The position up to which this sequence can be fed now: everything known and pending,
        or for a parent before its fork the prompt but its last token (each child feeds that
        one itself, to sample its own first token)."""
        if self.children:
            return self.num_prompt_tokens - 1
        return self.num_tokens + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def completions(self) -> list[Request]:
        """The sequences that generate: the children, or the request itself."""
        return self.children or [self]


def child_seq_id(request_id: str, index: int) -> str:
    """The sequence id of completion `index` of a parallel-sampling request."""
    return f"{request_id}#{index}"
