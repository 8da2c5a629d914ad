"""House rule 3 (small modules, small functions) and the linter, checked.

No product module over 450 lines and no function over 80 (from its `def` to its last line,
decorators aside), read with ast. ruff's check and format run over the repository with the
configuration in pyproject.toml; mypy, which takes about a minute, runs in scripts/test.sh.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("contracts", "scheduler_svc", "kvcache_svc", "model_svc", "pico_kernels", "http_svc")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _product_modules() -> list[Path]:
    return sorted(p for package in PRODUCT for p in (REPO / package).rglob("*.py"))


def test_no_product_module_is_over_450_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in _product_modules()}
    long = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_product_function_is_over_80_lines():
    long = {}
    for path in _product_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is in the test extra")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff(command):
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
