"""The README's Python examples run as written, and every relative link in the README and
docs/ points at a file that exists (and, with a #fragment into markdown, at a heading of it).

Each ```python block runs in its own interpreter with the repository as the working
directory, on the CPU with the bundled model, as a reader would paste it. A block that talks
to a server (its code names a `base_url`) gets `picovllm serve all` started by the test, on
free ports that replace the default ones in the block."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)  # links inside code are not links
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def python_blocks(path: Path) -> list[str]:
    return _FENCE.findall(path.read_text())


def relative_links(path: Path) -> list[str]:
    text = _CODE.sub("", path.read_text())
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, mailto:, ...


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors: the heading lowercased, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for line in _CODE.sub("", path.read_text()).splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def test_readme_has_python_examples():
    assert len(python_blocks(README)) >= 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`picovllm serve all` with the bundled model, started on the first block that needs it."""
    started = []

    def get():
        if not started:
            from tests.http.conftest import ServeAll

            started.append(
                ServeAll(
                    tmp_path_factory.mktemp("readme-server"), ["--num-gpu-blocks", "128", "--num-cpu-blocks", "16"]
                )
            )
        return started[0]

    yield get
    for stack in started:
        stack.close()


@pytest.mark.parametrize("index", range(len(python_blocks(README))))
def test_readme_python_block_runs(index, server):
    code = python_blocks(README)[index]
    if "base_url" in code:
        code = code.replace("http://127.0.0.1:8000", server().url)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"README python block {index} printed nothing"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists() or fragment and dest.suffix == ".md" and fragment not in heading_anchors(dest):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: broken links {broken}"


def test_docs_are_linked_from_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    assert not [d.name for d in DOCS if d.resolve() not in linked]
