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


def tma_build() -> dict:
    """tma_layers_kernel compiled for sm_90 at Qwen3-0.6B's shapes, 128 programs and four boxes
    a stage: its shared memory, TMA copies and grid-barrier arrivals in the PTX."""
    from triton.experimental.gluon import language as gl

    from bench.persistent_probe import QWEN3, TMA_BOXES
    from bench.persistent_tma_kernel import KB, RB, tma_layers_kernel
    from pico_kernels.triton_common import next_pow2
    from tests.kernels.test_gluon_prefill_build import compile_for_sm90

    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = f"tensordesc<bf16[{RB.value}, {KB.value}],{layout}>"
    signature = dict.fromkeys(["d_ptr", "res_a", "res_b", "qkv_ptr", "o_ptr", "gu_ptr"], "*bf16") | {"bar_ptr": "*i32"}
    signature |= dict.fromkeys(["dq", "do", "dgu", "dd"], desc) | dict.fromkeys(["nw_in", "nw_post"], "*bf16")
    signature |= {"eps": "fp32", "n_layers": "i32"}
    s, g = QWEN3, 128
    constants = dict(H=s["H"], Q=s["Q"], QKV=s["QKV"], INTER=s["INTER"], IP=next_pow2(s["INTER"]),
                     SA=s["QKV"] // g, SB=s["H"] // g, SC=2 * s["INTER"] // g, SD=s["H"] // g,
                     STAGES=TMA_BOXES // 4, BOXES=4, WORK=2, num_warps=4)  # fmt: skip
    kernel = compile_for_sm90(tma_layers_kernel, signature, constants, {"num_warps": 4})
    ptx = kernel.asm["ptx"]
    return dict(
        shared=kernel.metadata.shared,
        tma_loads=ptx.count("cp.async.bulk.tensor"),
        arrivals=len([ln for ln in ptx.splitlines() if "atom.global.gpu.acq_rel.add" in ln]),
    )


def test_tma_probe_compiles_for_hopper_in_shared_memory():
    """bench/persistent_tma_kernel.py built for sm_90 on the CPU (a child process: under the
    interpreter nothing compiles): its ring of weight boxes fits the shared memory, the
    producer issues TMA copies, and the consumer crosses each grid barrier by one atomic."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.bench.test_persistent_probe"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    build = json.loads(done.stdout.strip().splitlines()[-1])
    assert build["shared"] <= 227 * 1024, build
    assert build["tma_loads"] >= 1 and build["arrivals"] == 4, build  # one arrival a phase


if __name__ == "__main__":
    import json

    print(json.dumps(tma_build()))
