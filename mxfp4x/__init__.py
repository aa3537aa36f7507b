"""mxfp4x: exact, fast MXFP4 Mixture-of-Experts experts for PyTorch on CPUs and GPUs.

Public API: :func:`mxfp4_experts`, :func:`backend_info`, :func:`reference`.
"""
# torch first: it loads its OpenMP runtime (libgomp.so.1), which the CPU
# extension then shares instead of loading a second one.
import torch  # noqa: F401

try:
    from importlib.metadata import PackageNotFoundError, version as _version

    __version__ = _version("mxfp4x")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

from ._dispatch import backend_info, mxfp4_experts  # noqa: E402
from ._reference import mxfp4_experts_reference as reference  # noqa: E402

__all__ = ["mxfp4_experts", "backend_info", "reference", "__version__"]
