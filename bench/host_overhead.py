"""Host (Python) time per engine step on the headline workload, with the model's math removed.

The real scheduler, KV-cache manager, runner batch building and sampler run; the model is a
stub whose forward costs nothing, so what is measured is the per-step host overhead that the
GPU would otherwise wait on. Runs on the CPU.

    python bench/host_overhead.py --num-seqs 256 --max-len 1024
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import QWEN3_0_6B  # noqa: E402
from bench.throughput import make_workload  # noqa: E402


class StubModel(torch.nn.Module):
    """Shapes of the real model, no arithmetic: hidden states of zeros, random logits."""

    def __init__(self, config, vocab: int = 64) -> None:
        super().__init__()
        self.config = config
        self.vocab = vocab
        self.logits = torch.randn(512, vocab)

    def forward(self, input_ids, positions, kv_caches, attn):
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host's Python is what is measured, not CPU math threads

    from model_svc.config import ModelConfig
    from model_svc.runner import ModelRunner
    from scheduler_svc.config import EngineConfig
    from scheduler_svc.engine import LLMEngine
    from scheduler_svc.llm import LLM

    path = Path(tempfile.mkdtemp(prefix="picovllm-stub-"))
    small = dict(QWEN3_0_6B, num_hidden_layers=1, num_key_value_heads=1, head_dim=8)
    (path / "config.json").write_text(json.dumps(small))
    config = ModelConfig.from_pretrained(path)
    runner = ModelRunner(str(path), device="cpu", num_device_blocks=20000, model=StubModel(config))
    engine = LLMEngine(
        EngineConfig(model=str(path), device="cpu", skip_tokenizer_init=True, max_num_batched_tokens=16384),
        model=runner,
    )
    llm = LLM.from_engine(engine)
    prompts, params = make_workload(args.num_seqs, args.max_len, args.max_len)
    prof = cProfile.Profile() if args.profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    outs = llm.generate(prompts, params)
    if prof:
        prof.disable()
    seconds = time.perf_counter() - t
    steps = engine.scheduler.stats.num_steps
    n = sum(len(o.token_ids) for o in outs)
    print(f"{n} tokens, {steps} steps, {seconds:.2f} s: host overhead {seconds / steps * 1e3:.2f} ms/step")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
