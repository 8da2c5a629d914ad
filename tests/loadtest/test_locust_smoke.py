"""Headless locust against the three services started by the test (about 20 s): every
workload's calls succeed, and TTFT / ITL are recorded as their own entries."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import pytest

from tests.services.conftest import REPO, Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("locust-stack"))
    yield s
    s.close()


def test_locust_headless_smoke(stack, tmp_path):
    locust = shutil.which("locust")
    if locust is None:
        pytest.skip("locust is not installed")
    prefix = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(REPO / "loadtest" / "locustfile.py"),
        "--headless",
        "-u",
        "6",
        "-r",
        "6",
        "-t",
        "20s",
        "--host",
        stack.addr["scheduler"],
        "--csv",
        str(prefix),
        "--only-summary",
        "--workload",
        "shared_prefix",
        "--stop-timeout",
        "10",
        "--exit-code-on-error",
        "0",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as stats:
        rows = {row["Name"]: row for row in csv.DictReader(stats)}
    assert int(rows["Generate"]["Request Count"]) > 0, rows
    for name in ("Generate", "TTFT", "ITL", "Aggregated"):
        assert int(rows[name]["Failure Count"]) == 0, (name, rows[name], proc.stderr[-2000:])
    assert int(rows["TTFT"]["Request Count"]) == int(rows["Generate"]["Request Count"])
    assert float(rows["TTFT"]["Median Response Time"]) > 0
    stack.wait_kv_clean()
