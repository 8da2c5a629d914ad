"""A launched step: its device work queued, its sampled tokens read back on demand.

It writes what it sampled into the runner's per-sequence states (the history penalties read),
which it gets with their lock rather than the runner itself: the runner creates it, and this
module needs no more of the runner than that.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from contracts.step import SampledToken, SeqStep, StepOutput


class LaunchedStep:
    """A step whose device work is queued: the sampled ids are copied to pinned host memory
    behind an event, so waiting for them does not stall the work queued after it."""

    def __init__(
        self,
        states: dict[str, Any],
        state_lock: threading.Lock,
        seqs: list[SeqStep],
        token_ids: torch.Tensor | None,
        sampler_out=None,
    ) -> None:
        self.states, self.state_lock, self.seqs, self.sampler_out = states, state_lock, seqs, sampler_out
        self._host = None
        self._event = None
        if token_ids is not None:
            if token_ids.is_cuda:
                self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
                self._host.copy_(token_ids, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._host = token_ids

    def done(self) -> bool:
        """The device has finished the step (its tokens are in host memory); never blocks.
        False off CUDA: there the step ran in launch() and is read back in pipeline order."""
        return self._event is not None and self._event.query()

    def result(self) -> StepOutput:
        if self._host is None:
            return StepOutput()
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host.tolist()  # (B,)
        states = self.states
        out = StepOutput([SampledToken(s.seq_id, tok) for s, tok in zip(self.seqs, tokens)])
        with self.state_lock:  # the model service may be launching the next step meanwhile
            for s, tok in zip(self.seqs, tokens):
                state = states.get(s.seq_id)
                if state is not None:  # history for penalties: the token sampled here, by position
                    end = s.start_pos + len(s.token_ids)
                    state.token_ids[end:] = [tok]
        result = self.sampler_out
        if result is not None and result.logprobs is not None:
            logprobs = result.logprobs.tolist()
            top_ids, top_lps = result.top_token_ids.tolist(), result.top_logprobs.tolist()
            for i, s in enumerate(self.seqs):
                state = states.get(s.seq_id)
                n = state.sampling.logprobs if state is not None else None
                if n is not None:
                    out.sampled[i].logprob = logprobs[i]
                    out.sampled[i].top_logprobs = list(zip(top_ids[i][:n], top_lps[i][:n]))
        return out
