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


def seq_to_pb(s: SeqStep) -> pb.SeqStep:
    m = pb.SeqStep(seq_id=s.seq_id, token_ids=s.token_ids, start_pos=s.start_pos, sample=s.sample)
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
    return pb.StepRequest(
        expected_epoch=expected_epoch, seqs=[seq_to_pb(s) for s in inp.seqs], swap_out=_copies_to_pb(inp.swap_out),
        copies=_copies_to_pb(inp.copies), swap_in=_copies_to_pb(inp.swap_in), finished=inp.finished, num_steps=inp.num_steps,
    )


def step_from_pb(m: pb.StepRequest) -> StepInput:
    return StepInput([seq_from_pb(s) for s in m.seqs], _copies_from_pb(m.swap_out), _copies_from_pb(m.swap_in),
                     _copies_from_pb(m.copies), list(m.finished), max(1, m.num_steps))


def output_to_pb(out: StepOutput, epoch: str) -> pb.StepResponse:
    sampled = []
    for t in out.sampled:
        m = pb.SampledToken(seq_id=t.seq_id, token_id=t.token_id, logprob=t.logprob, extra_token_ids=t.extra_token_ids)
        m.top_logprobs.extend(pb.TokenLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs or ())
        sampled.append(m)
    return pb.StepResponse(epoch=epoch, sampled=sampled)


def output_from_pb(m: pb.StepResponse) -> StepOutput:
    sampled = []
    for t in m.sampled:
        logprob = t.logprob if t.HasField("logprob") else None
        top = [(x.token_id, x.logprob) for x in t.top_logprobs] if logprob is not None else None
        sampled.append(SampledToken(t.seq_id, t.token_id, logprob, top, list(t.extra_token_ids)))
    return StepOutput(sampled)
