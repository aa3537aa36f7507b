"""Input coercion and checks.  Every error names the argument, what it got and
what was expected, and is raised before any kernel runs."""
import operator
import weakref
from typing import NamedTuple, Optional

import numpy as np
import torch

from . import _cpu, _threads
from ._format import GGUF_BLOCK_BYTES, GROUP, GROUP_BYTES, torch_e8m0_dtype

# ISA names, fixed at import: checked in plain Python, so torch.compile traces the check
_COMPILED_ISAS = tuple(_cpu.compiled_isas())
_RUNNABLE_ISAS = tuple(_cpu.runnable_isas())

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = tuple(d for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                                getattr(torch, "uint64", None)) if d is not None)


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "")


_UINT64 = getattr(torch, "uint64", None)
_WIDE_UNSIGNED = tuple(d for d in (getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                                    getattr(torch, "uint64", None)) if d is not None)


def _min_max(t):
    """(min, max) as Python ints, read back in one transfer (one device sync for GPU
    ids); torch has no min/max for uint16/32/64."""
    if t.dtype not in _WIDE_UNSIGNED:
        lo, hi = torch.stack(torch.aminmax(t)).tolist()
        return int(lo), int(hi)
    if t.element_size() < 8:
        t = t.to(torch.int64)  # exact: uint16/uint32 fit
        return int(t.min()), int(t.max())
    # uint64: its bit pattern as int64 puts values >= 2^63 below zero; report them as the
    # unsigned values they are
    v = t.view(torch.int64) if t.is_contiguous() or t.dim() == 0 else \
        t.contiguous().view(torch.int64)
    high = v < 0
    low_vals, high_vals = v[~high], v[high]
    lo = int(low_vals.min()) if low_vals.numel() else int(high_vals.min()) + 2 ** 64
    hi = int(high_vals.max()) + 2 ** 64 if high_vals.numel() else int(low_vals.max())
    return lo, hi


class _WritableView:
    """Exposes a read-only array's memory as writable to numpy (and keeps it alive)."""

    def __init__(self, arr):
        self.arr = arr
        self.__array_interface__ = dict(arr.__array_interface__, data=(arr.ctypes.data, False))


def writable_view(arr):
    """``arr`` itself, or for a read-only array (a read-only np.memmap of a checkpoint)
    a view of the same memory that torch.from_numpy accepts without its "not writable"
    warning: mxfp4x never writes to its inputs.  No warnings filter is touched, so
    this is safe from any number of threads."""
    if arr.flags.writeable:
        return arr
    return np.asarray(_WritableView(arr))


def as_tensor(name, value):
    """A torch tensor viewing (or, for lists, holding) ``value``; never a write."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # its layout reads strided too
            raise TypeError(f"{name}: expected a dense tensor, got a nested tensor; pad it "
                            f"first (.to_padded_tensor(0))")
        if value.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout "
                            f"{value.layout}; call .to_dense() first")
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected a numeric array, got a numpy array of dtype "
                            f"{value.dtype}")
        if any(s < 0 or s % value.itemsize for s in value.strides) or \
                not value.dtype.isnative:  # torch views neither (e.g. a structured field)
            value = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("="))
        try:
            return torch.from_numpy(writable_view(value))
        except TypeError:
            return torch.from_numpy(value.astype(np.int64 if value.dtype.kind in "iu"
                                                 else np.float64))
    if isinstance(value, (list, tuple)):
        try:
            return torch.tensor(value)
        except (TypeError, ValueError, RuntimeError) as exc:
            kind = ValueError if "sequence" in str(exc) else TypeError
            raise kind(f"{name}: cannot make a tensor from this {type(value).__name__} "
                       f"({exc})") from None
    raise TypeError(f"{name}: expected a torch.Tensor, a numpy array or nested lists, got "
                    f"{type(value).__name__}")


def check_rank(name, t, rank, dims):
    if t.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {dims}, got shape "
                         f"{tuple(t.shape)}")


def float_tensor(name, t, allow_int=True):
    """Float tensors pass; integer ones are promoted to the default float dtype."""
    if t.dtype in FLOAT_DTYPES:
        return t
    if allow_int and t.dtype in _INT_DTYPES:
        return t.to(torch.get_default_dtype())
    raise TypeError(f"{name}: expected a float tensor (float16, bfloat16, float32, float64"
                    f"{' or an integer tensor' if allow_int else ''}), got dtype "
                    f"{_dtype_name(t.dtype)}")


_E8M0 = torch_e8m0_dtype()


def byte_tensor(name, t):
    """uint8 passes as is; float8_e8m0fnu scales are their bytes (read by view: a cast by
    value would turn byte s into 2^(s-127)); other integer dtypes must hold values in
    [0, 255]."""
    if t.dtype == torch.uint8:
        return t
    if _E8M0 is not None and t.dtype == _E8M0:
        return t.view(torch.uint8)
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{name}: expected an integer tensor of bytes (uint8, or any integer "
                        f"dtype with values in [0, 255]), got dtype {_dtype_name(t.dtype)}")
    if _compiling():
        raise TypeError(f"{name}: under torch.compile pass uint8 bytes (got dtype "
                        f"{_dtype_name(t.dtype)}): their range cannot be checked in a graph")
    if t.numel() and not t.is_meta:  # (meta tensors hold no values to check)
        lo, hi = _min_max(t)
        if lo < 0 or hi > 255:
            raise ValueError(
                f"{name}: byte values must lie in [0, 255], got values in [{lo}, {hi}] "
                f"(dtype {_dtype_name(t.dtype)}); if these are int8 bytes, pass "
                f"{name}.view(torch.uint8)")
    return t.to(torch.uint8)


def bytes_by_view(name, t):
    """A checkpoint's bytes, by view, never by value: uint8 as is, int8 and float8_e8m0fnu
    viewed as uint8 (a file typed I8 or F8_E8M0 holds the same bytes).  The op's rule
    (:func:`byte_tensor`) differs on purpose: a caller's int8 tensor there holds values,
    and a negative one is an error, not a byte."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.int8 or (_E8M0 is not None and t.dtype == _E8M0):
        return t.view(torch.uint8)
    raise TypeError(f"{name}: expected bytes (U8, I8 or F8_E8M0), got {t.dtype}")


def index_tensor(name, t):
    if t.dtype not in _INT_DTYPES or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor (int32 or int64) of expert ids, "
                        f"got dtype {_dtype_name(t.dtype)}")
    return t


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
    listed = is_expert_list(packed_weights)
    gguf = scale_bytes is None
    ts = [None if v is SKIP or (listed and n in ("packed_weights", "scale_bytes")) or
          (gguf and n == "scale_bytes") else as_tensor(n, v)
          for n, v in zip(names, raw, strict=True)]
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

    if listed and gguf:
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


def _compiling():
    return torch.compiler.is_compiling()


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


_RANGE_LIMIT = 2 ** 62


class WeakGroup:
    """A ``group`` attribute (a torch.distributed process group, or None) held by a weak
    reference.  An object that outlives ``destroy_process_group()`` (a model kept to the
    end of a script) would otherwise keep the group to the end of the process, and gloo's
    group destroyed that late aborted the process at exit ("terminate called without an
    active exception", 4 runs in 10); torch's own registry keeps a live group alive."""

    def __set_name__(self, owner, name):
        self.key = f"_{name}_ref"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        ref = obj.__dict__.get(self.key)
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError("group: the torch.distributed process group this was built "
                               "with was destroyed (destroy_process_group); build it again "
                               "with a live group")
        return group

    def __set__(self, obj, value):
        try:
            obj.__dict__[self.key] = None if value is None else weakref.ref(value)
        except TypeError:
            raise TypeError(f"group: expected a torch.distributed process group or None, "
                            f"got {type(value).__name__}") from None


class ExpertRange(NamedTuple):
    """A parsed ``expert_range``: the experts e0..e1-1, Python ints, 0 <= e0 <= e1.  A
    tuple, so it compares equal to ``(e0, e1)``; :func:`parse_expert_range` returns it,
    and takes it back as it is (a load parses what the user gave once, and hands this on
    to every step)."""
    e0: int
    e1: int


def parse_expert_range(expert_range) -> ExpertRange:
    """``expert_range`` as (e0, e1), Python ints with 0 <= e0 <= e1 <= 2^62 (larger cannot
    be real, and fits int64), from a pair or a range of step 1: the one reading of the
    held experts, for the ops, the modules and their loaders.  A TypeError or ValueError
    naming ``expert_range`` otherwise."""
    if isinstance(expert_range, ExpertRange):
        return expert_range
    if isinstance(expert_range, range):
        if expert_range.step != 1:
            raise ValueError(f"expert_range: expected a range of step 1, got {expert_range}")
        expert_range = (expert_range.start, expert_range.stop)
    if isinstance(expert_range, (str, bytes)) or not hasattr(expert_range, "__iter__"):
        raise TypeError(f"expert_range: expected a pair of ints (e0, e1) or a range, got "
                        f"{type(expert_range).__name__}")
    values = list(expert_range)
    if len(values) != 2:
        raise ValueError(f"expert_range: expected a pair of ints (e0, e1), got {len(values)} "
                         f"values")
    try:
        if any(isinstance(v, bool) for v in values):
            raise TypeError
        e0, e1 = (operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"expert_range: expected a pair of ints (e0, e1), got "
                        f"{tuple(type(v).__name__ for v in values)}") from None
    if not 0 <= e0 <= e1 <= _RANGE_LIMIT:
        raise ValueError(f"expert_range: expected (e0, e1) with 0 <= e0 <= e1, got "
                         f"{(e0, e1)}")
    return ExpertRange(e0, e1)


def check_range_within(expert_range: ExpertRange, n_experts: int, what: str) -> None:
    """A ValueError naming ``expert_range`` when it passes the ``n_experts`` experts
    ``what`` holds (before a read of rows that are not there)."""
    if expert_range.e1 > n_experts:
        raise ValueError(f"expert_range: {tuple(expert_range)} passes the {n_experts} "
                         f"experts of {what}")


def check_isa(isa, name="isa"):
    """None (the default ISA) or the name of an ISA this CPU runs; ValueError otherwise."""
    if isa is None:
        return None
    if not isinstance(isa, str) or isa not in _COMPILED_ISAS:
        raise ValueError(f"{name}={isa!r} is not an ISA of mxfp4x; choose one of "
                         f"{list(_RUNNABLE_ISAS)} (compiled: {list(_COMPILED_ISAS)})")
    if isa not in _RUNNABLE_ISAS:
        raise ValueError(f"{name}={isa!r}: this CPU (or OS) cannot run {isa}; choose one of "
                         f"{list(_RUNNABLE_ISAS)}")
    return isa


def num_threads_arg(num_threads) -> Optional[int]:
    """The one rule for a ``num_threads`` the user gives, to an op, a module or a loader:
    None (torch.get_num_threads() when a call runs) or a positive int (numpy integers
    too), returned as a Python int.  A bool, a float (even 2.0) or a string is a
    TypeError, 0 or less a ValueError, each naming ``num_threads``."""
    if num_threads is None:
        return None
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)):
        raise TypeError(f"num_threads: expected None or a positive int, got "
                        f"{type(num_threads).__name__} {num_threads!r}")
    if num_threads < 1:
        raise ValueError(f"num_threads: expected None or a positive int, got {num_threads}")
    return int(num_threads)


def check_num_threads(num_threads):
    """:func:`num_threads_arg`, capped as mxfp4x._threads caps it (a larger request is
    accepted), or 0 for "torch.get_num_threads() when the kernel runs"."""
    n = num_threads_arg(num_threads)
    return 0 if n is None else _threads.resolve(n)


class NumThreads:
    """A module's ``num_threads`` attribute, checked by :func:`num_threads_arg` whenever it
    is set (in the constructor and afterwards), so a bad count is refused where it is
    given, not at the first forward after a model of many GB has loaded.  Reads give None
    or a Python int."""

    def __set_name__(self, owner, name):
        self.key = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.__dict__.get(self.key)

    def __set__(self, obj, value):
        obj.__dict__[self.key] = num_threads_arg(value)
