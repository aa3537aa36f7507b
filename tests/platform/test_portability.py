"""The extension on CPUs without the build machine's ISAs (QEMU user-mode emulation).

``qemu-x86_64 -cpu Haswell`` has AVX2 but no AVX-512, ``-cpu Nehalem`` has neither.
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

import mxfp4x

QEMU = shutil.which("qemu-x86_64")
pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only"),
    pytest.mark.skipif(QEMU is None and os.environ.get("MXFP4X_REQUIRE_QEMU") != "1",
                       reason="qemu-x86_64 not installed (Debian: qemu-user)"),
]

_PROBE = r"""
import json, sys, types
import numpy as np
pkg = types.ModuleType("mxfp4x")
pkg.__path__ = [sys.argv[1]]
sys.modules["mxfp4x"] = pkg  # the package's modules, without its torch-importing __init__
from mxfp4x import _cpu, _probes, _reference

rng = np.random.default_rng(3)
result = {"isa": _cpu.default_isa(), "isas": _cpu.runnable_isas()}

# decode: all 256 bytes x all 256 scale bytes, bit for bit (natural order from the hook)
packed = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1, 1))
scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 16))
got = _probes.decode_rows(packed, scales)
with np.errstate(over="ignore"):
    ref = _reference.decode_expert(packed, scales).astype(np.float32)
nan = np.isnan(ref)
result["decode_ok"] = bool((np.isnan(got) == nan).all() and
                           (got[~nan].view(np.uint32) == ref[~nan].view(np.uint32)).all())

# a whole call, one token (gemv) and many (panel), against the float64 reference,
# through the same typed boundary as the torch facade (numpy arrays, no torch)
T, K, E, O, G = 20, 3, 4, 37, 5
x = rng.standard_normal((T, 32 * G)).astype(np.float32)
pk = rng.integers(0, 256, (E, O, G, 16), dtype=np.uint8)
sc = rng.integers(120, 132, (E, O, G), dtype=np.uint8)
sel = rng.integers(0, E, (T, K)).astype(np.int64)
sel[0] = 1
mix = rng.random((T, K)).astype(np.float32)
shared = rng.standard_normal((T, O)).astype(np.float32)
y = shared.copy()
table = np.array([[pk[e].ctypes.data, sc[e].ctypes.data, pk.strides[1], sc.strides[1]]
                  for e in range(E)], dtype=np.int64)
experts = _cpu.Experts(table, d_out=O, n_groups=G, owner=(pk, sc))
_cpu.Call(experts, product="forward", compute="float32", selected=sel, mix=mix, src=x,
          src_dtype="float32", src_rows="token", dst=y, dst_rows="token", n_threads=2).run()
ref = _reference.mxfp4_experts_reference(x, pk, sc, sel, mix, shared)
mag = _reference.mxfp4_experts_reference(np.abs(x), pk, sc, sel, np.abs(mix), np.abs(shared),
                                         absolute=True)
bound = _reference.error_bound(mag, 32 * G + K + 2, "float32")
result["moe_ok"] = bool((np.abs(y - ref) <= bound).all())
result["moe_worst"] = float((np.abs(y - ref) / bound).max())
print(json.dumps(result))
"""


@pytest.mark.parametrize("cpu,expected_isa", [("Haswell", "avx2"), ("Nehalem", "scalar")])
def test_runs_and_chooses_the_right_isa_under_emulation(cpu, expected_isa):
    assert QEMU is not None, "MXFP4X_REQUIRE_QEMU=1 but qemu-x86_64 is missing"
    pkg_dir = os.path.dirname(os.path.abspath(mxfp4x.__file__))
    env = {k: v for k, v in os.environ.items() if k != "MXFP4X_ISA"}
    env["OMP_NUM_THREADS"] = "2"
    out = subprocess.run([QEMU, "-cpu", cpu, os.path.realpath(sys.executable), "-c", _PROBE,
                          pkg_dir], capture_output=True, text=True, timeout=900, env=env,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, f"rc={out.returncode} under -cpu {cpu}:\n{out.stderr[-3000:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["isa"] == expected_isa, got
    assert "avx512" not in got["isas"], got
    assert got["decode_ok"], got
    assert got["moe_ok"], got
