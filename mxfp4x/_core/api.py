"""The facade: coerce and check the inputs, pick a backend, call it."""
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np
import torch

from .._version import __version__
from . import cpu as _cpu
from . import cpu_impl as _cpu_impl
from . import threads as _threads
from .arguments import check_isa, check_num_threads
from .ops import forward_ad_in_use, forward_op_for, functorch_grad_in_use, runs_direct, slots_op_for
from .torch_impl import mxfp4_experts_torch, slots_torch
from .validation import check_inputs

BACKENDS = ("auto", "cpu", "torch")

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[Any]]


def _check_backend(backend, isa):
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    check_isa(isa)  # plain Python: torch.compile traces it


def _check_forward_ad(backend, tensors, name):
    if backend != "torch" and functorch_grad_in_use():
        raise NotImplementedError(
            f"mxfp4x.{name}: torch.func.grad / vjp / jacrev are not supported by the "
            f"compiled kernels' gradient; use .backward() or torch.autograd.grad, or pass "
            f"backend='torch' (PyTorch ops, which these transforms differentiate)")
    if backend != "torch" and forward_ad_in_use(tensors):
        raise NotImplementedError(
            f"mxfp4x.{name}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is "
            f"not implemented for the compiled kernels; pass backend='torch' (PyTorch ops, "
            f"differentiable in both modes)")


def _check_device(backend, x):
    if backend == "cpu" and x.device.type != "cpu":
        raise ValueError(f"backend: 'cpu' needs CPU tensors, but latent_tokens is on "
                         f"{x.device}; use backend='torch' or 'auto'")


def _direct(packed, scales, backend, tensors) -> bool:
    """Whether this call runs the CPU kernels directly (``runs_direct``).  A prepared expert
    table (a module's, built once: ``cpu_impl.experts_of``; checked when built) runs only
    so: elsewhere a TypeError that says to pass the tensors themselves."""
    if not isinstance(packed, _cpu.Experts):
        return backend != "torch" and runs_direct(tensors, (packed, scales))
    if backend == "torch" or not runs_direct(tensors, ()):
        raise TypeError("packed_weights: a prepared expert table runs the CPU kernels "
                        "directly (CPU tensors, no gradient, not traced); pass the expert "
                        "tensors themselves here")
    return True


def mxfp4_experts(latent_tokens: ArrayLike, packed_weights: ArrayLike,
                  scale_bytes: Optional[ArrayLike],
                  selected_experts: ArrayLike, mixture_weights: ArrayLike,
                  shared_output: ArrayLike, *, backend: str = "auto",
                  num_threads: Optional[int] = None, isa: Optional[str] = None
                  ) -> torch.Tensor:
    """Routed MXFP4 experts plus the shared output.

    ``y[t] = shared_output[t] + sum_k mixture_weights[t, k] * W[selected_experts[t, k]] @
    latent_tokens[t]``, where ``W[e]`` is expert ``e`` decoded from ``packed_weights``
    (E, O, G, 16) and ``scale_bytes`` (E, O, G) in the MXFP4 (gpt-oss) layout, or from
    lists of E per-expert tensors, packed (O, G, 16) or (O, G*16) and scales (O, G), read
    in place (a per-expert checkpoint such as Kimi K3's: nothing is stacked or copied;
    bit-identical to the stacked form).  Scales typed ``torch.float8_e8m0fnu`` are read
    as their bytes.  ``scale_bytes=None``: ``packed_weights`` holds llama.cpp's GGUF
    ``block_mxfp4`` blocks, (E, O, G, 17) or a list of E (O, G, 17) / (O, G*17) tensors
    (17 bytes per group: the E8M0 scale byte, then 16 bytes whose byte j holds element j
    in its low nibble and j+16 in its high one), read in place (a view of a
    memory-mapped file works; nothing is repacked or copied).  Byte 255 is NaN, as for
    every scale.
    ``latent_tokens`` may also be (n_tokens, top_k, d_in): slot k then uses its own input
    ``latent_tokens[t, k]`` (a down projection after a per-slot activation).

    Returns a new tensor of shape (n_tokens, d_out) with the dtype and device of
    ``latent_tokens`` (integer latents give the default float dtype).  Accumulation is
    float32 (float64 for float64 latents), rounded to the output dtype once.

    backend: "auto" (CPU tensors -> compiled CPU kernels, other devices -> PyTorch),
    "cpu" or "torch".  num_threads: CPU threads (None: torch.get_num_threads()).
    isa: the CPU instruction set for this call, one of ``backend_info()["isas"]`` (None:
    ``backend_info()["isa"]``: ``MXFP4X_ISA``, or the default the CPU's facts choose).
    """
    _check_backend(backend, isa)
    threads = check_num_threads(num_threads)
    x, packed, scales, sel, mix, shared = check_inputs(
        latent_tokens, packed_weights, scale_bytes, selected_experts, mixture_weights,
        shared_output)
    _check_device(backend, x)
    direct = _direct(packed, scales, backend, (x, sel, mix, shared))
    if backend == "torch" and not x.is_meta:  # plain PyTorch ops (differentiable;
        # data-dependent routing, so torch.compile(fullgraph=True) needs the default backend,
        # which goes through the op; so do meta tensors, which have no ids to route by)
        return mxfp4_experts_torch(x, packed, scales, sel, mix, shared, x.dtype)
    if direct:  # what the op would run
        # (the ids converted to int64 chunk by chunk, never whole); no forward-mode AD there
        return _cpu_impl.experts(x, packed, scales, sel, mix, shared, threads, isa=isa or None)
    _check_forward_ad(backend, (x, mix, shared), "mxfp4_experts")
    # the custom op: compiled kernels for CPU tensors, the PyTorch path elsewhere
    return forward_op_for(packed)(x, packed, scales, _op_ids(sel), mix, shared, threads,
                              isa or "")


def mxfp4_experts_slots(latent_tokens: ArrayLike, packed_weights: ArrayLike,
                        scale_bytes: Optional[ArrayLike], selected_experts: ArrayLike, *,
                        backend: str = "auto", num_threads: Optional[int] = None,
                        isa: Optional[str] = None) -> torch.Tensor:
    """Per-slot outputs without the combine: ``y[t, k] = W[selected_experts[t, k]] @ x``,
    shape (n_tokens, top_k, d_out), where x is ``latent_tokens[t]`` (n_tokens, d_in) or
    ``latent_tokens[t, k]`` (n_tokens, top_k, d_in).  As for :func:`mxfp4_experts`:
    float32 accumulation (float64 for float64), the latents' dtype and device, the same
    checks, backends, threads and ISA; differentiable in ``latent_tokens``."""
    _check_backend(backend, isa)
    threads = check_num_threads(num_threads)
    x, packed, scales, sel, _, _ = check_inputs(latent_tokens, packed_weights, scale_bytes,
                                                selected_experts)
    _check_device(backend, x)
    direct = _direct(packed, scales, backend, (x, sel))
    if backend == "torch" and not x.is_meta:
        return slots_torch(x, packed, scales, sel)
    if direct:  # what the op would run
        return _cpu_impl.experts(x, packed, scales, sel, None, None, threads,
                                 per_slot_outputs=True, isa=isa or None)
    _check_forward_ad(backend, (x,), "mxfp4_experts_slots")
    return slots_op_for(packed)(x, packed, scales, _op_ids(sel), threads, isa or "")


def _op_ids(sel):
    """The expert ids as the op takes them: int32 or int64 CPU ids as they are (its CPU
    kernels convert them chunk by chunk, and the backward keeps them as given), others
    as int64 (the PyTorch path indexes with them; unsigned ids must not become masks)."""
    if sel.device.type == "cpu" and sel.dtype in (torch.int32, torch.int64):
        return sel
    return sel.to(torch.int64)


def backend_info() -> Dict[str, Any]:
    """What the CPU backend runs here: the default ISA, runnable ISAs, OpenMP, threads,
    version, and how the extension was built (its compile flags, and whether the
    compiler saw fast-math or global ISA flags: both must be False in a shipped build)."""
    return {
        "isa": _cpu.default_isa(),
        "isas": _cpu.runnable_isas(),
        "compiled_isas": _cpu.compiled_isas(),
        "cpu_features": _cpu.cpu_features(),
        "openmp": _threads.have_openmp(),
        "threads": _threads.backend(),
        "num_threads": _threads.resolve(None),
        "version": __version__,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "build": _cpu.build_info(),
    }
