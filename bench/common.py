"""Shared pieces of the benchmarks: the machine's ceilings, model configs, result files."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen3-0.6B's architecture (BENCHMARKS.md section 3), random bf16 weights.
QWEN3_0_6B = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)
# Qwen3-8B's architecture (an 8B-class shape for tensor parallelism, bench/tp.py), random bf16 weights.
QWEN3_8B = dict(
    QWEN3_0_6B,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
# A small config with the same shape of work, for trying a benchmark on the CPU.
TINY = dict(
    QWEN3_0_6B,
    vocab_size=10240,
    bos_token_id=1,
    eos_token_id=2,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    torch_dtype="float32",
)


def hybrid(config: dict, window: int) -> dict:
    """The config with every other layer sliding-window attention (window tokens), the
    hybrid layout of bench/hybrid.py."""
    layer_types = ["full_attention", "sliding_attention"] * (config["num_hidden_layers"] // 2)
    return dict(config, use_sliding_window=True, sliding_window=window, layer_types=layer_types)


CONFIGS = {
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-8b": QWEN3_8B,
    "tiny": TINY,
    "qwen3-0.6b-hybrid": hybrid(QWEN3_0_6B, 1024),
    "tiny-hybrid": hybrid(TINY, 32),
}
# The real Qwen2 tokenizer (151,936 ids; its README says where it comes from), for benchmarks
# that time what a user's model brings: detokenization of every generated token.
QWEN2_TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen2_tokenizer"


def add_tokenizer(model_dir: str | Path, tokenizer_dir: Path = QWEN2_TOKENIZER) -> None:
    """Copy a tokenizer's files (tokenizer.json, its config, the chat template) into a model directory."""
    import shutil

    for f in tokenizer_dir.iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, model_dir)


def model_dir_for(name_or_path: str) -> tuple[str, bool]:
    """A directory holding config.json: a local HF model, or a temp dir for a named config.
    Returns (path, random_weights)."""
    if name_or_path in CONFIGS:
        path = Path(tempfile.mkdtemp(prefix=f"picovllm-{name_or_path}-"))
        (path / "config.json").write_text(json.dumps(CONFIGS[name_or_path]))
        return str(path), True
    return name_or_path, False


def build_runner(model: str, device: str, dtype: str | None, **runner_kwargs):
    """A ModelRunner for a named config (random weights) or a local directory."""
    from model_svc.config import ModelConfig
    from model_svc.loader import build_random_model, resolve_dtype
    from model_svc.runner import ModelRunner
    from pico_kernels import select_ops

    path, random_weights = model_dir_for(model)
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    prebuilt = None
    if random_weights:
        config = ModelConfig.from_pretrained(path)
        prebuilt = build_random_model(
            config, torch_dtype, dev, ops=select_ops(dev, runner_kwargs.get("kernel_backend"))
        )
    runner = ModelRunner(path, device=dev, dtype=torch_dtype, model=prebuilt, **runner_kwargs)
    runner.model_path, runner.random_weights = path, random_weights  # for benches that reload it elsewhere
    return path, runner


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference in bf16 units in the last place of the reference (near zero, of
    2^-6), for comparing a kernel's output with another's."""
    eps = torch.finfo(torch.bfloat16).eps
    return ((out.float() - ref.float()).abs() / (eps * ref.float().abs().clamp(min=2**-6))).max().item()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of repeats."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    times.sort()
    return nbytes / times[len(times) // 2]


def matmul_flops(device: torch.device, n: int = 8192) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - t)


def environment() -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        # Absolute output paths (a scratch folder on the benchmark machine) read as the
        # repository place the result is committed to.
        "command": " ".join(
            ["python"] + [f"bench/results/{Path(a).name}" if a.startswith("/") else a for a in sys.argv]
        ),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "-"
    info["device"] = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    info["host"] = host_description()
    return info


def host_description() -> str:
    """The host CPU's model name and how fast it runs a fixed piece of Python (the engine's
    per-request work is Python: a run whose steps wait on the host moves with this figure
    from machine to machine)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs; Python probe {python_probe_us():.0f} us (lower is faster)"


def python_probe_us(repeats: int = 7) -> float:
    """Best of `repeats` timings of a fixed loop of attribute, dict and list work (the kind the
    scheduler and output processing do per request), in microseconds."""

    class Item:
        __slots__ = ("a", "b")

        def __init__(self, a: int) -> None:
            self.a, self.b = a, [a]

    best = float("inf")
    enabled = gc.isenabled()
    gc.disable()  # the collector's walks scale with the process's heap, not with the host
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            table: dict[int, Item] = {}
            for i in range(20000):
                item = Item(i)
                table[i] = item
                item.b.append(item.a + len(item.b))
            best = min(best, time.perf_counter() - start)
    finally:
        if enabled:
            gc.enable()
    return best * 1e6


def write_result(path: str, title: str, env: dict, body: str) -> None:
    header = [f"# {title}", "", *(f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()), "", ""]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(header) + body.rstrip() + "\n")


def make_llm(
    model: str,
    device: str,
    dtype: str | None = None,
    num_gpu_blocks: int | None = None,
    enforce_eager: bool = False,
    **engine_kwargs,
):
    """An LLM over a ModelRunner for a named config (random weights) or a local directory,
    with no tokenizer (token-id prompts). Returns (llm, runner)."""
    from model_svc.runner_factory import small_batch_pdl
    from scheduler_svc.config import EngineConfig, offline_batched_tokens
    from scheduler_svc.engine import LLMEngine
    from scheduler_svc.llm import LLM

    block_size = engine_kwargs.get("block_size", 16)
    engine_kwargs.setdefault("max_num_batched_tokens", offline_batched_tokens(device))  # as LLM() takes it
    path, runner = build_runner(
        model,
        device,
        dtype,
        block_size=block_size,
        num_device_blocks=num_gpu_blocks,
        enforce_eager=enforce_eager,
        small_batch_pdl=small_batch_pdl(engine_kwargs.get("async_scheduling")),
        max_num_seqs=engine_kwargs.get("max_num_seqs", 256),
        max_num_batched_tokens=engine_kwargs["max_num_batched_tokens"],
        num_host_blocks=engine_kwargs.pop("num_cpu_blocks", 0),
        kv_cache_dtype=engine_kwargs.get("kv_cache_dtype", "auto"),
    )
    config = EngineConfig(
        model=path, device=device, skip_tokenizer_init=True, enforce_eager=enforce_eager, **engine_kwargs
    )
    return LLM.from_engine(LLMEngine(config, model=runner)), runner


def add_overlap_flag(ap: argparse.ArgumentParser) -> None:
    """--overlap / --no-overlap: the engine's async_scheduling, None (the engine's default) unless given."""
    ap.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step k+1 while step k runs (async scheduling); default: the engine's (on for CUDA)",
    )


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def device_sync(device: str | torch.device):
    """A callable that waits for the device's queued work (a no-op off CUDA), for timing."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


class RunCounters:
    """What a run did besides the workload, for telling a slow run from a fast one: device and
    pinned-host allocator calls, allocator retries (each frees the cache: a device sync),
    Triton compiles and full garbage collections in this process."""

    def __init__(self) -> None:
        self.compiles = 0
        self.compiled: list[str] = []
        try:
            from triton import knobs

            previous = knobs.runtime.jit_post_compile_hook

            def hook(*args, **kwargs):
                self.compiles += 1
                self.compiled.append(str(kwargs.get("repr", "?"))[:160])
                return previous(*args, **kwargs) if previous else None

            knobs.runtime.jit_post_compile_hook = hook
        except Exception:  # noqa: BLE001 - no Triton, or another version's knobs
            pass

    def snapshot(self) -> dict[str, int]:
        import gc

        out = {"triton compiles": self.compiles, "full gc": gc.get_stats()[2]["collections"]}
        if torch.cuda.is_available():
            dev = torch.cuda.memory_stats()
            out.update(
                {
                    "cudaMalloc": dev.get("num_device_alloc", 0),
                    "cudaFree": dev.get("num_device_free", 0),
                    "alloc retries": dev.get("num_alloc_retries", 0),
                }
            )
            host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
            out.update({"cudaHostAlloc": host.get("num_host_alloc", 0), "cudaFreeHost": host.get("num_host_free", 0)})
        return out

    @staticmethod
    def delta(before: dict[str, int], after: dict[str, int]) -> str:
        return RunCounters.total([{k: after[k] - before[k] for k in after}])

    @staticmethod
    def total(deltas) -> str:
        """Counter changes (dicts of name -> count) summed, as text."""
        deltas = list(deltas)
        return ", ".join(f"{k} {sum(d[k] for d in deltas)}" for k in deltas[0]) if deltas else ""


def in_fresh_process(what: str, target, *args):
    """target(*args, conn) in a new spawned process, and what it sends on conn; a child that
    dies first (a crash, an error) is one line naming `what` and its exit code."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()
    child.close()
    try:
        return parent.recv()
    except EOFError:
        raise SystemExit(f"the {what} failed (exit {proc.join() or proc.exitcode})") from None
    finally:
        proc.join()
