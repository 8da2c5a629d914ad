"""The locustfile's HTTP user (--api http): headless for a few seconds against the gateway of
`serve all`; its streamed chats succeed and TTFT / ITL are recorded beside them."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys

import pytest

from tests.services.conftest import REPO


def test_locust_http_user_streams_chats(qwen, tmp_path):
    if shutil.which("locust") is None:
        pytest.skip("locust is not installed")
    prefix = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(REPO / "loadtest" / "locustfile.py"),
        "--api",
        "http",
        "--headless",
        "-u",
        "4",
        "-r",
        "4",
        "-t",
        "6s",
        "--host",
        qwen.url,
        "--csv",
        str(prefix),
        "--only-summary",
        "--stop-timeout",
        "10",
        "--exit-code-on-error",
        "0",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as stats:
        rows = {row["Name"]: row for row in csv.DictReader(stats)}
    assert int(rows["chat"]["Request Count"]) > 0, rows
    for name in ("chat", "TTFT", "ITL", "Aggregated"):
        assert int(rows[name]["Failure Count"]) == 0, (name, rows[name], proc.stderr[-2000:])
    assert int(rows["TTFT"]["Request Count"]) == int(rows["chat"]["Request Count"])
    assert "Generate" not in rows  # only the HTTP user ran
    qwen.wait_kv_clean()
