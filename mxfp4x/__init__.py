"""mxfp4x: exact, fast MXFP4 Mixture-of-Experts experts for PyTorch on CPUs and GPUs.

Public API: :func:`mxfp4_experts`, :func:`mxfp4_experts_slots`, :func:`quantize`,
:func:`dequantize`, :func:`backend_info`, :func:`reference`, and the modules of
:mod:`mxfp4x.nn` (imported on first use, as ``mxfp4x.nn``).
"""
from typing import Any

# torch first: it loads its OpenMP runtime (libgomp.so.1), which the CPU extension then
# shares instead of loading a second one.
import torch  # noqa: F401

try:
    from ._core import cpu as _cpu  # noqa: F401
except ImportError as _exc:  # a source checkout that was never built
    raise ImportError(
        "mxfp4x: the compiled CPU extension mxfp4x._core.cpu is missing from "
        f"{__path__[0]}. Install the package (`pip install mxfp4x`), or, in a source "
        "checkout, build it in place with an editable install: `pip install -e .`"
    ) from _exc

from ._core.api import backend_info, mxfp4_experts, mxfp4_experts_slots  # noqa: E402
from ._core.quantize import dequantize, quantize  # noqa: E402
from ._core.reference import mxfp4_experts_reference as reference  # noqa: E402
from ._version import __version__  # noqa: E402

__all__ = ["mxfp4_experts", "mxfp4_experts_slots", "quantize", "dequantize",
           "backend_info", "reference", "nn", "distributed", "__version__"]


def __getattr__(name: str) -> Any:
    """``mxfp4x.nn`` and ``mxfp4x.distributed`` on first use, as ``torch.nn`` is reachable
    after ``import torch``."""
    if name in ("nn", "distributed"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'mxfp4x' has no attribute {name!r}")
