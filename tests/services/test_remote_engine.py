"""ServiceEngine's failure handling without processes: a scripted model client and an
in-process KV-cache service. Deadlines reach the internal calls; a model that is down, one
that restarted, and a KV service that lost its state all end with the outputs of an
undisturbed run and every block free."""

from __future__ import annotations

import time
import zlib
from concurrent.futures import Future

import pytest

from contracts.model_info import ModelFacts, ModelInfo
from contracts.sampling_params import SamplingParams
from contracts.service_config import BUNDLED_MODEL
from contracts.step import SampledToken, StepInput, StepOutput
from kvcache_svc.client import KVClient, KVUnavailable
from kvcache_svc.ops import AllocateOp
from kvcache_svc.service import KVCacheService
from kvcache_svc.store import MemoryStore
from model_svc.client import ModelRestarted, ModelUnavailable
from scheduler_svc.config import EngineConfig
from scheduler_svc.remote_engine import ServiceEngine, pool_config
from tests.services.inprocess_kv import InProcessTransport


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 500 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class ScriptedModel:
    """Next token = a function of the sequence and the position (so a recompute gives the
    same tokens); `down` steps raise ModelUnavailable; `restart()` makes a new epoch."""

    def __init__(self) -> None:
        self.epoch_n = 1
        self.down = 0
        self.timeouts: list[float | None] = []
        self.retry_window_s = 0.01
        self.info = self._info()
        self.known: set[str] = set()

    def _info(self) -> ModelInfo:
        return ModelInfo(
            f"e{self.epoch_n}",
            BUNDLED_MODEL,
            4,
            64,
            16,
            "cpu",
            "float32",
            ModelFacts("llama", 512, 512, (2,), 1),
        )

    config = property(lambda self: self.info.config)
    num_device_blocks = property(lambda self: self.info.num_device_blocks)
    num_host_blocks = property(lambda self: self.info.num_host_blocks)
    kv_group_windows = property(lambda self: self.info.kv_group_windows)

    def restart(self) -> None:
        self.epoch_n += 1
        self.known.clear()

    def connect(self, timeout_s: float) -> ModelInfo:
        if self.down:
            raise ModelUnavailable("down")
        self.info = self._info()
        return self.info

    def step(self, inp: StepInput, timeout: float | None = None) -> StepOutput:
        self.timeouts.append(timeout)
        if self.down:
            self.down -= 1
            raise ModelUnavailable("model is down")
        if self.info.epoch != f"e{self.epoch_n}":
            raise ModelRestarted("new epoch")
        for s in inp.seqs:
            assert s.sampling is not None or s.seq_id in self.known, f"{s.seq_id}: first step without sampling params"
            self.known.add(s.seq_id)
        return StepOutput(
            [
                SampledToken(s.seq_id, 3 + (zlib.crc32(s.seq_id.encode()) + s.start_pos + len(s.token_ids)) % 500)
                for s in inp.seqs
                if s.sample
            ]
        )

    def launch(self, inp: StepInput, timeout: float | None = None) -> Future:
        """The pipelined engine's call: answered (or failed) at once."""
        answer: Future = Future()
        try:
            answer.set_result(self.step(inp, timeout))
        except Exception as exc:  # noqa: BLE001 - the step's failure, raised by result()
            answer.set_exception(exc)
        return answer


def make_engine(model: ScriptedModel, pipelined: bool = False) -> tuple[ServiceEngine, KVCacheService]:
    service = KVCacheService(MemoryStore())
    service.load()
    kv = KVClient(InProcessTransport(service))
    kv.connect(pool_config(model, True))
    kv.commit()
    config = EngineConfig(
        block_size=4, num_gpu_blocks=64, max_num_batched_tokens=32, async_scheduling=pipelined or None
    )
    return ServiceEngine(config, model, kv, FakeTokenizer()), service


PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 8, 10, 11, 12, 13], [1, 20, 21]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def run(engine: ServiceEngine, disturb=None, max_steps: int = 500) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, PARAMS, request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    for n in range(max_steps):
        if not engine.has_unfinished():
            break
        if disturb:
            disturb(n)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert not engine.has_unfinished()
    return done


def assert_clean(service: KVCacheService) -> None:
    service.manager.check_invariants()
    assert service.manager.all_free_or_cached()


@pytest.fixture
def reference() -> dict[str, list[int]]:
    engine, service = make_engine(ScriptedModel())
    out = run(engine)
    assert_clean(service)
    assert all(len(ids) == 20 for ids in out.values())
    return out


def test_client_deadline_reaches_the_model_call():
    model = ScriptedModel()
    engine, _ = make_engine(model)
    engine.add_request(PROMPTS[0], PARAMS, request_id="r0")
    engine.deadlines["r0"] = time.monotonic() + 5.0
    engine.step()
    assert 4.0 < model.timeouts[-1] <= 5.0
    engine.add_request(PROMPTS[1], PARAMS, request_id="r1")  # no deadline: the default applies
    engine.step()
    assert model.timeouts[-1] is None


def test_model_down_then_back_resumes_the_same_step(reference):
    model = ScriptedModel()
    engine, service = make_engine(model)
    seen = []

    def disturb(n: int) -> None:
        if n == 5:
            model.down = 3
        seen.append(engine.unavailable)

    assert run(engine, disturb) == reference
    assert any(seen) and engine.unavailable is None
    assert engine.num_recoveries == 0  # same epoch: nothing recomputed
    assert_clean(service)


def test_model_restart_recomputes_with_the_same_tokens(reference):
    model = ScriptedModel()
    engine, service = make_engine(model)
    run_out = run(engine, lambda n: model.restart() if n in (4, 11) else None)
    assert run_out == reference
    assert engine.num_recoveries == 2
    assert service.config.epoch == "e3"  # the pools were reset for each new epoch
    assert_clean(service)


def test_kv_service_that_lost_its_state_is_resynced(reference):
    model = ScriptedModel()
    engine, service = make_engine(model)
    fresh = KVCacheService(MemoryStore())
    fresh.load()

    def disturb(n: int) -> None:
        if n == 6:
            engine.kv.transport = InProcessTransport(fresh)  # a restart without Redis

    assert run(engine, disturb) == reference
    assert engine.num_recoveries == 1
    assert_clean(fresh)


def test_abort_while_the_model_is_down_frees_blocks(reference):
    model = ScriptedModel()
    engine, service = make_engine(model)

    aborted = []

    def disturb(n: int) -> None:
        if n == 3:
            model.down = 2
        if n == 4:
            aborted.append(engine.abort("r1"))

    out = run(engine, disturb)
    assert out == {"r0": reference["r0"], "r2": reference["r2"]}
    assert aborted[0].finish_reason == "abort" and len(aborted[0].token_ids) < 20
    assert_clean(service)


class FlakyTransport(InProcessTransport):
    """ApplyStep fails (KVUnavailable) while `down` > 0."""

    def __init__(self, service: KVCacheService) -> None:
        super().__init__(service)
        self.down = 0

    def apply_step(self, step, ops, retry_until, timeout):
        if self.down:
            self.down -= 1
            raise KVUnavailable("kvcache is down")
        return super().apply_step(step, ops, retry_until, timeout)


def test_kv_down_after_the_model_answered_keeps_the_answer(reference):
    """ApplyStep is answered after the model step: a KV service that is down then keeps the
    model's answer with the step, and the model is not asked twice."""
    undisturbed = ScriptedModel()
    run(make_engine(undisturbed)[0])
    model = ScriptedModel()
    engine, service = make_engine(model)
    engine.kv.transport = flaky = FlakyTransport(service)

    def disturb(n: int) -> None:
        if n == 5:
            flaky.down = 3

    assert run(engine, disturb) == reference
    assert len(model.timeouts) == len(undisturbed.timeouts)  # one model call per step, none repeated
    assert engine.num_recoveries == 0
    assert_clean(service)


def test_mismatch_after_the_model_ran_resets_instead_of_adopting(reference):
    """The model has written the step's blocks before the service's answer showed a
    mismatch: the service's cached blocks may be stale, so the pools are reset."""
    model = ScriptedModel()
    engine, service = make_engine(model)

    managers = []

    def disturb(n: int) -> None:
        if n == 6:  # behind the client's back: the next answers differ from the local ones
            service.apply_step(service.step + 1, [AllocateOp("intruder", [1, 2, 3], 3)])
            managers.append(service.manager)

    assert run(engine, disturb) == reference
    assert engine.num_recoveries == 1
    assert service.manager is not managers[0]  # the pools were reset, not adopted
    assert_clean(service)


# ---- pipelined (async_scheduling): the model Step of step k+1 is sent while step k runs


@pytest.mark.parametrize(
    "disturbance", ["none", "model down", "model restart", "kv down", "kv lost state", "kv mismatch"]
)
def test_pipelined_engine_ends_with_the_undisturbed_tokens(reference, disturbance):
    model = ScriptedModel()
    engine, service = make_engine(model, pipelined=True)
    assert engine.pipelined
    check = service
    if disturbance == "model down":
        disturb = lambda n: setattr(model, "down", 3) if n == 5 else None  # noqa: E731
    elif disturbance == "model restart":
        disturb = lambda n: model.restart() if n in (4, 11) else None  # noqa: E731
    elif disturbance == "kv down":
        engine.kv.transport = flaky = FlakyTransport(service)
        disturb = lambda n: setattr(flaky, "down", 3) if n == 5 else None  # noqa: E731
    elif disturbance == "kv lost state":
        check = KVCacheService(MemoryStore())
        check.load()
        disturb = lambda n: setattr(engine.kv, "transport", InProcessTransport(check)) if n == 6 else None  # noqa: E731
    elif disturbance == "kv mismatch":
        disturb = lambda n: (  # noqa: E731
            service.apply_step(service.step + 1, [AllocateOp("intruder", [1, 2, 3], 3)]) if n == 6 else None
        )
    else:
        disturb = None
    assert run(engine, disturb) == reference
    if disturbance == "none":
        assert engine.num_recoveries == 0 and engine.num_steps >= 20
    assert engine.unavailable is None
    assert_clean(check)


def test_pipelined_engine_keeps_the_model_one_step_ahead():
    """While step k is read back, step k+1 is already with the model: the scripted model sees
    placeholder tokens for the tokens it is still sampling."""
    from contracts.step import PLACEHOLDER

    model = ScriptedModel()
    fed = []
    step = model.step
    model.step = lambda inp, timeout=None: (fed.append([t for s in inp.seqs for t in s.token_ids]), step(inp, timeout))[
        1
    ]
    engine, service = make_engine(model, pipelined=True)
    run(engine)
    assert any(PLACEHOLDER in tokens for tokens in fed)
    assert_clean(service)


def test_pipelined_abort_frees_blocks(reference):
    model = ScriptedModel()
    engine, service = make_engine(model, pipelined=True)
    aborted = []
    out = run(engine, lambda n: aborted.append(engine.abort("r1")) if n == 4 else None)
    assert out == {"r0": reference["r0"], "r2": reference["r2"]}
    assert aborted[0].finish_reason == "abort"
    assert_clean(service)
