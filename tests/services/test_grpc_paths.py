"""The gRPC hot paths in one process (servers on a background event loop, no subprocesses):
ApplyStep's answer checked on the wire form by the transport's sender thread (and decoded
only when it differs), its retries, and the model servicer's launch/readback threads
(arrival order, errors mapped to the domain errors, a step in flight while the next is
launched)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from contracts.errors import InvalidArgument, Unavailable
from contracts.rpc import start_server
from contracts.service_config import ModelSection
from contracts.step import SampledToken, SeqStep, StepInput, StepOutput
from kvcache_svc import client as kv_client
from kvcache_svc.client import GrpcTransport, KVClient, KVOutOfSync
from kvcache_svc.ops import AllocateOp
from kvcache_svc.server import SERVICE_NAME as KV_SERVICE_NAME
from kvcache_svc.server import KVCacheServicer
from kvcache_svc.service import KVCacheService
from kvcache_svc.store import MemoryStore
from model_svc.client import ModelRestarted, RemoteModel
from model_svc.server import SERVICE_NAME as MODEL_SERVICE_NAME
from model_svc.server import ModelService, ModelServicer
from protos.picovllm.kvcache.v1 import kvcache_pb2_grpc
from protos.picovllm.model.v1 import model_pb2_grpc

from .test_kv_transport import BS, CONFIG, assert_same, drive


class ServerThread:
    """start_server() on an event loop of its own thread, on a free loopback port."""

    def __init__(self, services) -> None:
        self.services = services
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(20), "server did not start"
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            try:
                running = await start_server("127.0.0.1:0", self.services)
                await running.set_serving(True)
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                self.error = exc
                self.ready.set()
                return
            self.address = f"127.0.0.1:{running.port}"
            self.stopping = asyncio.Event()
            self.ready.set()
            await self.stopping.wait()
            await running.server.stop(None)

        self.loop.run_until_complete(main())
        self.loop.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(20)


# ----------------------------------------------------------------- KV-cache: ApplyStep
@pytest.fixture
def kv_server():
    service = KVCacheService(MemoryStore())
    service.load()
    server = ServerThread(
        [(kvcache_pb2_grpc.add_KVCacheServiceServicer_to_server, KVCacheServicer(service), KV_SERVICE_NAME)]
    )
    yield server.address, service
    server.stop()


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    """Counts the ApplyStep answers the transport decoded (those not found equal on the wire)."""
    calls: list[int] = []
    real = kv_client._results

    def counting(raw: bytes):
        results = real(raw)
        calls.append(len(results))
        return results

    monkeypatch.setattr(kv_client, "_results", counting)
    return calls


def connect(address: str, retry_window_s: float = 1.0) -> KVClient:
    client = KVClient(GrpcTransport(address), retry_window_s=retry_window_s, rpc_timeout_s=5.0)
    assert client.connect(CONFIG) is False
    client.commit()
    return client


def drive_overlapped(client: KVClient, steps: int, seed: int) -> None:
    """test_kv_transport's scheduler run, each step committed as the engine does (start_commit,
    then the wait)."""
    drive(client, steps, seed, "swap", commit=lambda: client.start_commit()())


def test_answers_equal_on_the_wire_are_not_decoded(kv_server, decodes):
    address, service = kv_server
    client = connect(address)
    try:
        decodes.clear()
        drive_overlapped(client, 120, seed=5)
        assert decodes == []  # every answer matched its expected bytes
        assert client.num_commits == service.step
        assert_same(client, service)
        assert client.all_free_or_cached()
    finally:
        client.transport.close()


def test_answer_that_differs_is_decoded_and_resynced(kv_server, decodes):
    address, service = kv_server
    client = connect(address)
    try:
        client.allocate("a", list(range(2 * BS)), 2 * BS)
        client.start_commit()()
        # Behind the client's back: the service's next answers differ from the local ones.
        service.apply_step(service.step + 1, [AllocateOp("intruder", [1, 2, 3], 3)])
        client.allocate("b", list(range(50, 50 + BS)), BS)
        wait = client.start_commit()
        decodes.clear()
        with pytest.raises(KVOutOfSync):
            wait()
        assert len(decodes) == 1  # the mismatch was looked at in full, not trusted from the bytes
        # The batch had been acted on unconfirmed: the pools were reset, not adopted.
        assert not client.seqs and "intruder" not in client.seqs
        client.start_commit()()
        assert_same(client, service)
    finally:
        client.transport.close()


def test_first_attempt_that_fails_is_retried_with_its_request(kv_server, decodes, monkeypatch):
    address, service = kv_server
    client = connect(address)
    real = service.apply_step
    failures = [2]

    def flaky(step, ops):
        if failures[0]:
            failures[0] -= 1
            raise Unavailable("store write failed")
        return real(step, ops)

    monkeypatch.setattr(service, "apply_step", flaky)
    try:
        client.allocate("a", list(range(3 * BS)), 3 * BS)
        decodes.clear()
        client.start_commit()()  # the sender thread's attempt fails; the wait retries and succeeds
        assert failures == [0] and len(decodes) == 1
        assert not client.has_pending()
        assert_same(client, service)
    finally:
        client.transport.close()


# ----------------------------------------------------------------- model: Step
class FakeRunner:
    """Samples 100 + position; `block` holds the readback of the step that feeds seq_id
    "slow" until released; `fail_launch` / `fail_result` raise in the named phase."""

    block_size, num_device_blocks, num_host_blocks, device, dtype = 4, 64, 16, "cpu", "float32"
    kv_group_windows = (0,)

    def __init__(self) -> None:
        from contracts.model_info import ModelFacts

        self.config = ModelFacts("llama", 512, 512, (2,), 1)
        self.launched: list[list[str]] = []
        self.read: list[list[str]] = []
        self.release = threading.Event()
        self.fail_launch: Exception | None = None
        self.fail_result: Exception | None = None

    def launch(self, inp: StepInput):
        if self.fail_launch is not None:
            raise self.fail_launch
        ids = [s.seq_id for s in inp.seqs]
        self.launched.append(ids)
        runner = self

        class Launched:
            def result(self) -> StepOutput:
                if "slow" in ids:
                    assert runner.release.wait(10)
                if runner.fail_result is not None:
                    raise runner.fail_result
                runner.read.append(ids)
                return StepOutput(
                    [SampledToken(s.seq_id, 100 + s.start_pos + len(s.token_ids)) for s in inp.seqs if s.sample]
                )

        return Launched()


@pytest.fixture
def model_server():
    from concurrent.futures import ThreadPoolExecutor

    runner = FakeRunner()
    service = ModelService(ModelSection(), runner=runner)
    servicer = ModelServicer(service, ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner"))
    server = ServerThread([(model_pb2_grpc.add_ModelServiceServicer_to_server, servicer, MODEL_SERVICE_NAME)])
    model = RemoteModel(server.address, rpc_timeout_s=10.0, retry_window_s=0.2)
    model.connect(5.0)
    yield model, service, runner
    model.close()
    server.stop()


def step_of(*seq_ids: str) -> StepInput:
    return StepInput([SeqStep(s, [7], 10, True) for s in seq_ids])


def test_model_step_round_trip(model_server):
    model, _, runner = model_server
    out = model.step(step_of("a", "b"))
    assert out.sampled == [SampledToken("a", 111), SampledToken("b", 111)]
    assert model.step(StepInput()).sampled == []  # an empty step does no model work
    assert runner.launched == [["a", "b"], []]


def test_model_step_errors_map_to_domain_errors(model_server):
    model, service, runner = model_server
    runner.fail_launch = ValueError("bad step")
    with pytest.raises(InvalidArgument, match="bad step"):
        model.step(step_of("a"))
    runner.fail_launch = None
    runner.fail_result = RuntimeError("device fault")
    with pytest.raises(RuntimeError, match="INTERNAL"):
        model.step(step_of("a"))
    runner.fail_result = None
    service.epoch = "another"  # the service restarted: the step is refused without running
    launched = len(runner.launched)
    with pytest.raises(ModelRestarted):
        model.step(step_of("a"))
    assert len(runner.launched) == launched
    model.connect(1.0)
    assert model.step(step_of("a")).sampled == [SampledToken("a", 111)]


def test_next_step_is_launched_while_the_last_is_read_back(model_server):
    """Pipelined use: step k+1 arrives while step k waits in its readback; k+1 is launched
    meanwhile, and the answers come back in order."""
    from concurrent.futures import ThreadPoolExecutor

    model, _, runner = model_server
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(model.step, step_of("slow"))
        deadline = time.monotonic() + 10
        while runner.launched != [["slow"]] and time.monotonic() < deadline:
            time.sleep(0.005)
        second = pool.submit(model.step, step_of("next"))
        while runner.launched != [["slow"], ["next"]] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert runner.launched == [["slow"], ["next"]] and runner.read == []  # launched while "slow" is read back
        runner.release.set()
        assert first.result(10).sampled == [SampledToken("slow", 111)]
        assert second.result(10).sampled == [SampledToken("next", 111)]
    assert runner.read == [["slow"], ["next"]]


# ----------------------------------------------------------------- pipelined engine: KV overlap
def test_pipelined_engine_sends_each_kv_batch_without_waiting():
    """Step k+1's block ops are recorded before step k's ApplyStep answer is awaited: waiting
    for k must not send them in a blocking call; they go out (overlapped) with k+1's launch."""
    from tests.services.inprocess_kv import InProcessTransport

    from .test_remote_engine import ScriptedModel, assert_clean, make_engine, run

    class CountingTransport(InProcessTransport):
        def __init__(self, service) -> None:
            super().__init__(service)
            self.started = self.blocking = 0

        def start_apply_step(self, step, ops, timeout, expected=None):
            self.started += 1
            return lambda retry_until: InProcessTransport.apply_step(self, step, ops, retry_until, timeout)

        def apply_step(self, step, ops, retry_until, timeout):
            self.blocking += 1
            return super().apply_step(step, ops, retry_until, timeout)

    engine, service = make_engine(ScriptedModel(), pipelined=True)
    engine.kv.transport = transport = CountingTransport(service)
    run(engine)
    assert engine.num_steps >= 20 and transport.started >= engine.num_steps
    assert transport.blocking <= 2  # the flushes of steps that launch nothing (the last frees)
    assert_clean(service)
