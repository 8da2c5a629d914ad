"""Streaming semantics when messages carry several tokens (coalescing): a front end whose
streams are behind sends every token since the last message in the next one. Forced here by
the servicer's least interval between two messages of a stream, over the engine loop in a
thread of this process (the engine process's wire and loop) and a real gRPC server: tokens
in order, none lost or repeated (equal to greedy generation without a server), the text and
the logprobs with them, one final message with the finish reason and the token counts; an
aborted or cancelled request frees its blocks. OutputStream's merging is checked alone too."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from contracts.errors import Unavailable
from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

from .test_grpc_paths import ServerThread

PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park.",
    "One day, a little dog named Max",
    [1, 400, 401, 402, 403, 404],
]
MAX_TOKENS = 40
SEND_INTERVAL_S = 0.05  # a handler that sends at most this often falls behind the engine's steps


@pytest.fixture(scope="module")
def server():
    from contracts.sampling_params import SamplingParams
    from contracts.service_config import SchedulerSection
    from scheduler_svc import LLM
    from scheduler_svc.engine_client import EngineClient
    from scheduler_svc.server import SERVICE_NAME, SchedulerServicer

    llm = LLM(num_gpu_blocks=64, device="cpu")
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    reference = [llm.generate([p], greedy)[0] for p in PROMPTS]  # before the engine loop takes the engine
    engine = llm.engine
    engine.deadlines, engine.unavailable = {}, None  # what the engine loop reads of a ServiceEngine
    servicer = SchedulerServicer(SchedulerSection())
    servicer.send_interval_s = SEND_INTERVAL_S
    servicer.llm = EngineClient.in_thread(engine)
    srv = ServerThread([(pb_grpc.add_SchedulerServiceServicer_to_server, servicer, SERVICE_NAME)])
    yield srv, engine, reference
    asyncio.run_coroutine_threadsafe(servicer.llm.shutdown(), srv.loop).result(30)
    srv.stop()


def _stream_all(address: str, prompts: list, **sampling) -> list[list]:
    """Every prompt streamed at once; the messages of each."""
    from scheduler_svc.client import Client

    results: list[list] = [[] for _ in prompts]

    def one(i: int) -> None:
        with Client(address, timeout=60) as c:
            results[i] = list(c.generate(prompts[i], **sampling))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return results


def _wait_blocks_free(engine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not (engine.kv.all_free_or_cached() and not engine.has_unfinished()):
        assert time.monotonic() < deadline, "blocks not freed"
        time.sleep(0.02)
    engine.kv.check_invariants()


def test_coalesced_messages_carry_every_token_in_order(server):
    srv, engine, reference = server
    streams = _stream_all(srv.address, PROMPTS, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    for msgs, ref in zip(streams, reference):
        ids = [t for m in msgs for t in m.token_ids]
        assert ids == ref.token_ids  # in order, none lost or repeated
        assert "".join(m.text for m in msgs) == ref.text
        assert [lp.token_id for m in msgs for lp in m.logprobs] == ids
        assert max(len(m.token_ids) for m in msgs) > 1, [len(m.token_ids) for m in msgs]  # coalesced
        assert len(msgs) < MAX_TOKENS
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("usage") for m in msgs[:-1])
        last = msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ref.prompt_token_ids), MAX_TOKENS)
    _wait_blocks_free(engine)


def test_stop_string_under_coalescing(server):
    srv, _, reference = server
    stop = reference[0].text[10:14]  # a few characters into the greedy text
    (msgs,) = _stream_all(srv.address, PROMPTS[:1], temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop])
    assert "".join(m.text for m in msgs) == reference[0].text[: reference[0].text.index(stop)]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP and msgs[-1].stop_string == stop
    assert msgs[-1].usage.completion_tokens == sum(len(m.token_ids) for m in msgs)


def test_abort_and_cancel_free_blocks_under_coalescing(server):
    from scheduler_svc.client import Client

    srv, engine, reference = server
    with Client(srv.address, timeout=60) as c:
        stream = c.generate(PROMPTS[0], request_id="to-abort", temperature=0.0, max_tokens=400, ignore_eos=True)
        first = next(stream)
        c.abort("to-abort")
        rest = list(stream)
        cancelled = c.generate(PROMPTS[1], temperature=0.0, max_tokens=400, ignore_eos=True)
        got = next(cancelled).token_ids
        cancelled.close()  # the client goes away mid-stream (the call is cancelled)
    ids = [t for m in [first, *rest] for t in m.token_ids]
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and rest[-1].usage.completion_tokens == len(ids) < 400
    n, m = min(len(ids), MAX_TOKENS), min(len(got), MAX_TOKENS)
    assert ids[:n] == reference[0].token_ids[:n] and list(got)[:m] == reference[1].token_ids[:m]
    _wait_blocks_free(engine)


# ----------------------------------------------------------------- OutputStream alone
def test_output_stream_merges_deltas_until_taken():
    from scheduler_svc.engine_client import OutputStream

    async def main() -> None:
        s = OutputStream()
        s.put(("r", [1, 2], "ab", None))
        s.put(("r", [3], "c", None))
        assert await s.take() == ([1, 2, 3], "abc", None, None)
        waiter = asyncio.ensure_future(s.take())
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing new: it waits
        s.put(("r", [4], "", [(4, -0.5, [])]))
        final = ("r", [5], "e", [(5, -0.1, [(6, -2.0)])], "length", None, 3, 5, 0, None)
        s.put(final)
        assert await waiter == ([4, 5], "e", [(4, -0.5, []), (5, -0.1, [(6, -2.0)])], final)
        failing = OutputStream()
        failing.put(("r", [1], "a", None))
        failing.fail(Unavailable("peer down"))
        with pytest.raises(Unavailable):
            await failing.take()

    asyncio.run(main())


def test_output_stream_merges_each_completion_of_n():
    from scheduler_svc.engine_client import OutputStream

    async def main() -> None:
        s = OutputStream()
        s.put(("r", [1], "a", None, 1, None, None))
        s.put(("r", [7], "x", None, 0, None, None))
        s.put(("r", [2], "b", [(2, -0.3, [])], 1, "stop", "b"))
        assert await s.take_completions() == (
            [(0, [7], "x", None, None, None), (1, [1, 2], "ab", [(2, -0.3, [])], "stop", "b")],
            None,
        )
        s.put(("r", [8], "y", None, 0, "length", None))
        final = ("r", [], "", None, "length", None, 3, 4, 0, None)
        s.put(final)
        assert await s.take_completions() == ([(0, [8], "y", None, "length", None)], final)

    asyncio.run(main())
