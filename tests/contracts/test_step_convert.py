"""Round trips of the model Step messages (contracts.step_convert) through the wire format: the
columnar encoding of plain decode rows and plain tokens, the per-sequence messages of the
others, and steps that mix both (the step's order is kept)."""

from __future__ import annotations

import pytest

from contracts import step_convert
from contracts.sampling_params import SamplingParams
from contracts.step import PLACEHOLDER, SampledToken, SeqStep, StepInput, StepOutput
from protos.picovllm.model.v1 import model_pb2 as pb


def _wire_step(inp: StepInput) -> tuple[pb.StepRequest, StepInput]:
    m = pb.StepRequest.FromString(step_convert.step_to_pb(inp, "epoch-1").SerializeToString())
    assert m.expected_epoch == "epoch-1"
    return m, step_convert.step_from_pb(m)


def _wire_output(out: StepOutput) -> tuple[pb.StepResponse, StepOutput]:
    m = pb.StepResponse.FromString(step_convert.output_to_pb(out, "epoch-1").SerializeToString())
    assert m.epoch == "epoch-1"
    return m, step_convert.output_from_pb(m)


def _decode(i: int, token: int = PLACEHOLDER, table: list[int] | None = None, sample: bool = True) -> SeqStep:
    s = SeqStep(f"seq-{i}", [token], 100 + i, sample)
    if table is not None:
        s.table_start, s.table_blocks = i % 3, table
    return s


def _prefill(i: int, first: bool = True) -> SeqStep:
    s = SeqStep(f"pre-{i}", [5, 6, 7, 8 + i], 0 if first else 16, True, 0, [40 + i, 41 + i])
    if first:
        s.sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=i, logprobs=2)
        s.prompt_token_ids = [5, 6, 7, 8 + i]
    return s


DECODE_ONLY = [
    _decode(0, 17),
    _decode(1),
    _decode(2, 3, [9]),
    _decode(3, table=[]),
    _decode(4, 0, [1, 2, 3], sample=False),
]


@pytest.mark.parametrize(
    "seqs",
    [
        [],
        DECODE_ONLY,
        [_prefill(0), _prefill(1, first=False)],  # no decode row: messages only
        [_prefill(0), *DECODE_ONLY[:2], _prefill(1, first=False), *DECODE_ONLY[2:], _prefill(2)],  # mixed, order kept
        [*DECODE_ONLY, _prefill(0)],
        [
            SeqStep("first-decode", [PLACEHOLDER], 9, True, sampling=SamplingParams(), prompt_token_ids=[1])
        ],  # params: a message
    ],
    ids=["empty", "decode", "prefill", "mixed", "decode-then-prefill", "decode-with-params"],
)
def test_step_round_trip(seqs):
    inp = StepInput(list(seqs), swap_out=[(1, 2)], swap_in=[(3, 4), (5, 6)], copies=[(7, 8)], finished=["gone"])
    m, back = _wire_step(inp)
    assert back == inp
    plain = sum(s.sampling is None and len(s.token_ids) == 1 for s in seqs)
    assert len(m.decode_seq_ids) == plain
    assert len(m.seqs) == len(seqs) - plain


def test_columnar_decode_step_sends_no_per_sequence_message():
    m, back = _wire_step(StepInput(list(DECODE_ONLY)))
    assert not m.seqs and not m.seqs_at
    assert list(m.decode_token_ids) == [17, PLACEHOLDER, 3, PLACEHOLDER, 0]
    assert list(m.decode_table_rows) == [2, 3, 4] and list(m.decode_table_lens) == [1, 0, 3]
    assert back.seqs == DECODE_ONLY
    assert back.seqs[1].table_blocks is None and back.seqs[3].table_blocks == []  # unchanged vs emptied tail


def test_empty_step_round_trips():
    _, back = _wire_step(StepInput())
    assert back == StepInput() and back.is_empty()


def test_messages_keep_their_place_among_the_decode_rows():
    m, back = _wire_step(StepInput([_prefill(0), _decode(1), _prefill(1, first=False)]))
    assert list(m.seqs_at) == [0, 2]
    assert [s.seq_id for s in back.seqs] == ["pre-0", "seq-1", "pre-1"]


PLAIN = [SampledToken(f"seq-{i}", 100 + i) for i in range(4)]
WITH_LOGPROBS = SampledToken("lp", 7, -0.25, [(7, -0.25), (9, -1.5)])
GREEDY_LOGPROB = SampledToken("g", 8, -0.5, [])  # logprobs=0: no alternatives, still a message


@pytest.mark.parametrize(
    "sampled",
    [
        [],
        PLAIN,
        [WITH_LOGPROBS, GREEDY_LOGPROB],
        [PLAIN[0], WITH_LOGPROBS, *PLAIN[1:3], GREEDY_LOGPROB, PLAIN[3]],
    ],
    ids=["empty", "plain", "logprobs", "mixed"],
)
def test_output_round_trip(sampled):
    out = StepOutput(list(sampled))
    m, back = _wire_output(out)
    assert back == out
    plain = sum(t.logprob is None for t in sampled)
    assert len(m.sampled_seq_ids) == plain
    assert len(m.sampled) == len(sampled) - len(m.sampled_seq_ids)  # tokens with logprobs travel as messages


def test_plain_output_is_columnar_only():
    m, _ = _wire_output(StepOutput(list(PLAIN)))
    assert not m.sampled and not m.sampled_at
    assert list(m.sampled_seq_ids) == [t.seq_id for t in PLAIN] and list(m.sampled_token_ids) == [
        t.token_id for t in PLAIN
    ]
