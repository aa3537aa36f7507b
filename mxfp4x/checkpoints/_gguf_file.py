"""One GGUF file (:class:`GGUFFile`): its header checked when it is opened, and its
tensors handed out as views of a new private mapping of just their bytes: MXFP4 as its
blocks, dense types as themselves, other block types dequantized by the ``gguf``
package."""
import operator
import os
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Optional, Tuple

import numpy as np
import torch

from .._core.format import E2M1_TABLE, E8M0_BIAS, E8M0_NAN, GROUP
from ._files import MappedFile, open_regular_file
from ._gguf_format import (
    _VIEW_TYPES,
    ARCHITECTURE_KEY,
    GGML_TYPES,
    MAGIC,
    MXFP4,
    MXFP4_BLOCK_BYTES,
    GGUFTensorInfo,
)
from ._gguf_header import _parse


def _gguf_package():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGML quantized types other than MXFP4 needs the gguf "
                          "package: pip install gguf") from None
    return gguf


def decode_mxfp4_blocks(blocks: np.ndarray) -> np.ndarray:
    """GGUF MXFP4 blocks uint8 ``(..., n_groups, 17)`` as float32 ``(..., n_groups * 32)``
    under mxfp4x's rule: 2^(s - 127) times the E2M1 value, scale byte 255 NaN (ggml
    reads it as 2^127).  Element j is the low nibble of byte 1 + j, element j + 16 its
    high nibble."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    if blocks.ndim < 1 or blocks.shape[-1] != MXFP4_BLOCK_BYTES:
        raise ValueError(f"blocks: expected uint8 (..., n_groups, 17), got "
                         f"{blocks.shape}")
    scale = np.ldexp(1.0, blocks[..., :1].astype(np.int64) - E8M0_BIAS)
    scale = np.where(blocks[..., :1] == E8M0_NAN, np.nan, scale)
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    with np.errstate(over="ignore"):  # exact, or inf past float32's range (as a kernel)
        values = (E2M1_TABLE[codes] * scale).astype(np.float32)
    if blocks.ndim == 1:
        return values
    return values.reshape(blocks.shape[:-2] + (blocks.shape[-2] * GROUP,))


class GGUFFile(MappedFile):
    """Read access to one .gguf file.

    ``metadata`` (key -> value: an int, float, bool or str (``bytes`` where a string is
    not UTF-8), a read-only numpy array for an array of numbers, a :class:`GGUFList` for
    an array of strings or of arrays), ``value_types`` (key -> GGUF value type id),
    ``architecture`` (``general.architecture`` or None), ``tensors`` (name ->
    :class:`GGUFTensorInfo`, in the file's order).  ``get`` returns zero-copy tensors
    (dequantized ones for block types other than MXFP4), each call its own copy-on-write
    mapping (a write to one never reaches another).  The file stays open until
    :meth:`close`: every mapping is of the file whose header was checked, even if the
    path is replaced."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        version, metadata, types, alignment, data_start, tensors = self._open(_parse)
        self.version: int = version
        self.alignment: int = alignment
        self.data_offset: int = data_start
        self.metadata: Mapping[str, Any] = MappingProxyType(metadata)
        self.value_types: Mapping[str, int] = MappingProxyType(types)
        self.tensors: Mapping[str, GGUFTensorInfo] = MappingProxyType(tensors)
        arch = metadata.get(ARCHITECTURE_KEY)
        self.architecture: Optional[str] = arch if isinstance(arch, str) else None

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> GGUFTensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return self.tensors[name]

    def byte_range(self, name: str) -> Tuple[int, int]:
        """[first byte, end byte) of a tensor's data in the file."""
        t = self.tensor(name)
        return t.begin, t.end

    def get(self, name: str) -> torch.Tensor:
        """A tensor: MXFP4 as its blocks, uint8 ``(..., d_out, n_groups, 17)``, and dense
        types as themselves, both views of a new copy-on-write mapping of just its bytes
        (the caller's own: writes to it are seen by no other call's tensors); other
        block types dequantized to float32 (a copy)."""
        t = self._readable(name)
        mapped = self._map(t.begin, t.end, [name]) if t.n_bytes else None
        return self._typed(t, self._view(t, mapped, t.begin, None))

    def get_raw(self, name: str) -> torch.Tensor:
        """A tensor's bytes, uint8 ``byte_shape`` (for MXFP4 ``(..., n_groups, 17)``;
        a dense type's elements as their bytes, a trailing dimension of the item size),
        a view of a new mapping of just those bytes."""
        t = self._readable(name)
        mapped = self._map(t.begin, t.end, [name]) if t.n_bytes else None
        return self._view(t, mapped, t.begin, None)

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Indices [start, end) of a tensor's first dimension (for a stacked expert
        tensor: experts start..end-1), as :meth:`get` returns them, from a mapping of
        just their bytes."""
        t = self._readable(name)
        start, end = operator.index(start), operator.index(end)
        if not _has_rows(t) or not 0 <= start <= end <= t.shape[0]:
            raise ValueError(f"{self.path}: rows [{start}, {end}) of {name!r} "
                             f"({t.type_name} {list(t.shape)})")
        lo, hi = t.begin + start * t.row_bytes, t.begin + end * t.row_bytes
        mapped = self._map(lo, hi, [name]) if hi > lo else None
        return self._typed(t, self._view(t, mapped, lo, (start, end)))

    def dequantize(self, name: str) -> torch.Tensor:
        """A tensor's values as float32 in its row-major shape (a copy).  MXFP4 under
        mxfp4x's rule (:func:`decode_mxfp4_blocks`: scale byte 255 is NaN); other block
        types through the gguf package."""
        t = self._readable(name)
        if t.ggml_type == MXFP4:
            raw = self.get_raw(name).numpy()
            return torch.from_numpy(decode_mxfp4_blocks(raw).reshape(t.shape))
        return self.get(name).to(torch.float32)

    def _readable(self, name: str) -> GGUFTensorInfo:
        """The tensor about to be read (the file must still be open)."""
        self._check_open()
        return self.tensor(name)

    def _view(self, t: GGUFTensorInfo, mapped: Optional[np.ndarray], mapped_at: int,
              rows: Optional[Tuple[int, int]]) -> torch.Tensor:
        """Rows [start, end) of tensor ``t``'s first dimension (``rows`` None: all of
        it) as uint8, whole rows of its ``byte_shape`` (plus the item size of a dense
        type); ``mapped`` holds file bytes from ``mapped_at``.  The range is checked
        here, where bytes are read, whatever the caller computed."""
        shape = t.byte_shape
        if rows is None:
            begin, end = t.begin, t.end
        else:
            start, stop = rows
            if not (_has_rows(t) and 0 <= start <= stop <= t.shape[0]):
                raise ValueError(f"{self.path}: tensor {t.name!r}: rows [{start}, {stop}) "
                                 f"of {list(t.shape)}")
            begin, end = t.begin + start * t.row_bytes, t.begin + stop * t.row_bytes
            shape = (stop - start,) + shape[1:]
        lo, hi = begin - mapped_at, end - mapped_at
        if not (t.begin <= begin <= end <= t.end and (begin == end or (
                mapped is not None and 0 <= lo and hi <= len(mapped)))):
            raise ValueError(f"{self.path}: tensor {t.name!r}: bytes [{begin}, {end}) leave "
                             f"its range [{t.begin}, {t.end})")
        if t.ggml_type in _VIEW_TYPES:  # a dense type: its elements' bytes
            shape = shape + (np.dtype(_VIEW_TYPES[t.ggml_type][0]).itemsize,)
        if mapped is None or begin == end:
            return torch.empty(shape, dtype=torch.uint8)
        return torch.from_numpy(mapped[lo:hi].reshape(shape))

    def _typed(self, t: GGUFTensorInfo, raw: torch.Tensor) -> torch.Tensor:
        """``raw`` (from :meth:`_view`) as :meth:`get` hands it out."""
        if t.ggml_type == MXFP4:
            return raw
        if t.ggml_type in _VIEW_TYPES:
            np_dtype, as_torch = _VIEW_TYPES[t.ggml_type]
            shape = tuple(raw.shape[:-1])
            flat = raw.numpy().reshape(-1)
            if flat.size and flat.ctypes.data % np.dtype(np_dtype).itemsize:
                flat = flat.copy()  # unaligned (an alignment below the item size): copied
            out = torch.from_numpy(flat.view(np_dtype).reshape(shape))
            return out.view(as_torch) if as_torch is not None else out
        shape = tuple(raw.shape[:-2]) + (raw.shape[-2] * GGML_TYPES[t.ggml_type].block_size,)
        if raw.numel() == 0:
            return torch.zeros(shape, dtype=torch.float32)
        gguf = _gguf_package()
        try:
            values = gguf.quants.dequantize(raw.numpy().reshape(shape[:-1] + (-1,)),
                                            gguf.GGMLQuantizationType(t.ggml_type))
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(f"{self.path}: tensor {t.name!r}: the gguf package cannot "
                             f"dequantize {t.type_name}: {exc}") from None
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


def _has_rows(t: GGUFTensorInfo) -> bool:
    """Whether a tensor's first dimension is whole bytes per index: any dense tensor of
    at least one dimension, a block type's of at least two (a 1-D block tensor's
    elements share their blocks)."""
    return len(t.shape) >= (1 if GGML_TYPES[t.ggml_type].block_size == 1 else 2)


def is_gguf(path: str) -> bool:
    """Whether ``path`` is a regular file that starts with the GGUF magic (a named pipe
    or a device is not opened: False)."""
    try:
        with open_regular_file(os.fspath(path)) as f:
            return f.read(4) == MAGIC
    except (OSError, ValueError):
        return False
