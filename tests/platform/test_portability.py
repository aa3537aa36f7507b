"""The extension on CPUs without the build machine's ISAs (QEMU user-mode emulation).

``qemu-x86_64 -cpu Haswell`` has AVX2 but no AVX-512, ``-cpu Nehalem`` has neither (numpy's
OpenBLAS pinned to kernels Nehalem runs: tests/qemu_cpus.py).
Under each, a fresh interpreter loads the installed extension (without torch, which is
too slow to start under emulation), checks which ISA it chose, and checks decode and a
whole MoE call against the float64 reference.  SIMD code reachable before dispatch would
be an illegal instruction here: a test failure, not a crash in a user's hands.
Skipped when qemu-x86_64 is missing, unless MXFP4X_REQUIRE_QEMU=1 (set in CI).
"""
import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
from qemu_cpus import NUMPY_ENV

import mxfp4x

QEMU = shutil.which("qemu-x86_64")
pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only"),
    pytest.mark.skipif(QEMU is None and os.environ.get("MXFP4X_REQUIRE_QEMU") != "1",
                       reason="qemu-x86_64 not installed (Debian: qemu-user)"),
]

_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchless_probe.py")


@pytest.mark.parametrize("cpu,expected_isa", [("Haswell", "avx2"), ("Nehalem", "scalar")])
def test_runs_and_chooses_the_right_isa_under_emulation(cpu, expected_isa):
    assert QEMU is not None, "MXFP4X_REQUIRE_QEMU=1 but qemu-x86_64 is missing"
    pkg_dir = os.path.dirname(os.path.abspath(mxfp4x.__file__))
    env = {k: v for k, v in os.environ.items() if k != "MXFP4X_ISA"}
    env.update(NUMPY_ENV)
    env["OMP_NUM_THREADS"] = "2"
    out = subprocess.run([QEMU, "-cpu", cpu, os.path.realpath(sys.executable), _PROBE,
                          pkg_dir, "default", "2"], capture_output=True, text=True,
                         timeout=900, env=env, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, f"rc={out.returncode} under -cpu {cpu}:\n{out.stderr[-3000:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["isa"] == expected_isa, got
    assert "avx512" not in got["isas"], got
    assert got["decode_ok"], got
    assert got["moe_ok"], got
