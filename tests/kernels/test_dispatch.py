"""Run-time ISA choice: backend_info, MXFP4X_ISA in a fresh process, OpenMP."""
import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x._core import probes as _probes
from mxfp4x._core import threads as _threads
from mxfp4x.testing.layers import random_layer, run_threads

_PROBE = r"""
import json, numpy as np, torch, mxfp4x
from mxfp4x.testing.layers import random_layer, run_threads
layer = random_layer(np.random.default_rng(5), 3, 2, 4, 64, 40)
y = mxfp4x.mxfp4_experts(**layer)
print(json.dumps({"isa": mxfp4x.backend_info()["isa"], "bits": y.view(torch.int32).tolist()}))
"""


def _run_probe(env_isa):
    env = dict(os.environ, MXFP4X_ISA=env_isa)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=300)
    return out


def test_backend_info():
    info = mxfp4x.backend_info()
    for key in ("isa", "isas", "openmp", "num_threads", "version"):
        assert key in info
    assert info["isa"] in info["isas"]
    assert "scalar" in info["isas"]
    assert info["isas"] == _cpu.runnable_isas()
    assert isinstance(info["openmp"], bool)
    assert info["num_threads"] >= 1
    assert info["version"] == mxfp4x.__version__


def test_best_isa_is_default():
    out = subprocess.run([sys.executable, "-c", "import mxfp4x; print(mxfp4x.backend_info()"
                          "['isa'])"], env={k: v for k, v in os.environ.items()
                                           if k != "MXFP4X_ISA"},
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _probes.default_decision(_cpu.runnable_isas(),
                                                          vendor_amd=_cpu_vendor_amd())
    assert out.stdout.strip() in ("avx512bf16", "avx512", "avx2", "neon", "scalar")
    # the best float32 kernels this build can run here (amx and avx512bf16 run avx512's)
    best = next(i for i in _cpu.runnable_isas() if i not in ("amx", "avx512bf16"))
    assert out.stdout.strip() in (best, "avx512bf16" if best == "avx512" else best)


def _cpu_vendor_amd():
    """/proc/cpuinfo's word (or, elsewhere, platform's) on whether AMD made this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "AuthenticAMD" in line for line in f)
    except OSError:
        return "AuthenticAMD" in platform.processor()  # Windows names the vendor there


def test_forced_isa_is_the_one_that_ran(isa):
    """MXFP4X_ISA=x in a fresh process reports x, and its bits are x's bits."""
    out = _run_probe(isa)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["isa"] == isa
    # the same layer in this process, per ISA: the subprocess result carries the bits of
    # the forced ISA's own arithmetic (and differs from the others where they differ)
    layer = random_layer(np.random.default_rng(5), 3, 2, 4, 64, 40)
    per_isa = {name: mxfp4x.mxfp4_experts(**layer, isa=name).view(torch.int32).tolist()
               for name in _cpu.runnable_isas()}
    assert got["bits"] == per_isa[isa]
    for name, bits in per_isa.items():
        if bits != per_isa[isa]:
            assert got["bits"] != bits, name


def test_unknown_isa_is_an_error_naming_the_choices():
    out = _run_probe("sse9")
    assert out.returncode != 0
    assert "ValueError: MXFP4X_ISA='sse9'" in out.stderr and "scalar" in out.stderr


def test_unsupported_isa_is_an_error():
    missing = [n for n in _cpu.compiled_isas() if n not in _cpu.runnable_isas()]
    if not missing:
        pytest.skip("this CPU runs every compiled ISA")
    out = _run_probe(missing[0])
    assert out.returncode != 0
    assert "ValueError" in out.stderr and "cannot run" in out.stderr and missing[0] in out.stderr


@pytest.mark.parametrize("bad", ["neon9", "AVX2", 3])
def test_isa_argument_refuses_silently_falling_back(rng, bad):
    layer = random_layer(rng, 2, 1, 2, 8, 1)
    with pytest.raises(ValueError, match="isa=.*choose one of"):
        mxfp4x.mxfp4_experts(**layer, isa=bad)
    with pytest.raises(ValueError, match="isa="):
        mxfp4x.mxfp4_experts_slots(layer["latent_tokens"], layer["packed_weights"],
                                   layer["scale_bytes"], layer["selected_experts"], isa=bad)


def test_unrunnable_isa_argument_is_the_same_error_class(rng):
    missing = [n for n in _cpu.compiled_isas() if n not in _cpu.runnable_isas()]
    if not missing:
        pytest.skip("this CPU runs every compiled ISA")
    with pytest.raises(ValueError, match="cannot run"):
        mxfp4x.mxfp4_experts(**random_layer(rng, 2, 1, 2, 8, 1), isa=missing[0])


def test_isa_per_call_from_concurrent_threads(rng):
    """Threads that run different ISAs at once each get their own ISA's bits: the choice
    travels with the call, nothing process-wide is switched."""
    layer = random_layer(rng, 5, 2, 3, 70, 6)
    names = _cpu.runnable_isas()
    expected = {n: mxfp4x.mxfp4_experts(**layer, isa=n) for n in names}
    default = mxfp4x.backend_info()["isa"]

    def work(i):
        name = names[i % len(names)]
        for _ in range(20):
            assert torch.equal(mxfp4x.mxfp4_experts(**layer, isa=name, num_threads=1),
                               expected[name])

    errors = run_threads(6, work)
    assert not errors, errors
    assert mxfp4x.backend_info()["isa"] == default


_AMX = dict(avx512bw=True, amx_tile=True, amx_bf16=True, amx_granted=True)
_AVX2_FACTS = dict(osxsave=True, avx=True, fma=True, avx2=True)


@pytest.mark.parametrize("facts,expected", [
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0xE7), ["avx2", "avx512", "scalar"]),
    # AVX-512 CPU under an OS that does not save ZMM state: no avx512
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x07), ["avx2", "scalar"]),
    # OS without AVX state, or no OSXSAVE: scalar only
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x03), ["scalar"]),
    (dict(_AVX2_FACTS, osxsave=False, avx512f=True, xcr0=0xE7), ["scalar"]),
    (dict(_AVX2_FACTS, fma=False, avx512f=False, xcr0=0x07), ["scalar"]),
    # macOS: AVX-512 state is enabled lazily (XCR0 shows it off); the sysctl decides
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x07, darwin_avx512=1), ["avx2", "avx512", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0xE7, darwin_avx512=0), ["avx2", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=False, xcr0=0x07, darwin_avx512=1), ["avx2", "scalar"]),
    # AMX: the CPUID bits, XCR0's tile state and the process's grant, all needed
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x600E7, **_AMX), ["amx", "avx2", "avx512", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x600E7, **dict(_AMX, amx_granted=False)),
     ["avx2", "avx512", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0xE7, **_AMX), ["avx2", "avx512", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x600E7, **dict(_AMX, avx512bw=False)),
     ["avx2", "avx512", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=False, xcr0=0x60007, **_AMX), ["avx2", "scalar"]),
    # AVX512-BF16: the CPUID bit on top of AVX-512 with BW; no state of its own
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0xE7, avx512bw=True, avx512_bf16=True),
     ["avx2", "avx512", "avx512bf16", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0xE7, avx512_bf16=True), ["avx2", "avx512", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x07, avx512bw=True, avx512_bf16=True),
     ["avx2", "scalar"]),
    (dict(_AVX2_FACTS, avx512f=True, xcr0=0x600E7, avx512_bf16=True, **_AMX),
     ["amx", "avx2", "avx512", "avx512bf16", "scalar"]),
], ids=["linux-avx512", "no-zmm-state", "no-avx-state", "no-osxsave", "no-fma",
        "macos-lazy-avx512", "macos-no-avx512", "macos-cpu-without-avx512", "linux-amx",
        "amx-not-granted", "no-tile-state", "amx-without-avx512bw", "amx-without-avx512",
        "avx512bf16", "avx512bf16-without-avx512bw", "avx512bf16-without-zmm-state",
        "amx-and-avx512bf16"])
def test_isa_decision(facts, expected):
    assert _probes.isa_decision(**facts) == expected


_BF16 = "avx512bf16" in _cpu.compiled_isas()  # not in the SIMDe build or with NO_AVX512BF16
_X86 = "avx512" in _cpu.compiled_isas()


@pytest.mark.skipif(not _X86, reason="the x86-64 kernel table is not compiled here")
@pytest.mark.parametrize("isas,vendor_amd,expected", [
    # a rule on CPUID facts: avx512bf16 by default on AMD (Zen 4 and later) only ...
    (["avx2", "avx512", "avx512bf16", "scalar"], True, "avx512bf16" if _BF16 else "avx512"),
    (["avx2", "avx512", "avx512bf16", "scalar"], False, "avx512"),
    # ... amx never (an Intel Xeon with both units, and a made-up AMD one)
    (["amx", "avx2", "avx512", "avx512bf16", "scalar"], False, "avx512"),
    (["amx", "avx2", "avx512", "avx512bf16", "scalar"], True,
     "avx512bf16" if _BF16 else "avx512"),
    (["amx", "avx2", "avx512", "scalar"], False, "avx512"),
    (["avx2", "avx512", "scalar"], True, "avx512"),  # Zen 3 with AVX-512 off, or Zen 4's VM
    (["avx2", "scalar"], True, "avx2"),  # Zen 3
    (["avx2", "scalar"], False, "avx2"),
    (["scalar"], True, "scalar"),
], ids=["zen4", "intel-avx512bf16", "intel-amx", "amd-amx", "intel-amx-only", "amd-avx512",
        "zen3", "intel-avx2", "amd-scalar"])
def test_default_decision(isas, vendor_amd, expected):
    assert _probes.default_decision(isas, vendor_amd=vendor_amd) == expected


def test_openmp_as_expected():
    """MXFP4X_REQUIRE_OPENMP=1: the build must have OpenMP (Linux); =0: it must be serial
    (macOS and Windows wheels, whose torch ships its own OpenMP runtime: setup.py)."""
    want = os.environ.get("MXFP4X_REQUIRE_OPENMP")
    if want not in ("0", "1"):
        pytest.skip("set MXFP4X_REQUIRE_OPENMP=1 (or 0) to check the build's OpenMP")
    assert mxfp4x.backend_info()["openmp"] == (want == "1"), "OpenMP is not as the build says"


def test_threads_backend_as_expected():
    """MXFP4X_REQUIRE_THREADS=openmp|pthreads|serial: the build's driver threads (Linux
    wheels: openmp; macOS: pthreads; Windows: serial; CI also builds pthreads on Linux),
    and where a build has threads, a call given 2 really runs on 2 OS threads."""
    want = os.environ.get("MXFP4X_REQUIRE_THREADS")
    info = mxfp4x.backend_info()
    assert info["threads"] in _threads.BACKENDS
    assert (info["threads"], info["openmp"]) == (_threads.backend(), _threads.have_openmp())
    assert (info["threads"] == "openmp") == info["openmp"]
    if want is not None:
        assert info["threads"] == want, f"the build's threads are {info['threads']}"
    used = _probes.threads_used(2)
    if info["threads"] == "serial":
        assert used == 1
    elif (os.cpu_count() or 1) >= 2:
        assert used == 2, f"asked for 2 threads, {used} ran"


def test_single_openmp_runtime():
    """The extension shares torch's libgomp instead of loading a second one."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libgomp" in line or "libomp" in line}
    names = {os.path.realpath(p) for p in libs}
    assert len(names) <= 1, names


def test_float32_isa_names_the_entry_whose_float32_kernels_run():
    """amx and avx512bf16 only add a bf16 unit to avx512's kernels: a float32 call on them
    runs avx512's, so the regression gate compares them with avx512's baselines.  Any
    compiled name is looked up, runnable here or not (the gate's --against)."""
    for name in _cpu.compiled_isas():
        want = "avx512" if name in ("amx", "avx512bf16") else name
        assert _cpu.float32_isa(name) == want, name
    assert _cpu.float32_isa() == _cpu.float32_isa(mxfp4x.backend_info()["isa"])
    with pytest.raises(ValueError, match="not an ISA"):
        _cpu.float32_isa("avx1024")
