"""The messages of one engine step between the scheduler and the model service.

Token ids only (text lives in the scheduler). A new sequence is sent whole once; after that
only what changed: its new tokens and the block-table entries that differ from the last
step's (the model service keeps each sequence's table).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.sampling_params import SamplingParams

# A decode input whose token the host does not know yet: the model service feeds the token it
# sampled for that sequence in its previous step (lets the host schedule while the device runs).
PLACEHOLDER = -1


@dataclass(slots=True)
class SeqStep:
    seq_id: str
    token_ids: list[int]  # tokens to feed this step (a prompt chunk, or the last sampled token)
    start_pos: int  # position of token_ids[0]; every earlier position is in the cache
    sample: bool  # sample a next token after the last fed one (False for non-final chunks)
    table_start: int = 0  # block_table[table_start:] = table_blocks (replaces the tail)
    table_blocks: list[int] | None = None  # None: the table did not change
    sampling: SamplingParams | None = None  # sent with the first step of a sequence
    prompt_token_ids: list[int] | None = None  # with `sampling`: the whole prompt (penalties)


@dataclass(slots=True)
class StepInput:
    seqs: list[SeqStep] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block pairs
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
    finished: list[str] = field(default_factory=list)  # forget these sequences

    def is_empty(self) -> bool:
        """Nothing for the model side to do: no sequences, block moves or sequences to forget."""
        return not (self.seqs or self.swap_out or self.swap_in or self.copies or self.finished)


@dataclass(slots=True)
class SampledToken:
    seq_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class StepOutput:
    sampled: list[SampledToken] = field(default_factory=list)
