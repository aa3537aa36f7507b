"""One argument as the tensor it must be: what a user passes (a tensor, a numpy array,
nested lists) as a torch tensor, never written to, and the dtype rules (floats, bytes,
expert ids).  Every error names the argument, what it got and what was expected."""
import numpy as np
import torch

from .format import torch_e8m0_dtype

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


def _compiling():
    return torch.compiler.is_compiling()
