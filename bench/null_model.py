"""A model service without a model, for measuring what the scheduler side costs on a machine
without a GPU: it answers the model service's API (same servicer, same wire format, same
internal token) with made-up tokens after a fixed device time per step.

    python -m bench.null_model --model-addr 127.0.0.1:50053 --model DIR --step-ms 0

Steps are serial on the emulated device (step k ends `--step-ms` after the later of its launch
and the end of step k-1), as a GPU runs them; the tokens are a function of the sequence and
position, never an end-of-sequence id, so a workload with ignore_eos runs to its lengths.
`NullRunner` also serves as the model of an embedded engine (bench/serve.py --null-model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts.model_info import ModelFacts  # noqa: E402
from contracts.step import SampledToken, StepInput, StepOutput  # noqa: E402


def model_config(model_dir: str) -> ModelFacts:
    c = json.loads(Path(model_dir, "config.json").read_text())
    eos = c.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelFacts(
        c.get("model_type", "llama"),
        c["vocab_size"],
        c.get("max_position_embeddings", 4096),
        eos,
        c.get("bos_token_id"),
    )


class NullRunner:
    """The model runner's interface (launch / step) over an emulated device."""

    dtype = "float32"

    def __init__(
        self,
        model_dir: str,
        step_ms: float,
        num_device_blocks: int = 8192,
        num_host_blocks: int = 0,
        block_size: int = 16,
        device: str = "cpu",
    ) -> None:
        self.config = model_config(model_dir)
        self.step_s = step_ms / 1e3
        self.num_device_blocks, self.num_host_blocks, self.block_size, self.device = (
            num_device_blocks,
            num_host_blocks,
            block_size,
            device,
        )
        self.kv_group_windows = (0,)  # one full-attention KV group
        self._free_at = 0.0  # when the emulated device is done with what is queued
        self._lock = threading.Lock()
        self._banned = set(self.config.eos_token_ids)

    def _token(self, seq_id: str, pos: int) -> int:
        vocab = self.config.vocab_size
        token = (zlib.crc32(seq_id.encode()) + 7919 * pos) % (vocab - 3) + 3
        return token if token not in self._banned else 3

    def launch(self, inp: StepInput):
        with self._lock:
            done_at = self._free_at = max(time.monotonic(), self._free_at) + self.step_s
        out = StepOutput(
            [
                SampledToken(s.seq_id, self._token(s.seq_id, s.start_pos + len(s.token_ids)))
                for s in inp.seqs
                if s.sample
            ]
        )
        return _Launched(done_at, out)

    def step(self, inp: StepInput) -> StepOutput:
        return self.launch(inp).result()


class _Launched:
    def __init__(self, done_at: float, out: StepOutput) -> None:
        self.done_at, self.out = done_at, out

    def done(self) -> bool:
        return time.monotonic() >= self.done_at

    def result(self) -> StepOutput:
        wait = self.done_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return self.out


async def serve(address: str, runner: NullRunner, max_num_seqs: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from contracts.auth import INTERNAL_TOKEN_ENV, read_secret
    from contracts.rpc import announce, start_server, stop_event
    from contracts.service_config import ModelSection
    from model_svc.server import SERVICE_NAME, ModelService, ModelServicer
    from protos.picovllm.model.v1 import model_pb2_grpc as pb_grpc

    service = ModelService(ModelSection(address=address, model="null"), max_num_seqs, runner=runner)
    servicer = ModelServicer(service, ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-runner"))
    running = await start_server(
        address,
        [(pb_grpc.add_ModelServiceServicer_to_server, servicer, SERVICE_NAME)],
        auth_token=read_secret(INTERNAL_TOKEN_ENV),
    )
    await running.set_serving(True)
    announce(f"null model service ready: gRPC {running.address} ({runner.step_s * 1e3:g} ms a step)")
    await stop_event().wait()
    await running.server.stop(grace=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-addr", required=True, help="address to listen on")
    p.add_argument(
        "--model", required=True, help="a model directory (its config.json: vocabulary, end-of-sequence ids)"
    )
    p.add_argument("--step-ms", type=float, default=0.0, help="emulated device time of one step (default: 0)")
    p.add_argument("--num-gpu-blocks", type=int, default=8192, help="device KV blocks (default: 8192)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the scheduler's batch limit (default: 256)")
    args = p.parse_args()
    asyncio.run(serve(args.model_addr, NullRunner(args.model, args.step_ms, args.num_gpu_blocks), args.max_num_seqs))


if __name__ == "__main__":
    main()
