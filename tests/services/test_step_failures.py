"""Failure containment in service mode without processes: a model step that fails for one
sequence (the model service names it in its status) ends that request only, the others
recompute to the undisturbed tokens; a model service that comes back with a smaller pool
gives the scheduler its new max_model_len, and a request that no longer fits fails alone
with OUT_OF_RANGE. Over gRPC (an in-process scheduler server on the embedded engine), the
request whose processing fails gets INTERNAL and the ones beside it complete."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from contracts.errors import OutOfRange, RequestFailed, SequenceFailed
from contracts.sampling_params import SamplingParams
from protos.picovllm.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

from .test_grpc_paths import ServerThread
from .test_remote_engine import PARAMS, PROMPTS, ScriptedModel, assert_clean, make_engine, run


class FailingModel(ScriptedModel):
    """Fails the first step that feeds `victim` past position `at`, naming it as the model
    service's status does (the client raises it as an INTERNAL RuntimeError)."""

    def __init__(self, victim: str, at: int) -> None:
        super().__init__()
        self.victim, self.at, self.failed = victim, at, 0

    def step(self, inp, timeout=None):
        if not self.failed and any(s.seq_id == self.victim and s.start_pos >= self.at for s in inp.seqs):
            self.failed += 1
            raise RuntimeError(f"model 127.0.0.1:1 Step: INTERNAL: {SequenceFailed(self.victim, 'injected')}")
        return super().step(inp, timeout)


@pytest.fixture
def reference() -> dict[str, list[int]]:
    engine, service = make_engine(ScriptedModel())
    out = run(engine)
    assert_clean(service)
    return out


def run_outputs(engine, max_steps: int = 500) -> dict:
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, PARAMS, request_id=f"r{i}")
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished()
    return done


@pytest.mark.parametrize("pipelined", [False, True])
def test_sequence_named_by_the_model_service_fails_alone(reference, pipelined):
    model = FailingModel("r1", at=12)
    engine, service = make_engine(model, pipelined=pipelined)
    done = run_outputs(engine)
    assert model.failed == 1
    assert isinstance(done["r1"].error, RequestFailed) and done["r1"].finish_reason == "abort"
    assert {k: v.token_ids for k, v in done.items() if k != "r1"} == {k: v for k, v in reference.items() if k != "r1"}
    assert_clean(service)


class ShrinkingModel(ScriptedModel):
    """restart() comes back with `num_blocks` device blocks."""

    num_blocks = 64

    def _info(self):
        info = super()._info()
        return type(info)(
            info.epoch,
            info.model,
            info.block_size,
            self.num_blocks,
            info.num_host_blocks,
            info.device,
            info.dtype,
            info.config,
        )


@pytest.mark.parametrize("pipelined", [False, True])
def test_restart_with_a_smaller_pool_refreshes_max_model_len(pipelined):
    model = ShrinkingModel()
    engine, service = make_engine(model, pipelined=pipelined)
    assert engine.max_model_len == 256  # 64 blocks of 4
    long_params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request(list(range(1, 21)), long_params, request_id="long")  # 20 tokens, outgrows 8 blocks
    engine.add_request([1, 20, 21], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), request_id="short")
    done, restarted = {}, False
    for _ in range(500):
        if not engine.has_unfinished():
            break
        if not restarted and len(engine.requests["long"].token_ids) >= 36:
            model.num_blocks, restarted = 8, True  # 32 tokens
            model.restart()
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert restarted and not engine.has_unfinished()
    assert engine.max_model_len == 32 and engine.scheduler.config.max_model_len == 32
    assert isinstance(done["long"].error, OutOfRange)
    assert done["short"].error is None and done["short"].finish_reason == "length"
    assert len(done["short"].prompt_token_ids) + len(done["short"].token_ids) == 32  # ended at the new limit
    with pytest.raises(ValueError, match="max_model_len 32"):
        engine.add_request(list(range(1, 40)), PARAMS)
    assert_clean(service)


# ----------------------------------------------------------------- over gRPC
@pytest.fixture(scope="module")
def scheduler_server():
    from contracts.service_config import SchedulerSection
    from scheduler_svc import LLM
    from scheduler_svc.engine_client import EngineClient
    from scheduler_svc.server import SERVICE_NAME, SchedulerServicer

    engine = LLM(num_gpu_blocks=64, device="cpu").engine
    engine.deadlines, engine.unavailable = {}, None  # what the engine loop reads of a ServiceEngine
    servicer = SchedulerServicer(SchedulerSection())
    servicer.llm = EngineClient.in_thread(engine)  # the engine loop in a thread here: the tests patch the engine
    server = ServerThread([(pb_grpc.add_SchedulerServiceServicer_to_server, servicer, SERVICE_NAME)])
    yield server, engine
    asyncio.run_coroutine_threadsafe(servicer.llm.shutdown(), server.loop).result(30)
    server.stop()


def test_request_failing_in_its_step_gets_internal_and_the_others_complete(scheduler_server, monkeypatch):
    from scheduler_svc.client import Client

    server, engine = scheduler_server
    prompts = ["Once upon a time", "Lily and Tom went to the park.", "One day, a little dog named Max"]
    greedy = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    with Client(server.address, timeout=60) as c:
        expected = [c.complete(p, **greedy)[1] for p in prompts]
    check_stop = engine._check_stop

    def failing(req):
        if req.request_id == "victim" and req.num_output_tokens == 5:
            raise RuntimeError("injected")
        check_stop(req)

    monkeypatch.setattr(engine, "_check_stop", failing)
    results: dict[str, object] = {}

    def one(request_id: str, prompt: str) -> None:
        with Client(server.address, timeout=60) as c:
            try:
                results[request_id] = c.complete(prompt, request_id=request_id, **greedy)[1]
            except grpc.RpcError as err:
                results[request_id] = err.code()

    threads = [threading.Thread(target=one, args=(f"n{i}", p)) for i, p in enumerate(prompts)]
    threads.append(threading.Thread(target=one, args=("victim", "The sun was")))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["victim"] == grpc.StatusCode.INTERNAL
    assert [results[f"n{i}"] for i in range(len(prompts))] == expected
    engine.kv.check_invariants()


def test_abort_while_the_prompt_is_tokenized_ends_the_stream(scheduler_server, monkeypatch):
    """Tokenizing happens before the engine knows the request: an Abort then still ends it."""
    import time

    from protos.picovllm.scheduler.v1 import scheduler_pb2 as pb
    from scheduler_svc.client import Client

    server, engine = scheduler_server
    tokenize = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda text: (time.sleep(0.5), tokenize(text))[1])
    with Client(server.address, timeout=30) as c:
        stream = c.generate("Once upon a time", request_id="early", temperature=0.0, max_tokens=50)
        aborter = threading.Timer(0.2, c.abort, args=("early",))
        aborter.start()
        messages = list(stream)
        aborter.join()
    assert [m.finish_reason for m in messages] == [pb.FINISH_REASON_ABORT] and not messages[0].token_ids
    assert "early" not in engine.requests
