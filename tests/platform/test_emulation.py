"""The AVX-512 kernels' source on any x86-64, through SIMDe ("every ISA is
exercised on every host").

``-DMXFP4X_EMULATE_AVX512`` compiles include/mxfp4x/avx512.h through
include/mxfp4x/emulate_avx512.h (SIMDe plus our exact shims) for the x86-64 baseline.
Here:

* every intrinsic avx512.h uses is one whose emulation somebody checked;
* the C-level checker (tests/c/check_kernels.c) built natively and emulated: every check
  passes in both, and each (isa, check) digest is the same, so on an AVX-512 host the
  emulated avx512 kernels are bit-identical to the native ones;
* the emulated checker under ``qemu-x86_64 -cpu Haswell`` (AVX2, no AVX-512) and
  ``-cpu Nehalem`` (no AVX at all): the same digests again;
* in an extension built with MXFP4X_EMULATE_AVX512=1 (the CI emulation lane), a product
  with isa="avx512" under ``-cpu Nehalem`` (numpy's OpenBLAS pinned: tests/qemu_cpus.py),
  against the float64 reference.

Skipped without SIMDe (Debian: libsimde-dev) unless MXFP4X_REQUIRE_SIMDE=1, and the QEMU
parts without qemu-x86_64 unless MXFP4X_REQUIRE_QEMU=1 (both set in CI).
"""
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_checker import CHECKER, HEADERS, build, host_cc, parse
from qemu_cpus import NUMPY_ENV

ROOT = Path(__file__).resolve().parents[2]
AVX512_H = HEADERS / "mxfp4x" / "avx512.h"
FLOAT64_H = HEADERS / "mxfp4x" / "float64.h"
DENSE_H = HEADERS / "mxfp4x" / "dense" / "avx512.h"
EMULATE_H = HEADERS / "mxfp4x" / "emulate_avx512.h"
EMULATED = ["-DMXFP4X_EMULATE_AVX512", "-Wno-psabi"]
QEMU = shutil.which("qemu-x86_64")
REQUIRE_QEMU = os.environ.get("MXFP4X_REQUIRE_QEMU") == "1"
REQUIRE_SIMDE = os.environ.get("MXFP4X_REQUIRE_SIMDE") == "1"

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only"),
    pytest.mark.skipif(not (AVX512_H.is_file() and EMULATE_H.is_file()),
                       reason="needs the checkout's include/"),
]

# Intrinsics whose SIMDe 0.7.4 emulation was read and is exact (bit moves, integer ops,
# and IEEE add / mul, one rounding each).  emulate_avx512.h shims the rest (the #defines
# it makes, parsed below).  A new intrinsic in avx512.h fails the test below until its
# emulation has been checked (read simde/x86/...; round-off, NaN and index handling) and
# listed here, or shimmed.  Not exact in SIMDe, so never to be listed: any FMA form
# (two roundings), _mm512_reduce_add_ps (another order than GCC's), vdpbf16ps.
SIMDE_EXACT = {
    "_mm_add_ps", "_mm_add_ss", "_mm_cvtss_f32", "_mm_loadu_si128", "_mm_movehl_ps",
    "_mm_set_ss", "_mm_shuffle_ps",  # SSE/SSE2: native on every x86-64
    "_mm256_add_ps", "_mm256_castpd_ps", "_mm256_castps256_ps128", "_mm256_extractf128_ps",
    "_mm512_add_ps", "_mm512_castps512_ps256", "_mm512_castps_pd", "_mm512_extractf64x4_pd",
    "_mm512_loadu_ps", "_mm512_mul_ps", "_mm512_set1_ps", "_mm512_setzero_ps",
    "_mm512_srli_epi32", "_mm512_storeu_ps",
    # bit moves only (simde/x86/avx512: load.h and loadu.h memcpy, slli.h shifts each
    # 32-bit lane, cast.h reinterprets): the scaled tables and the dense bf16 widening
    "_mm512_load_ps", "_mm512_loadu_si512", "_mm512_slli_epi32", "_mm512_castsi512_ps",
    # the dense bf16 kernel's odd halves and float32 token split (and.h: a bitwise and of
    # each lane; permutex2var.h: the _ps form is the epi32 one on the bits, a lane pick per
    # index, or under AVX2 permutevar8x32 and blendv selects; set.h / set1.h: constants)
    "_mm512_and_si512", "_mm512_permutex2var_ps", "_mm512_set_epi32", "_mm512_set1_epi32",
    # ... and its aligned row stream (load.h memcpy, setzero.h memset, add.h adds 32-bit
    # lanes, permutex2var.h's epi32 form picks lanes as above)
    "_mm512_load_si512", "_mm512_setzero_si512", "_mm512_add_epi32",
    "_mm512_permutex2var_epi32",
    # the float64 path's decode (mul.h: an IEEE multiply per lane, one rounding, the NaN
    # operand's NaN as native; permutex2var.h: the _pd form is the epi64 one on the bits,
    # lane idx & 7 of b if idx & 8 else of a; srli.h shifts each 64-bit lane; xor.h,
    # cast.h, set.h / set1.h, storeu.h: bit moves and constants; _mm_loadl_epi64: SSE2)
    "_mm512_mul_pd", "_mm512_permutex2var_pd", "_mm512_srli_epi64", "_mm512_xor_si512",
    "_mm512_castpd_si512", "_mm512_castsi512_pd", "_mm512_set_pd", "_mm512_set1_pd",
    "_mm512_set1_epi64", "_mm512_storeu_pd", "_mm_loadl_epi64",
    # ... and its panel_dot / axpy_rows (float64.h; simde/x86/avx.h: add and mul per 64-bit
    # lane, one rounding each, as the 128-bit halves or plain C; extractf128 / castpd256
    # pick a half; loadu / storeu memcpy; set1 / setzero constants; the _mm_ ones: SSE2)
    "_mm256_add_pd", "_mm256_mul_pd", "_mm256_castpd256_pd128", "_mm256_extractf128_pd",
    "_mm256_loadu_pd", "_mm256_storeu_pd", "_mm256_set1_pd", "_mm256_setzero_pd",
    "_mm_add_pd", "_mm_add_sd", "_mm_cvtsd_f64", "_mm_mul_sd", "_mm_set_sd", "_mm_unpackhi_pd",
}


def _code(path):
    """C source without comments."""
    text = path.read_text()
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)


def test_every_intrinsic_of_avx512_h_is_checked():
    # avx512.h and the files it includes (float64.h, dense/avx512.h: compiled there too)
    used = set(re.findall(r"\b_mm(?:256|512)?_\w+",
                          _code(AVX512_H) + _code(FLOAT64_H) + _code(DENSE_H)))
    shimmed = set(re.findall(r"#define\s+(_mm\w+)\(", _code(EMULATE_H)))
    assert {"_mm512_fmadd_ps", "_mm_fmadd_ss", "_mm512_cvtepu8_epi32",
            "_mm512_permutexvar_ps"} <= shimmed, shimmed
    unchecked = sorted(used - SIMDE_EXACT - shimmed - {"_mm_prefetch"})
    assert not unchecked, (
        f"avx512.h uses {unchecked}, whose SIMDe emulation nobody has checked for "
        "bit-exactness: read its simde/x86 source, then list it in SIMDE_EXACT "
        "(tests/platform/test_emulation.py) or shim it in include/mxfp4x/emulate_avx512.h")


def test_the_generic_drivers_hold_no_intrinsic():
    """include/mxfp4x/generic/ is compiled inside each ISA header over that header's
    macros: an intrinsic written there would escape the check above (and run unchecked
    under SIMDe), so every instruction stays in the ISA's own header."""
    generic = sorted((HEADERS / "mxfp4x" / "generic").glob("*.h"))
    assert generic, "include/mxfp4x/generic/ holds the drivers"
    for path in generic:
        found = re.findall(r"\b_mm(?:256|512)?_\w+|\bv\w+q_[a-z]\w*", _code(path))
        assert not found, f"{path.name} calls {sorted(set(found))}: move them into the ISA's macros"


# ---- the C-level checker, native and emulated ---------------------------------------

def _simde_flags():
    """-I for SIMDe where setup.py would find it ([] for the system's include path)."""
    candidates = [os.environ.get("MXFP4X_SIMDE_INCLUDE", "")]
    try:
        import simde_py
        candidates.append(simde_py.get_include())
    except ImportError:
        pass
    for folder in candidates:
        if folder and (Path(folder) / "simde" / "x86" / "avx512.h").is_file():
            return [f"-I{folder}"]
    if any((Path(d) / "simde" / "x86" / "avx512.h").is_file()
           for d in ("/usr/include", "/usr/local/include")):
        return []
    msg = "SIMDe headers not found (Debian: libsimde-dev; or pip install simde-py)"
    if REQUIRE_SIMDE:
        pytest.fail(f"MXFP4X_REQUIRE_SIMDE=1 but {msg}")
    pytest.skip(msg)


def _results(cmd):
    """{(isa, check): digest} of a checker run that passed every check."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{cmd}: rc={res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    got = {}
    for (isa, check), (digest, ok) in parse(res.stdout).items():
        assert ok, f"{cmd}: {isa} {check}\n{res.stdout}"
        got[(isa, check)] = digest
    return got, res.stdout


@pytest.fixture(scope="module")
def checkers(tmp_path_factory):
    """The checker built natively and with the emulated AVX-512 kernels."""
    if not CHECKER.is_file():
        pytest.skip("tests/c/check_kernels.c is missing")
    cc = host_cc()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc, clang) on PATH")
    simde = _simde_flags()
    tmp = tmp_path_factory.mktemp("emulation")
    return {"native": str(build(cc, tmp / "check_native", [], timeout=600)),
            "emulated": str(build(cc, tmp / "check_emulated", EMULATED + simde, timeout=600))}


@pytest.fixture(scope="module")
def runs(checkers):
    native, native_out = _results([checkers["native"]])
    emulated, emulated_out = _results([checkers["emulated"]])
    print(f"native:\n{native_out}\nemulated:\n{emulated_out}")
    return native, emulated


def test_emulated_avx512_passes_every_check(runs):
    """On any x86-64 host: the emulated avx512 entry runs and passes every check (its
    float64 bounds, the batch / split-rows bit-identity, decode bit for bit)."""
    native, emulated = runs
    checks = {check for isa, check in native if isa == "scalar"}
    assert checks and {check for isa, check in emulated if isa == "avx512"} == checks, emulated


def test_emulated_avx512_is_bit_identical_to_native(runs):
    native, emulated = runs
    common = sorted(set(native) & set(emulated))
    differ = [(key, native[key], emulated[key]) for key in common
              if native[key] != emulated[key]]
    assert not differ, f"emulated digests differ from native: {differ}"
    if not any(isa == "avx512" for isa, _ in native):
        pytest.skip("this CPU cannot run the native AVX-512 kernels: the emulated ones are "
                    "checked against the bounds only (scalar/avx2 digests agree)")
    assert sum(isa == "avx512" for isa, _ in common) >= 5, common


@pytest.mark.parametrize("cpu,isas", [("Haswell", {"avx512", "avx2", "scalar"}),
                                      ("Nehalem", {"avx512", "scalar"})],
                         ids=["Haswell", "Nehalem"])
def test_emulated_checker_under_qemu(checkers, runs, cpu, isas):
    """The emulated build on CPUs without AVX-512 (Haswell) and without AVX (Nehalem):
    avx512 runs there, with the digests of the host's native (else emulated) run."""
    if QEMU is None:
        if REQUIRE_QEMU:
            pytest.fail("MXFP4X_REQUIRE_QEMU=1 but qemu-x86_64 is missing")
        pytest.skip("qemu-x86_64 not installed (Debian: qemu-user)")
    native, emulated = runs
    got, stdout = _results([QEMU, "-cpu", cpu, checkers["emulated"]])
    assert {isa for isa, _ in got} == isas, stdout
    want = {**emulated, **native}
    differ = [(key, want[key], got[key]) for key in got if want.get(key) != got[key]]
    assert not differ, f"under -cpu {cpu}: {differ}\n{stdout}"


# ---- the extension built for the emulation lane -------------------------------------

_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchless_probe.py")


def test_emulated_extension_runs_without_avx():
    """The extension of the emulation lane: avx512 on a CPU without AVX (-cpu Nehalem),
    decode bit for bit and a product within the documented bound."""
    from mxfp4x._core import cpu as _cpu

    if _cpu.build_info().get("emulated") != "avx512":
        pytest.skip("the emulation lane's check: an extension built with "
                    "MXFP4X_EMULATE_AVX512=1")
    assert "avx512" in _cpu.runnable_isas()  # on any x86-64
    if QEMU is None:
        if REQUIRE_QEMU:
            pytest.fail("MXFP4X_REQUIRE_QEMU=1 but qemu-x86_64 is missing")
        pytest.skip("qemu-x86_64 not installed (Debian: qemu-user)")
    pkg_dir = str(Path(_cpu.__file__).resolve().parent.parent)  # mxfp4x/
    env = {k: v for k, v in os.environ.items() if k != "MXFP4X_ISA"}
    env.update(NUMPY_ENV)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([QEMU, "-cpu", "Nehalem", os.path.realpath(sys.executable),
                          _PROBE, pkg_dir, "avx512", "1"], capture_output=True, text=True,
                         timeout=900, env=env, cwd=str(Path(__file__).resolve().parent))
    assert out.returncode == 0, f"rc={out.returncode}:\n{out.stderr[-3000:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["emulated"] == "avx512" and got["isas"] == ["avx512", "scalar"], got
    assert got["ran"] == "avx512" and got["decode_ok"], got
    assert got["moe_worst"] <= 1.0, got
