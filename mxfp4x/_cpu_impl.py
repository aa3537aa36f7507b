"""The CPU backend in torch terms: lay the tensors out for the Cython driver, call it.

Inputs arrive checked (``_validation``); these functions only arrange memory:
latents contiguous (16-bit ones stay 16-bit), each group's 16 bytes contiguous
(outer expert / row strides are passed through, so expert slices are not copied),
expert ids as int64, weights and the accumulator in the compute dtype.
"""
import torch

from . import _cpu
from ._validation import check_expert_ids

_X_DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inner_contiguous(t, inner):
    """t with its last ``inner`` dims C-contiguous (outer strides may be anything)."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - inner, -1):
        if t.shape[d] > 1 and t.stride(d) != expected:
            return t.contiguous()
        expected *= t.shape[d]
    return t


def _weights_args(packed, scales):
    packed = _inner_contiguous(packed, 2)
    scales = _inner_contiguous(scales, 1)
    return (packed, scales), (packed.data_ptr(), packed.shape[0], packed.shape[1],
                              packed.stride(0), packed.stride(1), scales.data_ptr(),
                              scales.stride(0), scales.stride(1))


def _check_layout(x, packed, scales, sel, rows_of_x):
    """O(1) checks for direct callers of torch.ops.mxfp4x.*: the kernels trust shapes."""
    ok = (packed.dtype == torch.uint8 and scales.dtype == torch.uint8 and packed.dim() == 4
          and packed.shape[3] == 16 and scales.shape == packed.shape[:3]
          and x.shape[-1] == 32 * packed.shape[2] and sel.dim() == 2
          and x.shape[:-1] == rows_of_x and x.dtype in _X_DTYPE_CODES)
    if not ok:
        raise ValueError(f"mxfp4x ops: inconsistent inputs: latents {tuple(x.shape)} "
                         f"{x.dtype}, packed {tuple(packed.shape)} {packed.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}, selected {tuple(sel.shape)}; "
                         f"use mxfp4x.mxfp4_experts, which checks and converts them")


def _threads(num_threads):
    return num_threads if num_threads > 0 else max(1, torch.get_num_threads())


def experts(x, packed, scales, sel, mix, shared, num_threads, *, slot_outputs=False,
            isa=None):
    """The op on CPU tensors.  x: (T, I) or, with slot_inputs, (T, K, I).  Returns
    (T, O) = shared + sum_k p W x (dtype of x), or with slot_outputs (T, K, O) = W x.
    num_threads 0: torch.get_num_threads()."""
    check_expert_ids(sel, packed.shape[0])
    num_threads = _threads(num_threads)
    slot_inputs = x.dim() == 3
    _check_layout(x, packed, scales, sel, tuple(sel.shape) if slot_inputs else sel.shape[:1])
    if not slot_outputs and (mix.shape != sel.shape or
                             shared.shape != (sel.shape[0], packed.shape[1])):
        raise ValueError("mxfp4x ops: mixture_weights must be (T, K) and shared_output "
                         "(T, d_out)")
    compute = compute_dtype(x.dtype)
    n_tokens, top_k = sel.shape
    d_in = x.shape[-1]
    d_out = packed.shape[1]
    x = x.contiguous()
    keep, wargs = _weights_args(packed, scales)
    sel = sel.to(torch.int64).contiguous()
    if slot_outputs:
        out = torch.empty((n_tokens, top_k, d_out), dtype=compute)
        mix = out  # unused by the kernel
    else:
        out = torch.empty((n_tokens, d_out), dtype=compute)
        out.copy_(shared)
        mix = mix.to(compute).contiguous()
    _cpu.mxfp4_experts(compute == torch.float64, x.data_ptr(), _X_DTYPE_CODES[x.dtype],
                       n_tokens, d_in // 32, *wargs, sel.data_ptr(), top_k, mix.data_ptr(),
                       out.data_ptr(), num_threads, isa, slot_inputs, slot_outputs)
    del keep
    return out if out.dtype == x.dtype else out.to(x.dtype)


def grad_latents(grad, packed, scales, sel, mix, x, num_threads, *, isa=None):
    """dx = sum_k p W^T grad (the transposed product), shaped and typed like x.  Per-slot
    latents (T, K, I) get per-slot rows; a per-slot grad (T, K, O) has weight 1."""
    check_expert_ids(sel, packed.shape[0])
    num_threads = _threads(num_threads)
    slot_inputs, slot_outputs = x.dim() == 3, grad.dim() == 3
    _check_layout(x, packed, scales, sel, tuple(sel.shape) if slot_inputs else sel.shape[:1])
    want = tuple(sel.shape) if slot_outputs else sel.shape[:1]
    if grad.shape != want + (packed.shape[1],) or (not slot_outputs and mix.shape != sel.shape):
        raise ValueError(f"mxfp4x ops: grad {tuple(grad.shape)} does not match the op's output")
    compute = compute_dtype(x.dtype)
    n_tokens, top_k = sel.shape
    d_in = x.shape[-1]
    keep, wargs = _weights_args(packed, scales)
    sel = sel.to(torch.int64).contiguous()
    grad = grad.to(compute).contiguous()
    mix = (grad if slot_outputs else mix).to(compute).contiguous()  # unread with slot_outputs
    n_rows = n_tokens * top_k if slot_inputs else n_tokens
    dx = torch.zeros((n_rows, d_in), dtype=compute)
    half = _cpu.mxfp4_experts_t(
        compute == torch.float64, grad.data_ptr(), n_tokens, d_in // 32, *wargs,
        sel.data_ptr(), top_k, mix.data_ptr(), dx.data_ptr(), num_threads, isa, slot_inputs,
        slot_outputs)
    del keep
    # back from the kernel's element layout: block of 2*half = [evens, odds] -> natural
    dx = dx.view(n_rows, d_in // (2 * half), 2, half).transpose(2, 3).reshape(x.shape)
    return dx.to(x.dtype)
