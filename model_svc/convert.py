"""picovllm.model.v1 messages <-> the step messages of model_svc.step (pure functions).

No torch here: the scheduler's model client imports this module too.
"""

from __future__ import annotations

from typing import Any

from model_svc.step import SampledToken, SeqStep, StepInput, StepOutput
from protos.picovllm.model.v1 import model_pb2 as pb


def _copies_to_pb(pairs: list[tuple[int, int]]) -> pb.BlockCopies:
    return pb.BlockCopies(src=[s for s, _ in pairs], dst=[d for _, d in pairs])


def _copies_from_pb(m: pb.BlockCopies) -> list[tuple[int, int]]:
    return list(zip(m.src, m.dst))


def sampling_to_pb(p: Any) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logprobs=p.logprobs,
    )


def sampling_from_pb(m: pb.SamplingParams) -> Any:
    from scheduler_svc.sampling_params import SamplingParams  # plain dataclass, no torch

    return SamplingParams(
        temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        repetition_penalty=m.repetition_penalty, presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty, logprobs=m.logprobs if m.HasField("logprobs") else None,
    )


def seq_to_pb(s: SeqStep, m: pb.SeqStep | None = None) -> pb.SeqStep:
    """Fills `m` (a message added in place to its step: no copy) or a new message."""
    if m is None:
        m = pb.SeqStep()
    m.seq_id, m.start_pos, m.sample = s.seq_id, s.start_pos, s.sample
    m.token_ids.extend(s.token_ids)
    if s.table_blocks is not None:
        m.table_changed, m.table_start = True, s.table_start
        m.table_blocks.extend(s.table_blocks)
    if s.sampling is not None:
        m.sampling.CopyFrom(sampling_to_pb(s.sampling))
        m.prompt_token_ids.extend(s.prompt_token_ids or ())
    return m


def seq_from_pb(m: pb.SeqStep) -> SeqStep:
    s = SeqStep(m.seq_id, list(m.token_ids), m.start_pos, m.sample)
    if m.table_changed:
        s.table_start, s.table_blocks = m.table_start, list(m.table_blocks)
    if m.HasField("sampling"):
        s.sampling, s.prompt_token_ids = sampling_from_pb(m.sampling), list(m.prompt_token_ids)
    return s


def step_to_pb(inp: StepInput, expected_epoch: str) -> pb.StepRequest:
    m = pb.StepRequest(expected_epoch=expected_epoch, finished=inp.finished, num_steps=inp.num_steps)
    add = m.seqs.add
    for s in inp.seqs:  # filled in place: building each SeqStep and copying it in costs twice as much
        seq_to_pb(s, add())
    for name in ("swap_out", "copies", "swap_in"):  # usually empty: an unset message reads as no pairs
        pairs = getattr(inp, name)
        if pairs:
            getattr(m, name).CopyFrom(_copies_to_pb(pairs))
    return m


def step_from_pb(m: pb.StepRequest) -> StepInput:
    return StepInput([seq_from_pb(s) for s in m.seqs], _copies_from_pb(m.swap_out), _copies_from_pb(m.swap_in),
                     _copies_from_pb(m.copies), list(m.finished), max(1, m.num_steps))


def output_to_pb(out: StepOutput, epoch: str) -> pb.StepResponse:
    resp = pb.StepResponse(epoch=epoch)
    add = resp.sampled.add
    for t in out.sampled:  # filled in place, optional parts only when present (most steps: one greedy token each)
        m = add()
        m.seq_id, m.token_id = t.seq_id, t.token_id
        if t.logprob is not None:
            m.logprob = t.logprob
        if t.extra_token_ids:
            m.extra_token_ids.extend(t.extra_token_ids)
        if t.top_logprobs:
            m.top_logprobs.extend(pb.TokenLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs)
    return resp


def output_from_pb(m: pb.StepResponse) -> StepOutput:
    sampled = []
    for t in m.sampled:
        if not t.HasField("logprob") and not t.extra_token_ids:  # the common case: skip the optional parts
            sampled.append(SampledToken(t.seq_id, t.token_id))
            continue
        logprob = t.logprob if t.HasField("logprob") else None
        top = [(x.token_id, x.logprob) for x in t.top_logprobs] if logprob is not None else None
        sampled.append(SampledToken(t.seq_id, t.token_id, logprob, top, list(t.extra_token_ids)))
    return StepOutput(sampled)
