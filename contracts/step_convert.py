"""picovllm.model.v1 messages <-> the step messages of contracts.step (pure functions), used
by both ends of the Step call: the scheduler's model client and the model service.

Most steps are decode steps: one token per sequence (often a placeholder), no sampling
params, sometimes a block-table change, and one plain token back per sequence. Those rows
travel as parallel lists (the columnar fields), so converting a step costs a few list
operations instead of a message per sequence; every other sequence or token travels as its
own message, and the step's order is kept.
"""

from __future__ import annotations

from itertools import compress
from typing import Any

from contracts.sampling_params import SamplingParams
from contracts.step import SampledToken, SeqStep, StepInput, StepOutput
from protos.picovllm.model.v1 import model_pb2 as pb


def _copies_to_pb(pairs: list[tuple[int, int]]) -> pb.BlockCopies:
    return pb.BlockCopies(src=[s for s, _ in pairs], dst=[d for _, d in pairs])


def _copies_from_pb(m: pb.BlockCopies) -> list[tuple[int, int]]:
    return list(zip(m.src, m.dst))


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logprobs=p.logprobs,
    )


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=m.temperature,
        top_p=m.top_p,
        top_k=m.top_k,
        min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        repetition_penalty=m.repetition_penalty,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
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


def _split(items: list, plain: list[bool]) -> tuple[list, list, list[int]]:
    """(the plain items, the others, the others' indices), each in order."""
    if all(plain):
        return items, [], []
    at = [i for i, p in enumerate(plain) if not p]
    return list(compress(items, plain)), [items[i] for i in at], at


def _merge(plain: list, others: list, at: Any) -> list:
    """Inverse of _split: each of `others` back at its index (ascending), the plain items in
    the gaps."""
    if not others:
        return plain
    if not plain:
        return others
    for i, x in zip(at, others):  # ascending: everything before i is already in place
        plain.insert(i, x)
    return plain


def step_to_pb(inp: StepInput, expected_epoch: str) -> pb.StepRequest:
    """Plain decode rows as parallel lists, the rest as SeqStep messages."""
    m = pb.StepRequest(expected_epoch=expected_epoch, finished=inp.finished)
    decode, seqs, at = _split(inp.seqs, [s.sampling is None and len(s.token_ids) == 1 for s in inp.seqs])
    if decode:
        m.seqs_at.extend(at)
        m.decode_seq_ids.extend([s.seq_id for s in decode])
        m.decode_token_ids.extend([s.token_ids[0] for s in decode])
        m.decode_start_pos.extend([s.start_pos for s in decode])
        m.decode_sample.extend([s.sample for s in decode])
        rows = [i for i, s in enumerate(decode) if s.table_blocks is not None]
        if rows:  # a block table that grew (every block_size tokens) or had entries replaced
            tables = [decode[i] for i in rows]
            m.decode_table_rows.extend(rows)
            m.decode_table_starts.extend([s.table_start for s in tables])
            m.decode_table_lens.extend([len(s.table_blocks) for s in tables])
            m.decode_table_blocks.extend([b for s in tables for b in s.table_blocks])
    add = m.seqs.add
    for s in seqs:  # filled in place: building each SeqStep and copying it in costs twice as much
        seq_to_pb(s, add())
    for name in ("swap_out", "copies", "swap_in"):  # usually empty: an unset message reads as no pairs
        pairs = getattr(inp, name)
        if pairs:
            getattr(m, name).CopyFrom(_copies_to_pb(pairs))
    return m


def _decode_rows_from_pb(m: pb.StepRequest) -> list[SeqStep]:
    decode = list(
        map(SeqStep, m.decode_seq_ids, [[t] for t in m.decode_token_ids], m.decode_start_pos, m.decode_sample)
    )
    if m.decode_table_rows:
        blocks, end = list(m.decode_table_blocks), 0
        for row, start, n in zip(m.decode_table_rows, m.decode_table_starts, m.decode_table_lens):
            s = decode[row]
            s.table_start, s.table_blocks = start, blocks[end : end + n]
            end += n
    return decode


def step_from_pb(m: pb.StepRequest) -> StepInput:
    seqs = [seq_from_pb(s) for s in m.seqs]
    if m.decode_seq_ids:
        seqs = _merge(_decode_rows_from_pb(m), seqs, m.seqs_at)
    return StepInput(
        seqs, _copies_from_pb(m.swap_out), _copies_from_pb(m.swap_in), _copies_from_pb(m.copies), list(m.finished)
    )


def output_to_pb(out: StepOutput, epoch: str) -> pb.StepResponse:
    """Plain tokens as two parallel lists, the others (with logprobs) as SampledToken messages."""
    resp = pb.StepResponse(epoch=epoch)
    plain, sampled, at = _split(out.sampled, [t.logprob is None and not t.top_logprobs for t in out.sampled])
    if plain:
        resp.sampled_at.extend(at)
        resp.sampled_seq_ids.extend([t.seq_id for t in plain])
        resp.sampled_token_ids.extend([t.token_id for t in plain])
    add = resp.sampled.add
    for t in sampled:  # filled in place: building each message and copying it in costs twice as much
        m = add()
        m.seq_id, m.token_id = t.seq_id, t.token_id
        if t.logprob is not None:
            m.logprob = t.logprob
        if t.top_logprobs:
            m.top_logprobs.extend(pb.TokenLogprob(token_id=i, logprob=lp) for i, lp in t.top_logprobs)
    return resp


def output_from_pb(m: pb.StepResponse) -> StepOutput:
    sampled = []
    for t in m.sampled:
        logprob = t.logprob if t.HasField("logprob") else None
        top = [(x.token_id, x.logprob) for x in t.top_logprobs] if logprob is not None else None
        sampled.append(SampledToken(t.seq_id, t.token_id, logprob, top))
    if m.sampled_seq_ids:
        sampled = _merge(list(map(SampledToken, m.sampled_seq_ids, m.sampled_token_ids)), sampled, m.sampled_at)
    return StepOutput(sampled)
