"""Run-time ISA choice: backend_info, MXFP4X_ISA in a fresh process, OpenMP."""
import json
import os
import subprocess
import sys

import pytest
import torch

import mxfp4x
from mxfp4x import _cpu

_PROBE = r"""
import json, numpy as np, torch, mxfp4x
from mxfp4x._testing import random_layer
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
    assert out.stdout.strip() == _cpu.runnable_isas()[0]


def test_forced_isa_is_the_one_that_ran(isa):
    """MXFP4X_ISA=x in a fresh process reports x, and its bits are x's bits."""
    out = _run_probe(isa)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["isa"] == isa
    # the same layer in this process, per ISA: the subprocess result carries the bits of
    # the forced ISA's own arithmetic (and differs from the others where they differ)
    import numpy as np

    from mxfp4x._testing import random_layer
    layer = random_layer(np.random.default_rng(5), 3, 2, 4, 64, 40)
    before = _cpu.current_isa()
    per_isa = {}
    try:
        for name in _cpu.runnable_isas():
            _cpu.set_isa(name)
            per_isa[name] = mxfp4x.mxfp4_experts(**layer).view(torch.int32).tolist()
    finally:
        _cpu.set_isa(before)
    assert got["bits"] == per_isa[isa]
    for name, bits in per_isa.items():
        if bits != per_isa[isa]:
            assert got["bits"] != bits, name


def test_unknown_isa_is_an_error_naming_the_choices():
    out = _run_probe("sse9")
    assert out.returncode != 0
    assert "MXFP4X_ISA='sse9'" in out.stderr and "scalar" in out.stderr


def test_unsupported_isa_is_an_error():
    missing = [n for n in _cpu.compiled_isas() if n not in _cpu.runnable_isas()]
    if not missing:
        pytest.skip("this CPU runs every compiled ISA")
    out = _run_probe(missing[0])
    assert out.returncode != 0
    assert "cannot run" in out.stderr and missing[0] in out.stderr


def test_set_isa_refuses_silently_falling_back():
    with pytest.raises(ValueError, match="not an ISA"):
        _cpu.set_isa("neon9")


def test_openmp_present_when_required():
    if os.environ.get("MXFP4X_REQUIRE_OPENMP") == "1":
        assert mxfp4x.backend_info()["openmp"], "the build lost OpenMP"
    else:
        pytest.skip("set MXFP4X_REQUIRE_OPENMP=1 to require OpenMP")


def test_single_openmp_runtime():
    """The extension shares torch's libgomp instead of loading a second one."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    with open("/proc/self/maps") as f:
        libs = {line.split()[-1] for line in f if "libgomp" in line or "libomp" in line}
    names = {os.path.realpath(p) for p in libs}
    assert len(names) <= 1, names
