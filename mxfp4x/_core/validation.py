"""The op's inputs checked together: coerced (``coerce``), then shapes that agree with
each other (stacked experts or one tensor per expert, the safetensors or the GGUF
arrangement), before any kernel runs.  Every error names the argument, what it got and
what was expected."""
import numpy as np
import torch

from . import cpu as _cpu
from .coerce import (
    _UINT64,
    _min_max,
    as_tensor,
    byte_tensor,
    check_rank,
    float_tensor,
    index_tensor,
)
from .format import GGUF_BLOCK_BYTES, GROUP, GROUP_BYTES


def check_op_call(x, packed, sel, mix=None, shared=None):
    """What a direct ``torch.ops.mxfp4x`` call must satisfy before any implementation
    runs (the facade checks all of it and more; these are the checks that read no data
    and cost nothing per expert, so the fake implementation makes them too): float latents
    (n_tokens, d_in) or (n_tokens, top_k, d_in), integer ids (n_tokens, top_k), and the
    mixture weights and shared output shaped to match."""
    if x.dim() not in (2, 3):
        raise ValueError(f"latent_tokens: expected a 2-D tensor (n_tokens, d_in) or a 3-D "
                         f"tensor (n_tokens, top_k, d_in), got shape {tuple(x.shape)}")
    float_tensor("latent_tokens", x, allow_int=False)
    check_rank("selected_experts", sel, 2, "(n_tokens, top_k)")
    index_tensor("selected_experts", sel)
    n_tokens = x.shape[0]
    if sel.shape[0] != n_tokens:
        raise ValueError(f"selected_experts: expected {n_tokens} rows (n_tokens of "
                         f"latent_tokens), got shape {tuple(sel.shape)}")
    if x.dim() == 3 and x.shape[1] != sel.shape[1]:
        raise ValueError(f"latent_tokens: per-slot latents must be (n_tokens, top_k, d_in) "
                         f"with top_k = {sel.shape[1]}, got shape {tuple(x.shape)}")
    if isinstance(packed, torch.Tensor):
        check_rank("packed_weights", packed, 4, "(n_experts, d_out, n_groups, 16 or 17)")
        d_out = packed.shape[1]
    else:
        if len(packed) == 0:
            raise ValueError("packed_weights: expected at least one expert")
        d_out = packed[0].shape[0]
    if mix is not None:
        float_tensor("mixture_weights", mix, allow_int=False)
        if tuple(mix.shape) != tuple(sel.shape):
            raise ValueError(f"mixture_weights: expected shape {tuple(sel.shape)} to match "
                             f"selected_experts, got {tuple(mix.shape)}")
    if shared is not None:
        float_tensor("shared_output", shared, allow_int=False)
        if tuple(shared.shape) != (n_tokens, d_out):
            raise ValueError(f"shared_output: expected shape {(n_tokens, d_out)} (n_tokens, "
                             f"d_out of packed_weights), got {tuple(shared.shape)}")


SKIP = object()  # marks an argument that is not part of this call (per-slot outputs)


def is_expert_list(value):
    """Experts given one tensor (or array) each, as a list or tuple, not nested lists."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(v, (torch.Tensor, np.ndarray)) for v in value)


def _expert_entries(name, value, device):
    entries = []
    for e, v in enumerate(value):
        t = as_tensor(f"{name}[{e}]", v)
        if t.device != device:
            if isinstance(v, torch.Tensor):
                raise ValueError(f"{name}[{e}]: on device {t.device}, but latent_tokens is on "
                                 f"{device}; move it with .to({str(device)!r})")
            t = t.to(device)
        entries.append(byte_tensor(f"{name}[{e}]", t))
    return entries


def _uniform_bytes(packed, scales, n_groups, device):
    """Every entry a uint8 torch tensor on ``device``, packed all of entry 0's shape,
    (O, G, 16) or (O, G*16), scales all (O, G); or, for scales None (GGUF blocks), packed
    all (O, G, 17) or (O, G*17)."""
    p0 = packed[0]
    if not isinstance(p0, torch.Tensor) or p0.dim() not in (2, 3) or not p0.shape[0]:
        return False
    shape_p = p0.shape
    width = GROUP_BYTES if scales is not None else GGUF_BLOCK_BYTES
    if shape_p[1:] not in ((n_groups, width), (n_groups * width,)):
        return False
    shape_s = (shape_p[0], n_groups)
    u8 = torch.uint8
    tensor = torch.Tensor
    if scales is None:
        return all(isinstance(p, tensor) and p.dtype == u8 and p.shape == shape_p and
                   p.device == device and p.layout == torch.strided for p in packed)
    for p, s in zip(packed, scales, strict=True):
        if not (isinstance(p, tensor) and isinstance(s, tensor) and p.dtype == u8 and
                s.dtype == u8 and p.shape == shape_p and s.shape == shape_s and
                p.device == device and s.device == device and p.layout == torch.strided
                and s.layout == torch.strided):
            return False
    return True


def _gguf_hint(shape):
    """What to do with a shape of the other arrangement, or nothing."""
    if len(shape) >= 1 and shape[-1] == GGUF_BLOCK_BYTES:
        return (f" ({GGUF_BLOCK_BYTES} bytes per group: GGUF block_mxfp4 blocks are passed "
                f"with scale_bytes=None)")
    return ""


def check_gguf_list(packed_weights, n_groups, d_in, device):
    """Per-expert GGUF blocks (O, G, 17) or (O, G*17) (scale_bytes None): every entry the
    same shape; returns (packed as (O, G, 17) views, n_experts, d_out)."""
    if _uniform_bytes(packed_weights, None, n_groups, device):
        return list(packed_weights), len(packed_weights), packed_weights[0].shape[0]
    packed = _expert_entries("packed_weights", packed_weights, device)
    first = packed[0]
    d_out = first.shape[0] if first.dim() else 0
    width = n_groups * GGUF_BLOCK_BYTES
    for e, p in enumerate(packed):
        if p.dim() == 2 and p.shape == (d_out, width):
            packed[e] = p = p.unflatten(1, (n_groups, GGUF_BLOCK_BYTES))
        if tuple(p.shape) != (d_out, n_groups, GGUF_BLOCK_BYTES):
            hint = " (16 bytes per group: pass their scale_bytes)" if p.dim() and \
                p.shape[-1] in (GROUP_BYTES, n_groups * GROUP_BYTES) else ""
            raise ValueError(f"packed_weights[{e}]: scale_bytes is None, so each entry holds "
                             f"GGUF block_mxfp4 blocks: expected shape ({d_out}, {n_groups}, "
                             f"{GGUF_BLOCK_BYTES}) or ({d_out}, {width}) for d_in = {d_in} "
                             f"(as entry 0), got {tuple(p.shape)}{hint}")
    return packed, len(packed), d_out


def check_expert_list(packed_weights, scale_bytes, n_groups, d_in, device):
    """Per-expert packed (O, G, 16) or (O, G*16) and scales (O, G): every entry the same
    shape and dtype; returns (packed as (O, G, 16) views, scales, n_experts, d_out)."""
    if isinstance(scale_bytes, (list, tuple)) and any(s is None for s in scale_bytes):
        e = next(i for i, s in enumerate(scale_bytes) if s is None)
        raise ValueError(f"scale_bytes[{e}]: None in a list: GGUF blocks are passed with "
                         f"scale_bytes=None itself (not a list), and then every "
                         f"packed_weights entry holds GGUF blocks (the experts of one call "
                         f"share one arrangement)")
    if not is_expert_list(scale_bytes):
        raise ValueError("scale_bytes: packed_weights is a list of per-expert tensors, so "
                         "scale_bytes must be one too (a list or tuple of (d_out, n_groups) "
                         f"tensors), got {type(scale_bytes).__name__}")
    if len(scale_bytes) != len(packed_weights):
        raise ValueError(f"scale_bytes: expected {len(packed_weights)} per-expert tensors (as "
                         f"packed_weights), got {len(scale_bytes)}")
    if _uniform_bytes(packed_weights, scale_bytes, n_groups, device):
        # the common case, a few attribute reads per expert (a checkpoint layer passes
        # hundreds of experts on every call): entries are used as they are
        return list(packed_weights), list(scale_bytes), len(packed_weights), \
            packed_weights[0].shape[0]
    packed = _expert_entries("packed_weights", packed_weights, device)
    scales = _expert_entries("scale_bytes", scale_bytes, device)
    first = packed[0]
    d_out = first.shape[0] if first.dim() else 0
    for e, (p, sc) in enumerate(zip(packed, scales, strict=True)):
        if p.dim() == 2 and p.shape == (d_out, n_groups * GROUP_BYTES):
            packed[e] = p = p.unflatten(1, (n_groups, GROUP_BYTES))
        if tuple(p.shape) != (d_out, n_groups, GROUP_BYTES):
            raise ValueError(f"packed_weights[{e}]: expected shape ({d_out}, {n_groups}, "
                             f"{GROUP_BYTES}) or ({d_out}, {n_groups * GROUP_BYTES}) for "
                             f"d_in = {d_in} (as entry 0), got {tuple(p.shape)}"
                             f"{_gguf_hint(p.shape) if p.dim() == 3 else ''}")
        if tuple(sc.shape) != (d_out, n_groups):
            raise ValueError(f"scale_bytes[{e}]: expected shape ({d_out}, {n_groups}) to "
                             f"match packed_weights[{e}], got {tuple(sc.shape)}")
    return packed, scales, len(packed), d_out


def check_inputs(latent_tokens, packed_weights, scale_bytes, selected_experts,
                 mixture_weights=SKIP, shared_output=SKIP):
    """Coerce and check every input; returns tensors on the latents' device.

    latent_tokens is (n_tokens, d_in), or (n_tokens, top_k, d_in) with one input row per
    slot.  mixture_weights / shared_output given as SKIP are not checked (returned None).
    scale_bytes None: packed_weights holds GGUF block_mxfp4 blocks, (E, O, G, 17) or a
    list of (O, G, 17) / (O, G*17), the scales inside them (returned scales: None).
    """
    names = ("latent_tokens", "packed_weights", "scale_bytes", "selected_experts",
             "mixture_weights", "shared_output")
    raw = (latent_tokens, packed_weights, scale_bytes, selected_experts, mixture_weights,
           shared_output)
    prepared = isinstance(packed_weights, _cpu.Experts)  # a module's table, built once
    if prepared and scale_bytes is not None:
        raise TypeError("scale_bytes: expected None with a prepared expert table (it holds "
                        "the scales' addresses)")
    listed = not prepared and is_expert_list(packed_weights)
    gguf = scale_bytes is None
    ts = [None if v is SKIP or (listed and n in ("packed_weights", "scale_bytes")) or
          (prepared and n == "packed_weights") or (gguf and n == "scale_bytes")
          else as_tensor(n, v) for n, v in zip(names, raw, strict=True)]
    device = ts[0].device
    for n, v, t in zip(names, raw, ts, strict=True):
        if t is not None and t.device != device and isinstance(v, torch.Tensor):
            raise ValueError(f"{n}: on device {t.device}, but latent_tokens is on {device}; "
                             f"move it with .to({str(device)!r})")
    ts = [t if t is None or t.device == device else t.to(device) for t in ts]
    x, packed, scales, sel, mix, shared = ts

    if x.dim() not in (2, 3):
        raise ValueError(f"latent_tokens: expected a 2-D tensor (n_tokens, d_in) or a 3-D "
                         f"tensor (n_tokens, top_k, d_in), got shape {tuple(x.shape)}")
    x = float_tensor("latent_tokens", x)
    n_tokens, d_in = x.shape[0], x.shape[-1]
    if d_in % GROUP:
        raise ValueError(f"latent_tokens: d_in = {d_in} must be a multiple of {GROUP} (the "
                         f"MXFP4 group size); got shape {tuple(x.shape)}")
    n_groups = d_in // GROUP

    if prepared:
        if device.type != "cpu":
            raise ValueError(f"packed_weights: a prepared expert table runs on CPU tensors, "
                             f"but latent_tokens is on {device}")
        if packed_weights.n_groups != n_groups:
            raise ValueError(f"latent_tokens: d_in = {d_in}, but the expert table's rows "
                             f"hold {packed_weights.n_groups * GROUP} elements")
        packed, n_experts, d_out = packed_weights, packed_weights.n_experts, packed_weights.d_out
    elif listed and gguf:
        packed, n_experts, d_out = check_gguf_list(packed_weights, n_groups, d_in, device)
    elif listed:
        packed, scales, n_experts, d_out = check_expert_list(packed_weights, scale_bytes,
                                                             n_groups, d_in, device)
    elif gguf:
        packed, n_experts, d_out = _check_stacked_gguf(packed, n_groups, d_in)
    else:
        packed, scales, n_experts, d_out = _check_stacked(packed, scales, n_groups, d_in)

    check_rank("selected_experts", sel, 2, "(n_tokens, top_k)")
    sel = index_tensor("selected_experts", sel)
    if sel.shape[0] != n_tokens:
        raise ValueError(f"selected_experts: expected {n_tokens} rows (n_tokens of "
                         f"latent_tokens), got shape {tuple(sel.shape)}")
    top_k = sel.shape[1]
    if x.dim() == 3 and x.shape[1] != top_k:
        raise ValueError(f"latent_tokens: per-slot latents must be (n_tokens, top_k, d_in) = "
                         f"({n_tokens}, {top_k}, {d_in}), got shape {tuple(x.shape)}")

    if mix is not None:
        mix = _float_matrix("mixture_weights", mix, (n_tokens, top_k), "(n_tokens, top_k)",
                            "to match selected_experts")
    if shared is not None:
        shared = _float_matrix("shared_output", shared, (n_tokens, d_out), "(n_tokens, d_out)",
                               "(n_tokens, d_out of packed_weights)")

    # expert ids are checked once, by the implementation that runs (the CPU driver while it
    # routes the pairs, the PyTorch path before it indexes): see check_expert_ids.  uint64
    # ids are checked here: the implementations see them as int64, where ids >= 2^63 would
    # be reported as negative numbers the caller never passed
    if sel.dtype == _UINT64:
        check_expert_ids(sel, n_experts)
    return x, packed, scales, sel, mix, shared


def _check_stacked(packed, scales, n_groups, d_in):
    check_rank("packed_weights", packed, 4, "(n_experts, d_out, n_groups, 16), or a list of "
               "per-expert tensors")
    packed = byte_tensor("packed_weights", packed)
    n_experts, d_out = packed.shape[0], packed.shape[1]
    if packed.shape[2] != n_groups or packed.shape[3] != GROUP_BYTES:
        raise ValueError(f"packed_weights: expected shape (n_experts, d_out, {n_groups}, "
                         f"{GROUP_BYTES}) for d_in = {d_in}, got {tuple(packed.shape)}"
                         f"{_gguf_hint(packed.shape)}")
    check_rank("scale_bytes", scales, 3, "(n_experts, d_out, n_groups)")
    scales = byte_tensor("scale_bytes", scales)
    if tuple(scales.shape) != (n_experts, d_out, n_groups):
        raise ValueError(f"scale_bytes: expected shape ({n_experts}, {d_out}, {n_groups}) to "
                         f"match packed_weights {tuple(packed.shape)}, got "
                         f"{tuple(scales.shape)}")
    return packed, scales, n_experts, d_out


def _check_stacked_gguf(packed, n_groups, d_in):
    """Stacked GGUF blocks (E, O, G, 17), their scale bytes inside (scale_bytes None)."""
    check_rank("packed_weights", packed, 4, f"(n_experts, d_out, n_groups, "
               f"{GGUF_BLOCK_BYTES}) GGUF blocks (scale_bytes is None), or a list of "
               f"per-expert tensors")
    packed = byte_tensor("packed_weights", packed)
    if packed.shape[2] != n_groups or packed.shape[3] != GGUF_BLOCK_BYTES:
        hint = " (16 bytes per group: pass their scale_bytes)" \
            if packed.shape[3] == GROUP_BYTES else ""
        raise ValueError(f"packed_weights: scale_bytes is None, so packed_weights holds GGUF "
                         f"block_mxfp4 blocks: expected shape (n_experts, d_out, {n_groups}, "
                         f"{GGUF_BLOCK_BYTES}) for d_in = {d_in}, got "
                         f"{tuple(packed.shape)}{hint}")
    return packed, packed.shape[0], packed.shape[1]


def _float_matrix(name, t, shape, dims, why):
    """A 2-D float tensor of exactly ``shape`` (integers promoted)."""
    check_rank(name, t, 2, dims)
    t = float_tensor(name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} {why}, got {tuple(t.shape)}")
    return t


def expert_id_error(bad, n_experts):
    """The error for an expert id outside [0, n_experts), wherever it is found."""
    return IndexError(f"selected_experts: expert id {bad} is outside [0, {n_experts}) "
                      f"(n_experts of packed_weights)")


def check_expert_ids(sel, n_experts):
    """IndexError unless every id lies in [0, n_experts): before the PyTorch path indexes.
    (The CPU driver checks while it routes the pairs: one scan either way.)  Meta tensors
    hold no values: nothing to check."""
    if sel.numel() and not sel.is_meta:
        lo, hi = _min_max(sel)
        if lo < 0 or hi >= n_experts:
            raise expert_id_error(lo if lo < 0 else hi, n_experts)
