"""A launched step: its device work queued, its sampled tokens read back on demand."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model_svc.step import SampledToken, SeqStep, StepOutput

if TYPE_CHECKING:
    from model_svc.runner import ModelRunner


class LaunchedStep:
    """A step whose device work is queued: the sampled ids are copied to pinned host memory
    behind an event, so waiting for them does not stall the work queued after it."""

    def __init__(self, runner: "ModelRunner", seqs: list[SeqStep], token_ids: torch.Tensor | None, sampler_out=None) -> None:
        self.runner, self.seqs, self.sampler_out = runner, seqs, sampler_out
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
        tokens = self._host.tolist()  # (B, num_steps)
        runner = self.runner
        out = StepOutput([SampledToken(s.seq_id, toks[0], extra_token_ids=toks[1:]) for s, toks in zip(self.seqs, tokens)])
        with runner._state_lock:  # the model service may be launching the next step meanwhile
            for s, toks in zip(self.seqs, tokens):
                state = runner.seqs.get(s.seq_id)
                if state is not None:  # history for penalties: the tokens sampled here, by position
                    end = s.start_pos + len(s.token_ids)
                    state.token_ids[end:] = toks
        result = self.sampler_out
        if result is not None and result.logprobs is not None:
            logprobs = result.logprobs.tolist()
            top_ids, top_lps = result.top_token_ids.tolist(), result.top_logprobs.tolist()
            for i, s in enumerate(self.seqs):
                state = runner.seqs.get(s.seq_id)
                n = state.sampling.logprobs if state is not None else None
                if n is not None:
                    out.sampled[i].logprob = logprobs[i]
                    out.sampled[i].top_logprobs = list(zip(top_ids[i][:n], top_lps[i][:n]))
        return out
