"""The CPU backend in torch terms: the one place that turns tensors into a call of the
compiled driver (``mxfp4x._cpu.Call``), which checks it and runs it.

Memory is arranged here and nowhere else: each expert row's packed bytes and scale
bytes contiguous (outer expert / row strides pass through, so expert slices and
per-expert tensors are never copied), latents contiguous in their own dtype (16-bit
ones stay 16-bit), expert ids int64, weights and results in the compute dtype.
"""
from typing import Sequence, Union

import numpy as np
import torch

from . import _cpu
from ._format import GROUP_BYTES

Bytes = Union[torch.Tensor, Sequence[torch.Tensor]]

_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64",
                torch.bfloat16: "bfloat16", torch.float16: "float16"}


def compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_contiguous(t, inner):
    """t with its last ``inner`` dims C-contiguous (outer strides may be anything)."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - inner, -1):
        if t.shape[d] > 1 and t.stride(d) != expected:
            return t.contiguous()
        expected *= t.shape[d]
    return t


def _array(t):
    """A zero-copy numpy view of a contiguous CPU tensor (16-bit floats as int16)."""
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy()


def _expert_bytes(name, t, n_groups):
    """One expert's bytes as (d_out, n_groups * 16) rows: (O, G, 16) or (O, G*16)."""
    if t.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8 bytes, got {t.dtype}")
    if t.dim() == 3 and t.shape[2] == GROUP_BYTES and (n_groups is None or
                                                        t.shape[1] == n_groups):
        return _rows_contiguous(t, 2).flatten(1) if t.shape[0] else t.reshape(0, -1)
    if t.dim() == 2 and (n_groups is None or t.shape[1] == n_groups * GROUP_BYTES):
        return _rows_contiguous(t, 1)
    raise ValueError(f"{name}: expected (d_out, n_groups, 16) or (d_out, n_groups * 16) "
                     f"bytes, got shape {tuple(t.shape)}")


def experts_of(packed: Bytes, scales: Bytes) -> _cpu.Experts:
    """The experts' description for the driver: packed (E, O, G, 16) and scales
    (E, O, G) uint8, or lists of E per-expert tensors (O, G, 16) / (O, G*16) and
    (O, G).  Nothing is stacked or copied (rows already contiguous); the result keeps
    the tensors alive.  An ``_cpu.Experts`` passes through (a module's cached table)."""
    if isinstance(packed, _cpu.Experts):
        return packed
    if isinstance(packed, torch.Tensor):
        if packed.dim() != 4 or packed.shape[3] != GROUP_BYTES or not isinstance(
                scales, torch.Tensor) or tuple(scales.shape) != tuple(packed.shape[:3]) or \
                packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"mxfp4x: expected uint8 packed (E, O, G, 16) and scales "
                             f"(E, O, G), got {tuple(packed.shape)} {packed.dtype} and "
                             f"{tuple(getattr(scales, 'shape', ()))} "
                             f"{getattr(scales, 'dtype', type(scales).__name__)}")
        pk: torch.Tensor = _rows_contiguous(packed, 2)
        sc: torch.Tensor = _rows_contiguous(scales, 1)
        n_experts, d_out, n_groups = pk.shape[:3]
        e = torch.arange(n_experts, dtype=torch.int64)
        table = torch.stack((pk.data_ptr() + e * pk.stride(0), sc.data_ptr() + e * sc.stride(0),
                             torch.full_like(e, pk.stride(1)), torch.full_like(e, sc.stride(1))),
                            dim=1)
        return _cpu.Experts(table.numpy(), d_out=d_out, n_groups=n_groups, owner=(pk, sc))
    if isinstance(scales, torch.Tensor):
        raise ValueError("scale_bytes: expected a list of per-expert tensors, as "
                         "packed_weights is")
    if len(packed) != len(scales) or not len(packed):
        raise ValueError(f"mxfp4x: expected as many scale tensors as packed ones (at least "
                         f"one), got {len(packed)} and {len(scales)}")
    p0 = _expert_bytes("packed_weights[0]", packed[0], None)
    d_out, n_groups = p0.shape[0], p0.shape[1] // GROUP_BYTES
    shape_p, shape_s = tuple(packed[0].shape), (d_out, n_groups)
    u8 = torch.uint8
    keep = []
    rows = []
    for i, (p, s) in enumerate(zip(packed, scales, strict=True)):
        # the common case (contiguous uint8 entries of one shape) costs a few attribute
        # reads per expert: a checkpoint layer passes hundreds of them on every call
        if not (p.dtype == u8 and s.dtype == u8 and p.shape == shape_p and
                s.shape == shape_s and p.is_contiguous() and s.is_contiguous()):
            p = _expert_bytes(f"packed_weights[{i}]", p, n_groups)
            if s.dtype != u8 or tuple(s.shape) != shape_s or p.shape[0] != d_out:
                raise ValueError(f"expert {i}: expected packed ({d_out}, {n_groups}, 16) and "
                                 f"uint8 scales {shape_s}, got {tuple(p.shape)} and "
                                 f"{tuple(s.shape)} {s.dtype}")
            s = _rows_contiguous(s, 1)
            keep.append((p, s))
        rows.append((p.data_ptr(), s.data_ptr(), p.stride(0), s.stride(0)))
    per_expert = np.array(rows, dtype=np.int64).reshape(len(rows), 4)
    return _cpu.Experts(per_expert, d_out=d_out, n_groups=n_groups,
                        owner=(packed, scales, keep))


def _threads(num_threads):
    return num_threads if num_threads > 0 else max(1, torch.get_num_threads())


def _operand_rows(t, per_slot):
    """A (T, W) or per-slot (T, K, W) tensor as contiguous 2-D rows."""
    t = t.contiguous()
    return t.reshape(-1, t.shape[-1]) if per_slot else t


def experts(x, packed, scales, sel, mix, shared, num_threads, *, per_slot_outputs=False,
            isa=None):
    """The forward product on CPU tensors.  x: (T, I), or (T, K, I) with one latent
    row per slot.  Returns shared + sum_k p W x (T, O) in x's dtype, or with
    ``per_slot_outputs`` W x per slot (T, K, O) (mix and shared then None)."""
    compute = compute_dtype(x.dtype)
    n_tokens, top_k = sel.shape
    slot_latents = x.dim() == 3
    ex = experts_of(packed, scales)
    if per_slot_outputs:
        out = torch.empty((n_tokens * top_k, ex.d_out), dtype=compute)
        mix_arr = None
    else:
        if tuple(shared.shape) != (n_tokens, ex.d_out):
            raise ValueError(f"shared_output: expected ({n_tokens}, {ex.d_out}), got "
                             f"{tuple(shared.shape)}")
        out = shared.detach().to(compute, copy=True).contiguous()
        mix_arr = _array(mix.to(compute).contiguous())
    x2 = _operand_rows(x, slot_latents)
    _cpu.Call(ex, product="forward", compute=_DTYPE_NAMES[compute],
              selected=_array(sel.to(torch.int64).contiguous()), mix=mix_arr,
              src=_array(x2), src_dtype=_DTYPE_NAMES[x.dtype],
              src_rows="slot" if slot_latents else "token", dst=_array(out),
              dst_rows="slot" if per_slot_outputs else "token", isa=isa,
              n_threads=_threads(num_threads)).run()
    if per_slot_outputs:
        out = out.view(n_tokens, top_k, ex.d_out)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def grad_latents(grad, packed, scales, sel, mix, x, num_threads, *, isa=None):
    """The transposed product: dx = sum_k p W^T grad, shaped and typed like x.  Per-slot
    latents (T, K, I) get per-slot rows; a per-slot grad (T, K, O) (of the per-slot
    outputs) has weight 1 (mix None)."""
    compute = compute_dtype(x.dtype)
    slot_latents, slot_grad = x.dim() == 3, grad.dim() == 3
    ex = experts_of(packed, scales)
    n_rows = x.shape[0] * (x.shape[1] if slot_latents else 1)
    dx = torch.empty((n_rows, x.shape[-1]), dtype=compute)
    _cpu.Call(ex, product="transposed", compute=_DTYPE_NAMES[compute],
              selected=_array(sel.to(torch.int64).contiguous()),
              mix=None if slot_grad else _array(mix.to(compute).contiguous()),
              src=_array(_operand_rows(grad.to(compute), slot_grad)),
              src_dtype=_DTYPE_NAMES[compute], src_rows="slot" if slot_grad else "token",
              dst=_array(dx), dst_rows="slot" if slot_latents else "token", isa=isa,
              n_threads=_threads(num_threads)).run()
    return dx.view(x.shape).to(x.dtype)
