"""mxfp4x: exact, fast MXFP4 Mixture-of-Experts experts for PyTorch on CPUs and GPUs.

Public API: :func:`mxfp4_experts`, :func:`backend_info`, :func:`reference`.
"""
import importlib
import importlib.machinery
import os
import sys


def _built_here():
    here = os.path.dirname(os.path.abspath(__file__))
    return any(os.path.exists(os.path.join(here, "_cpu" + s))
               for s in importlib.machinery.EXTENSION_SUFFIXES)


if not _built_here():
    # A source checkout shadows the installed package (``python -m mxfp4x`` or
    # ``python -m pytest`` from the repository root put it first on sys.path) and
    # its extension was never built in place: load the installed build instead.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    del sys.modules[__name__]
    try:
        sys.modules[__name__] = importlib.import_module(__name__)
    except ImportError as exc:
        raise ImportError("mxfp4x: the compiled CPU extension is missing; install the package "
                          "with `pip install .` (or build it in place with `python setup.py "
                          "build_ext --inplace`)") from exc
    finally:
        sys.path[:] = _saved
else:
    # torch first: it loads its OpenMP runtime (libgomp.so.1), which the CPU
    # extension then shares instead of loading a second one.
    import torch  # noqa: F401

    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as _version

        __version__ = _version("mxfp4x")
    except PackageNotFoundError:  # built in place, never installed
        __version__ = "0+unknown"

    from ._dispatch import backend_info, mxfp4_experts, mxfp4_experts_slots  # noqa: E402
    from ._quantize import dequantize, quantize  # noqa: E402
    from ._reference import mxfp4_experts_reference as reference  # noqa: E402

    __all__ = ["mxfp4_experts", "mxfp4_experts_slots", "quantize", "dequantize",
               "backend_info", "reference", "__version__"]
