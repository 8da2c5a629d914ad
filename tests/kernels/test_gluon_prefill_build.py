"""The Hopper prefill kernels (pico_kernels.gluon_prefill, the default on sm_90, and the probe
bench/gluon_prefill_kernel.py) compiled for sm_90 on the CPU: they build with the installed
Triton, fit the shared memory, and keep the schedule each exists for (a score product still in
flight while the softmax runs; for the warp-specialised one, TMA loads and per-partition
register budgets). Their numerics are checked on a GPU (tests/kernels/test_gluon_prefill_gpu.py,
bench/gluon_prefill_probe.py).

The build runs in a child process (this module as a script): under the interpreter, which
the CPU suite sets before the kernels are decorated, nothing compiles."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

POINTERS = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr", "out_ptr"]
INTS = ["num_seqs", "stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
        "stride_vh", "stride_bt", "stride_ot", "stride_oh"]  # fmt: skip


def compile_for_sm90(kernel, signature: dict, constants: dict, options: dict):
    """The Gluon kernel built for sm_90; pointers and strides (the parameters named so) are
    given the launch's 16-divisibility."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = signature | dict.fromkeys(constants, "constexpr")  # in the kernel's order of parameters
    names = list(signature)
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n.startswith("stride")]
    src = GluonASTSource(
        kernel,
        signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_for_hopper(head_dim: int):
    from bench import gluon_prefill_kernel as gluon_prefill

    types = ["*bf16"] * 3 + ["*i32"] * 3 + ["*bf16"]
    signature = dict(zip(POINTERS, types)) | {"scale_log2": "fp32"} | dict.fromkeys(INTS, "i32")
    block_m, block_n, warps = gluon_prefill.BLOCK_M, gluon_prefill.BLOCK_N, gluon_prefill.NUM_WARPS
    constants = dict(GROUP=4, HEAD_DIM=head_dim, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n, K_STAGES=3, OVERLAP=True,
                     num_warps=warps)  # fmt: skip
    return compile_for_sm90(gluon_prefill._prefill_kernel, signature, constants, {"num_warps": warps})


def compile_ws_for_hopper(head_dim: int):
    from triton.experimental.gluon import language as gl

    from pico_kernels import gluon_prefill as ws

    layout = gl.NVMMASharedLayout.get_default_for([16, head_dim], gl.bfloat16)
    desc = f"tensordesc<bf16[16, {head_dim}],{layout}>"
    signature = {"q_ptr": "*bf16", "k_desc": desc, "v_desc": desc} | dict.fromkeys(POINTERS[3:6], "*i32")
    signature |= {"out_ptr": "*bf16", "scale_log2": "fp32", "num_seqs": "i32"}
    signature |= dict.fromkeys(["stride_qt", "stride_qh", "stride_bt", "stride_ot", "stride_oh"], "i32")
    constants = dict(GROUP=4, STAGES=3, OVERLAP=True, PINGPONG=True, num_warps=ws.NUM_WARPS)
    return compile_for_sm90(ws._prefill_ws_kernel, signature, constants,
                            {"num_warps": ws.NUM_WARPS, "maxnreg": ws.MAXNREG})  # fmt: skip


def ptxas_report(ptx: str, tmp_path: Path) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90) if "arch" in get_ptxas.__code__.co_varnames else get_ptxas()
    path = ptxas.path if hasattr(ptxas, "path") else ptxas[0]
    (tmp_path / "k.ptx").write_text(ptx)
    done = subprocess.run([path, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout + done.stderr


def hopper_build(kind: str, head_dim: int, tmp_path: Path) -> dict:
    kernel = (compile_ws_for_hopper if kind == "ws" else compile_for_hopper)(head_dim)
    ptx = kernel.asm["ptx"]
    waits = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)))
    return {
        "waits": waits,
        "shared": kernel.metadata.shared,
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)),
        "register_budgets": sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
        "ptxas": ptxas_report(ptx, tmp_path),
    }


def build_in_child(kind: str, head_dim: int, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "tests.kernels.test_gluon_prefill_build", kind, str(head_dim), str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_prefill_compiles_overlapped_without_spills(head_dim, tmp_path):
    build = build_in_child("cp.async", head_dim, tmp_path)
    assert build["waits"] == ["0", "1"], build  # 1: the next tile's scores waited for with P V in flight
    assert build["shared"] <= 227 * 1024, build
    assert "0 bytes spill stores" in build["ptxas"], build["ptxas"]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_warp_specialised_prefill_compiles_with_tma_and_register_budgets(head_dim, tmp_path):
    build = build_in_child("ws", head_dim, tmp_path)
    assert build["waits"] == ["0", "1"], build
    assert build["shared"] <= 227 * 1024, build  # three K and V stages fit
    # K, V and V's last tile, 8 pages a tile, each [16, D] box issued as 128-byte-wide copies
    assert build["tma_loads"] == 3 * 8 * (head_dim * 2 // 128), build
    assert {"40", "232"} <= set(build["register_budgets"]), build  # the producer's and the consumers'


if __name__ == "__main__":
    print(json.dumps(hopper_build(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))))
