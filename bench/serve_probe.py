"""What bench/serve.py's server processes spend: CPU seconds per process kind, and py-spy
samples of each (raw collapsed stacks). Linux (ps, /proc)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def _server_processes(procs: list[subprocess.Popen]) -> list[tuple[str, str]]:
    """(pid, command line) of every Python process under the server's process groups, the
    `serve all` parent left out."""
    found = []
    for proc in procs:
        lines = subprocess.run(
            ["ps", "-o", "pid=,args=", "-g", str(proc.pid)], capture_output=True, text=True
        ).stdout.splitlines()
        for line in lines:
            pid, _, cmd = line.strip().partition(" ")
            if "python" in cmd and " all " not in f"{cmd} ":
                found.append((pid, cmd))
    return found


def start_py_spy(procs: list[subprocess.Popen], out_dir: str) -> list[subprocess.Popen]:
    """py-spy on every Python process of the server (raw collapsed stacks, one file each)."""
    if shutil.which("py-spy") is None:
        print("py-spy is not installed: no profile", file=sys.stderr)
        return []
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    spies = []
    for pid, cmd in _server_processes(procs):
        words = cmd.split()
        kind = cmd.split("serve", 1)[1].split()[0] if " serve " in cmd else words[2] if len(words) > 2 else "python"
        out = Path(out_dir, f"{kind.rsplit('.', 1)[-1]}-{pid}.txt")
        argv = ["py-spy", "record", "-p", pid, "-r", "200", "-f", "raw", "-o", str(out), "--nonblocking", "--gil"]
        spies.append(subprocess.Popen([*argv, "--threads"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def server_cpu(procs: list[subprocess.Popen]) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process of the server, by kind (the
    scheduler's engine process is "engine"); Linux only, else empty."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    found: dict[str, float] = {}
    for pid, cmd in _server_processes(procs):
        kind = (
            "engine"
            if "engine_core" in cmd
            else "null model"
            if "null_model" in cmd
            else cmd.split(" serve ", 1)[1].split()[0]
            if " serve " in cmd
            else "other"
        )
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        found[kind] = found.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return found


def stop_py_spy(spies: list[subprocess.Popen]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()
