"""bench/persistent_kernel.py's phases in the interpreter, at a small shape whose intermediate
size is no power of two: program counts that split the rows unevenly give the chain's output
and residual phase by phase, and one program gives it through the whole launch, barriers and
each prefetch mode included (many programs cross a barrier on a GPU only, in
bench/persistent_probe.py gpu)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
if not (ROOT / "bench" / "persistent_probe.py").is_file():
    pytest.skip("bench/ is not in this checkout", allow_module_level=True)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.mark.timeout(300)
def test_phases_equal_the_gemv_chain():
    from bench import persistent_probe

    found = persistent_probe.check((3, 5))
    assert len(found) == 5
    for _, ulps_d, ulps_res in found:
        assert ulps_d <= 1.0 and ulps_res <= 1.0


def test_tma_probe_compiles_for_hopper_in_shared_memory(tmp_path):
    """bench/persistent_tma_kernel.py built for sm_90 on the CPU (a child process: under the
    interpreter nothing compiles): its ring of weight boxes fits the shared memory, the
    producer issues TMA copies, and the consumer crosses each grid barrier by one atomic."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "bench.persistent_probe", "build"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    build = json.loads(done.stdout.strip().splitlines()[-1])
    assert build["shared"] <= 227 * 1024, build
    assert build["tma_loads"] >= 1 and build["arrivals"] == 4, build  # one arrival a phase
