"""QEMU CPU models for the tests that run this interpreter under ``qemu-x86_64 -cpu``.

The extension imports numpy, and numpy loads its bundled OpenBLAS, which picks its kernels
from CPUID when it loads: under QEMU's Nehalem model (numpy 2.4.6, OpenBLAS of
scipy-openblas64) that choice stopped the interpreter with an illegal instruction at
``import numpy``, and under SandyBridge at the first matrix product.  NUMPY_ENV pins
OpenBLAS to its Nehalem kernels.  The probes run under the oldest model of a list on which
this interpreter, so configured, imports numpy and multiplies matrices: Nehalem (no AVX)
where that holds, else the next; the C-level checkers (no numpy) run under Nehalem.
"""
import functools
import os
import subprocess
import sys

# CPUs without AVX2 (so without mxfp4x's avx2 and avx512 entries), oldest first
WITHOUT_AVX2 = ("Nehalem", "Westmere", "SandyBridge", "IvyBridge")
NUMPY_ENV = {"OPENBLAS_CORETYPE": "Nehalem"}


@functools.lru_cache(maxsize=None)
def oldest_running_numpy(qemu, candidates=WITHOUT_AVX2):
    """The first model of ``candidates`` under which this interpreter imports numpy and
    multiplies two matrices (with NUMPY_ENV), or None when none does."""
    env = {**os.environ, **NUMPY_ENV}
    for cpu in candidates:
        res = subprocess.run([qemu, "-cpu", cpu, os.path.realpath(sys.executable), "-c",
                              "import numpy; numpy.ones((9, 9)) @ numpy.ones((9, 2))"],
                             capture_output=True, text=True, timeout=600, env=env)
        if res.returncode == 0:
            return cpu
    return None
