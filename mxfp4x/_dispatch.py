"""The facade: coerce and check the inputs, pick a backend, call it."""
import torch

from . import _cpu
from ._torch_impl import mxfp4_experts_torch
from ._validation import check_inputs, check_num_threads

BACKENDS = ("auto", "cpu", "torch")

_X_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def _inner_contiguous(t, inner):
    """t with its last ``inner`` dims C-contiguous (outer strides may be anything)."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - inner, -1):
        if t.shape[d] > 1 and t.stride(d) != expected:
            return t.contiguous()
        expected *= t.shape[d]
    return t


def _run_cpu(x, packed, scales, sel, mix, shared, out_dtype, num_threads, isa=None):
    f64 = x.dtype == torch.float64
    compute = torch.float64 if f64 else torch.float32
    n_tokens, d_in = x.shape
    n_experts, d_out, n_groups, _ = packed.shape
    x = x.contiguous()
    packed = _inner_contiguous(packed, 2)
    scales = _inner_contiguous(scales, 1)
    sel = sel.to(torch.int64).contiguous()
    mix = mix.to(compute).contiguous()
    out = torch.empty((n_tokens, d_out), dtype=compute)
    out.copy_(shared)
    _cpu.mxfp4_experts(
        f64, x.data_ptr(), _X_DTYPE_CODES[x.dtype], n_tokens, n_groups,
        packed.data_ptr(), n_experts, d_out, packed.stride(0), packed.stride(1),
        scales.data_ptr(), scales.stride(0), scales.stride(1),
        sel.data_ptr(), sel.shape[1], mix.data_ptr(), out.data_ptr(), num_threads, isa)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def mxfp4_experts(latent_tokens, packed_weights, scale_bytes, selected_experts, mixture_weights,
                  shared_output, *, backend="auto", num_threads=None):
    """Routed MXFP4 experts plus the shared output.

    ``y[t] = shared_output[t] + sum_k mixture_weights[t, k] * W[selected_experts[t, k]] @
    latent_tokens[t]``, where ``W[e]`` is expert ``e`` decoded from ``packed_weights``
    (E, O, G, 16) and ``scale_bytes`` (E, O, G) in the MXFP4 (gpt-oss) layout.

    Returns a new tensor of shape (n_tokens, d_out) with the dtype and device of
    ``latent_tokens`` (integer latents give the default float dtype).  Accumulation is
    float32 (float64 for float64 latents), rounded to the output dtype once.

    backend: "auto" (CPU tensors -> compiled CPU kernels, other devices -> PyTorch),
    "cpu" or "torch".  num_threads: CPU threads (None: torch.get_num_threads()).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    threads = check_num_threads(num_threads)
    x, packed, scales, sel, mix, shared = check_inputs(
        latent_tokens, packed_weights, scale_bytes, selected_experts, mixture_weights,
        shared_output)
    out_dtype = x.dtype
    if backend == "auto":
        backend = "cpu" if x.device.type == "cpu" else "torch"
    if backend == "cpu":
        if x.device.type != "cpu":
            raise ValueError(f"backend: 'cpu' needs CPU tensors, but latent_tokens is on "
                             f"{x.device}; use backend='torch' or 'auto'")
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, mix, shared)):
            raise RuntimeError("mxfp4_experts: the CPU kernels do not record gradients yet; "
                               "call under torch.no_grad(), detach the inputs, or use "
                               "backend='torch' (differentiable)")
        with torch.no_grad():
            return _run_cpu(x, packed, scales, sel, mix, shared, out_dtype, threads)
    return mxfp4_experts_torch(x, packed, scales, sel, mix, shared, out_dtype)


def backend_info():
    """What the CPU backend runs here: ISA in use, runnable ISAs, OpenMP, threads, version."""
    from . import __version__

    return {
        "isa": _cpu.current_isa(),
        "isas": _cpu.runnable_isas(),
        "compiled_isas": _cpu.compiled_isas(),
        "openmp": _cpu.have_openmp(),
        "num_threads": max(1, torch.get_num_threads()),
        "version": __version__,
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }
