"""CPU defaults vs the old ones, on the bundled model: `picovllm generate` latency and locust
`short_chat` requests/s through `picovllm serve all`.

"old" is torch's own thread count (one per core), what every entry point used before the
runner chose threads by model size; "default" is what the entry points pick now.

    python bench/cpu_defaults.py --out bench/results/cpu_defaults.md
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from contracts.rpc import free_port  # noqa: E402

PROMPT = "Once upon a time"


def _torch_default_threads() -> int:
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def generate_latency(threads: int | None, repeats: int) -> tuple[float, float]:
    """(median wall time of the whole command, median in-process generate time) over `repeats`."""
    walls, gens = [], []
    flags = [] if threads is None else [f"--torch-threads={threads}"]
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "scheduler_svc.cli",
                "generate",
                PROMPT,
                "--max-tokens",
                "40",
                "--temperature",
                "0",
                *flags,
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        walls.append(time.perf_counter() - start)
        code = (
            "import time; from scheduler_svc import LLM, SamplingParams\n"
            f"llm = LLM(torch_threads={threads!r}); p = SamplingParams(temperature=0, max_tokens=40)\n"
            "llm.generate(%r, p); t = time.perf_counter(); llm.generate(%r, p); print(time.perf_counter() - t)"
            % (PROMPT, PROMPT)
        )
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True).stdout
        gens.append(float(out.split()[-1]))
    return statistics.median(walls), statistics.median(gens)


def locust_rps(threads: int | None, seconds: int, users: int) -> dict[str, float]:
    """Requests/s, TTFT and ITL medians of locust short_chat against a fresh `serve all`."""
    from contracts.health import check_health

    sched, kv, model, metrics = (free_port() for _ in range(4))
    addr = f"127.0.0.1:{sched}"
    argv = [
        sys.executable,
        "-m",
        "scheduler_svc.cli",
        "serve",
        "all",
        f"--scheduler-addr={addr}",
        f"--kvcache-addr=127.0.0.1:{kv}",
        f"--model-addr=127.0.0.1:{model}",
        f"--metrics-port={metrics}",
    ]
    if threads is not None:
        argv.append(f"--torch-threads={threads}")
    server = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not check_health(addr):
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("serve all did not become ready")
            time.sleep(0.2)
        with tempfile.TemporaryDirectory() as tmp:
            prefix = Path(tmp) / "run"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "locust",
                    "-f",
                    str(REPO / "loadtest" / "locustfile.py"),
                    "--headless",
                    "-u",
                    str(users),
                    "-r",
                    str(users),
                    "-t",
                    f"{seconds}s",
                    "--host",
                    addr,
                    "--csv",
                    str(prefix),
                    "--only-summary",
                    "--workload",
                    "short_chat",
                    "--stop-timeout",
                    "10",
                ],
                cwd=tmp,
                check=True,
                capture_output=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            with open(f"{prefix}_stats.csv") as stats:
                rows = {row["Name"]: row for row in csv.DictReader(stats)}
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=90)
    gen = rows["Generate"]
    return {
        "rps": float(gen["Requests/s"]),
        "failures": int(gen["Failure Count"]),
        "requests": int(gen["Request Count"]),
        "ttft_p50": float(rows["TTFT"]["Median Response Time"]),
        "itl_p50": float(rows["ITL"]["Median Response Time"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="generate runs per setting (default 5)")
    parser.add_argument("--seconds", type=int, default=30, help="locust run length per setting (default 30)")
    parser.add_argument("--users", type=int, default=8, help="locust users (default 8)")
    parser.add_argument("--out", default=None, help="write the markdown report here (default: stdout)")
    args = parser.parse_args()
    old = _torch_default_threads()
    settings = [("default", None), (f"old: torch's {old} threads", old)]
    lines = [
        "# CPU defaults: bundled model (stories260k), default settings vs the old ones",
        "",
        f"- date: {time.strftime('%Y-%m-%d')}; host: {platform.processor() or platform.machine()}, {os.cpu_count()} "
        "CPUs; "
        f"Python {platform.python_version()}",
        f"- command: `python bench/cpu_defaults.py --repeats {args.repeats} --seconds {args.seconds} --users "
        f"{args.users}`",
        "",
        "| setting | generate, whole command (s) | generate, 40 tokens in process (s) | locust short_chat req/s | "
        "TTFT p50 (ms) | ITL p50 (ms) | failures |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, threads in settings:
        wall, gen = generate_latency(threads, args.repeats)
        load = locust_rps(threads, args.seconds, args.users)
        lines.append(
            f"| {name} | {wall:.2f} | {gen:.3f} | {load['rps']:.1f} | {load['ttft_p50']:.0f} | {load['itl_p50']:.0f} | "
            f"{load['failures']} of {load['requests']} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    report = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(report)
    print(report)


if __name__ == "__main__":
    main()
