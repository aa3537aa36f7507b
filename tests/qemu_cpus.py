"""The environment for running this interpreter under ``qemu-x86_64 -cpu``.

The extension imports numpy, and numpy loads its bundled OpenBLAS, which picks its kernels
from CPUID when it loads: under QEMU's Nehalem model (numpy 2.4.6, OpenBLAS of
scipy-openblas64) that choice stopped the interpreter with an illegal instruction at
``import numpy``, and under SandyBridge at the first matrix product.  NUMPY_ENV pins
OpenBLAS to its Nehalem kernels, which every x86-64-v2 CPU runs.
"""
NUMPY_ENV = {"OPENBLAS_CORETYPE": "Nehalem"}
