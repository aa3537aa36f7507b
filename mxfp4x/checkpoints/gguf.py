"""GGUF files (llama.cpp, Ollama, LM Studio), read in place: the header parsed as hostile
input, the tensors handed out as views of a memory mapping of the file.

The container (GGUF v2 and v3, little-endian; the format as ggml's ``docs/gguf.md``
describes it and the ``gguf`` package's ``GGUFReader``/``GGUFWriter`` and ggml's
``gguf.cpp`` read and write it)::

    "GGUF"  u32 version  u64 n_tensors  u64 n_kv
    n_kv times:       string key, u32 value type, value
    n_tensors times:  string name, u32 n_dims, u64 ne[n_dims] (fastest first),
                      u32 ggml type, u64 offset (relative to the data section)
    padding to the alignment, then the data section

A string is a u64 byte count and UTF-8 bytes; an array value is a u32 element type, a
u64 count and the elements (arrays may nest).  The alignment is the ``general.alignment``
key (a u32, a power of two; default 32); every tensor offset is a multiple of it.
``ne[0]`` is the fastest-varying dimension, so a GGUF tensor of ``ne = [d_in, d_out,
n_experts]`` is our row-major ``(n_experts, d_out, d_in)``.  A quantized type stores
``ne[0] / block_size`` blocks of ``type_size`` bytes per row (``GGML_TYPES``).

MXFP4 is GGML type 39 (``gguf.GGMLQuantizationType.MXFP4``): blocks of 32 weights in 17
bytes, ``struct block_mxfp4 { uint8 e; uint8 qs[16]; }``, the E8M0 scale byte first,
then element j in the low nibble of ``qs[j]`` and element j + 16 in its high nibble (not
the 2j / 2j + 1 of gpt-oss's safetensors).  :meth:`GGUFFile.get` hands such a tensor out
as uint8 ``(..., d_out, n_groups, 17)``, a view of the mapped file: what
``mxfp4x.mxfp4_experts(x, blocks, None, ...)`` takes.  An expert-stacked tensor
(``blk.{L}.ffn_{gate,up,down}_exps.weight``) is ``(n_experts, d_out, n_groups, 17)``, and
:meth:`GGUFFile.get_rows` maps just some experts' bytes.  Dense tensors come out as
views too (F32, F16, BF16, F64, I8..I64); other quantized types (Q8_0, the K-quants...)
are dequantized once by the ``gguf`` package (``pip install gguf``), an optional import.

Split files (``name-00001-of-00003.gguf``, as ``llama-gguf-split`` and ``GGUFWriter``
write them) open as one :class:`GGUFCheckpoint`: every file carries ``split.no``
(0-based), ``split.count`` and ``split.tensors.count`` (the total over the files;
``gguf.Keys.Split``), and the first holds the model's metadata.

Files are untrusted input.  Every number is an exact Python int, every count and length
is checked against the bytes left in the file before anything proportional to it is
allocated, arrays nest at most ``MAX_ARRAY_DEPTH`` deep, keys and tensor names are unique,
every tensor's byte range lies inside the data section and overlaps no other, and every
read is bounded by its own tensor's range.  A header costs memory in proportion to its
bytes, whatever it holds: arrays of numbers are numpy arrays, arrays of strings or of
arrays are a :class:`GGUFList` (their bytes and an offset per element, each element
decoded when read), and a header declares at most ``MAX_KEYS`` key-value pairs and
``MAX_TENSORS`` tensors (the caps, beside ggml's own limits, are the constants below).
A malformed file is a ``ValueError`` naming the file and the key or tensor.  Only regular
files are opened (symbolic links followed): a named pipe, a device or a folder is a
``ValueError`` naming it.  The file is opened read-only and never written.  Every call
that hands out tensors makes a new copy-on-write mapping of just their bytes (as the
safetensors reader does): a tensor is a view of the file's pages, and a write to it
copies the page it touches for that call's tensors alone.  Each call checks the file's
size then: a file truncated after it was opened is a ``ValueError``.  A file truncated
or rewritten in place while tensors already handed out are in use cannot be guarded
against (a bus error, or changed numbers): replace a model's file by renaming a new one
over it.
"""
import io
import math
import operator
import os
import re
import struct
from array import array
from types import MappingProxyType
from typing import (
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    Union,
    overload,
)

import numpy as np
import torch

from .._format import E2M1_TABLE, E8M0_BIAS, E8M0_NAN, GROUP
from ._files import MappedFile, _short, check_regular_file, open_regular_file

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
ARCHITECTURE_KEY = "general.architecture"
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$")

# What a header may declare, all in one place (docs/gguf.md and docs/guarantees.md quote
# them).  ggml's limits (GGML_MAX_DIMS, GGML_MAX_NAME: a name and its NUL in 64 bytes):
MAX_DIMS = 4
MAX_NAME_BYTES = 63
MAX_KEY_BYTES = 65535
# a chat template or a token is kilobytes: a longer string is not a model's
MAX_STRING_BYTES = 1 << 24
# ggml reads no nested arrays; the gguf package does: a few levels, never recursion
# as deep as a hostile file asks
MAX_ARRAY_DEPTH = 4
# llama.cpp's converters write a few dozen keys (a tokenizer's vocabulary, scores and
# merges are one key each, however long), and stack each layer's experts in one tensor
# per projection: the largest MoE files hold about a thousand tensors (DeepSeek-V3, Kimi
# K2), and one tensor per expert of Kimi K3 (896 experts, 3 projections, every
# layer) would be ~250,000.  Each key costs ~0.1 KiB and each tensor ~0.3 KiB of memory
# beyond its bytes: at most ~6 MiB and ~300 MiB, whatever the file
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 20
# torch and numpy index with signed 64-bit strides (ggml's ne are int64 too)
_MAX_INDEX = 2 ** 63

MXFP4 = 39
MXFP4_BLOCK_BYTES = 17


class GGMLType(NamedTuple):
    name: str
    block_size: int   # elements per block
    type_size: int    # bytes per block


# the ggml types a GGUF file may hold, by id (ggml.h's ggml_type; gguf.constants'
# GGMLQuantizationType and GGML_QUANT_SIZES): ids 4, 5 and 31-33, 36-38 were removed
GGML_TYPES: Dict[int, GGMLType] = {t[0]: GGMLType(*t[1:]) for t in [
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22), (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110), (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210), (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74), (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136), (24, "I8", 1, 1), (25, "I16", 1, 2),
    (26, "I32", 1, 4), (27, "I64", 1, 8), (28, "F64", 1, 8), (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54), (35, "TQ2_0", 256, 66),
    (MXFP4, "MXFP4", GROUP, MXFP4_BLOCK_BYTES), (40, "NVFP4", 64, 36), (41, "Q1_0", 128, 18),
]}
# the types a tensor is a view of (no decoding): numpy dtype, and the torch dtype to view
# it as where numpy has none
_VIEW_TYPES: Dict[int, Tuple[Any, Optional[torch.dtype]]] = {
    0: (np.float32, None), 1: (np.float16, None), 28: (np.float64, None),
    24: (np.int8, None), 25: (np.int16, None), 26: (np.int32, None), 27: (np.int64, None),
    30: (np.int16, torch.bfloat16)}

# GGUF metadata value types (gguf.constants.GGUFValueType): scalars by struct format
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL = range(8)
_STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = 8, 9, 10, 11, 12
VALUE_TYPES = {_UINT8: "UINT8", _INT8: "INT8", _UINT16: "UINT16", _INT16: "INT16",
               _UINT32: "UINT32", _INT32: "INT32", _FLOAT32: "FLOAT32", _BOOL: "BOOL",
               _STRING: "STRING", _ARRAY: "ARRAY", _UINT64: "UINT64", _INT64: "INT64",
               _FLOAT64: "FLOAT64"}
_SCALAR = {_UINT8: "<u1", _INT8: "<i1", _UINT16: "<u2", _INT16: "<i2", _UINT32: "<u4",
           _INT32: "<i4", _FLOAT32: "<f4", _BOOL: "<u1", _UINT64: "<u8", _INT64: "<i8",
           _FLOAT64: "<f8"}
_STRUCT = {t: struct.Struct("<" + c) for t, c in zip(
    (_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _UINT64, _INT64,
     _FLOAT64), "BbHhIifBQqd", strict=True)}
_INTEGER_TYPES = (_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _UINT64, _INT64)
_MIN_VALUE_BYTES = {**{t: np.dtype(f).itemsize for t, f in _SCALAR.items()},
                    _STRING: 8, _ARRAY: 12}

_CHUNK = 1 << 20
_TYPE_COUNT = struct.Struct("<IQ")  # an array's head; also a tensor info's type and offset
_PLAIN_ITEMSIZE = {t: np.dtype(f).itemsize for t, f in _SCALAR.items() if t != _BOOL}


class GGUFTensorInfo(NamedTuple):
    """One tensor of a GGUF file, as checked: ``shape`` in row-major order (the reverse
    of GGUF's ``ne``), ``begin``/``end`` absolute offsets of its bytes in ``path``."""

    name: str
    ggml_type: int
    shape: Tuple[int, ...]
    begin: int
    end: int
    path: str

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    @property
    def n_bytes(self) -> int:
        return self.end - self.begin

    @property
    def byte_shape(self) -> Tuple[int, ...]:
        """The bytes as an array: the shape for a dense type (elements of its size), and
        ``shape[:-1] + (blocks per row, type_size)`` for a block type (for MXFP4
        ``(..., d_out, n_groups, 17)``)."""
        t = GGML_TYPES[self.ggml_type]
        if t.block_size == 1:
            return self.shape
        rows = self.shape[:-1] if self.shape else ()
        last = self.shape[-1] if self.shape else 1
        return rows + (last // t.block_size, t.type_size)

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of the first dimension (one expert of a stacked tensor):
        exact for every dense tensor, and for a block type's of at least two dimensions
        (0 for a 1-D one, whose elements share their blocks)."""
        t = GGML_TYPES[self.ggml_type]
        if not self.shape:
            return self.n_bytes
        if t.block_size > 1 and len(self.shape) < 2:
            return 0
        return math.prod(self.shape[1:]) // t.block_size * t.type_size


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"{path}: {what}")


class _Cursor:
    """Sequential reads of a file's header: every read is checked against the bytes
    left in the file before anything is read or allocated.  The bytes of a stretch of
    the header can be kept as they are read (:meth:`record`, :meth:`recorded`)."""

    def __init__(self, fh, path: str, size: int):
        self.fh, self.path, self.size = fh, path, size
        self.pos = 0
        self._buf = b""
        self._buf_at = 0
        self._rec_from: Optional[int] = None  # recording: the first byte not yet kept
        self._rec = bytearray()

    def _fill(self, n: int, what: str) -> None:
        """The buffer from ``pos`` on, at least ``n`` bytes (which the file holds)."""
        if self._rec_from is not None:  # keep what the old buffer holds of the stretch
            self._rec += memoryview(self._buf)[self._rec_from - self._buf_at:
                                               self.pos - self._buf_at]
            self._rec_from = self.pos
        self.fh.seek(self.pos)
        self._buf = self.fh.read(max(n, min(_CHUNK, self.size - self.pos)))
        self._buf_at = self.pos
        if len(self._buf) < n:
            raise _bad(self.path, f"{what}: the file shrank while it was read")

    def take(self, n: int, what: str) -> memoryview:
        if n > self.size - self.pos:
            raise _bad(self.path, f"{what}: needs {n} bytes at offset {self.pos}, the file "
                                  f"ends at {self.size} (truncated or not a GGUF file)")
        lo = self.pos - self._buf_at
        if lo + n > len(self._buf):
            self._fill(n, what)
            lo = 0
        self.pos += n
        return memoryview(self._buf)[lo:lo + n]

    def window(self, n: int, what: str) -> Tuple[bytes, int]:
        """(the buffer, where ``pos`` is in it), the buffer holding at least ``n`` bytes
        from ``pos`` or all that the file has left."""
        n = min(n, self.size - self.pos)
        lo = self.pos - self._buf_at
        if lo + n > len(self._buf):
            self._fill(n, what)
            lo = 0
        return self._buf, lo

    def record(self) -> None:
        """Keep the bytes read from here on, until :meth:`recorded`."""
        self._rec_from, self._rec = self.pos, bytearray()

    def recorded(self) -> bytearray:
        """The bytes read since :meth:`record`, a copy made as they were read (no buffer
        stays alive for them, and no second copy of them all is made)."""
        assert self._rec_from is not None
        out = self._rec
        out += memoryview(self._buf)[self._rec_from - self._buf_at:self.pos - self._buf_at]
        self._rec_from, self._rec = None, bytearray()
        return out

    def scalar(self, vtype: int, what: str):
        unpack = _STRUCT[vtype]
        (value,) = unpack.unpack(self.take(unpack.size, what))
        if vtype == _BOOL:
            if value not in (0, 1):
                raise _bad(self.path, f"{what}: a bool of value {value} (expected 0 or 1)")
            return bool(value)
        return value

    def u32(self, what: str) -> int:
        return self.scalar(_UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(_UINT64, what)

    def raw_string(self, what: str, limit: int = MAX_STRING_BYTES) -> memoryview:
        n = self.u64(f"{what} (its length)")
        if n > limit:
            raise _bad(self.path, f"{what}: a string of {n} bytes (at most {limit})")
        return self.take(n, what)

    def text(self, what: str, limit: int) -> str:
        raw = bytes(self.raw_string(what, limit))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(self.path, f"{what}: not UTF-8: {_short.repr(raw)}") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """A metadata value: a Python scalar, a str (``bytes`` where it is not UTF-8: a
        tokenizer's token may not be), a read-only numpy array of numbers, or a
        :class:`GGUFList` of strings or arrays."""
        if vtype in _SCALAR:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return _decoded(bytes(self.raw_string(what)))
        if vtype != _ARRAY:
            raise _bad(self.path, f"{what}: unknown value type {vtype}")
        etype, count = self._array_head(what, depth)
        if etype in _SCALAR:
            return self._numbers(etype, count, what)
        # strings or arrays: their bytes and where each element starts, nothing per element
        self.record()
        starts = self._walk(etype, count, what, depth)
        return GGUFList(etype, self.recorded(), starts, self.path, what, depth)

    def _array_head(self, what: str, depth: int) -> Tuple[int, int]:
        """An array's element type and count, the count checked against the bytes left:
        a hostile count fails here, before any allocation proportional to it."""
        if depth >= MAX_ARRAY_DEPTH:
            raise _bad(self.path, f"{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype = self.u32(f"{what} (its element type)")
        if etype not in VALUE_TYPES:
            raise _bad(self.path, f"{what}: an array of unknown value type {etype}")
        count = self.u64(f"{what} (its length)")
        if count * _MIN_VALUE_BYTES[etype] > self.size - self.pos:
            raise _bad(self.path, f"{what}: an array of {count} {VALUE_TYPES[etype]} "
                                  f"values does not fit in the {self.size - self.pos} bytes "
                                  f"left in the file")
        return etype, count

    def _numbers(self, etype: int, count: int, what: str, keep: bool = True):
        """An array of ``count`` numbers as a read-only numpy array in native order (its
        bools checked); ``keep`` False: only checked."""
        fmt = _SCALAR[etype]
        arr = np.frombuffer(self.take(count * np.dtype(fmt).itemsize, what), dtype=fmt)
        if etype == _BOOL:
            if arr.size and arr.max() > 1:
                raise _bad(self.path, f"{what}: a bool array holds values other than 0 and 1")
            arr = arr.astype(np.bool_) if keep else arr
        elif keep:
            arr = arr.astype(arr.dtype.newbyteorder("="))  # a copy, native order
        arr.flags.writeable = False
        return arr

    def _walk(self, etype: int, count: int, what: str, depth: int) -> np.ndarray:
        """Over ``count`` strings or arrays, every length checked as :meth:`value` would,
        nothing kept but where each element starts (from the first, and where the last
        ends: ``count + 1`` offsets)."""
        base = self.pos
        # 4 bytes an offset wherever the rest of the file is shorter than 4 GiB
        starts = array("I" if self.size - base < 1 << 32 else "q")
        append = starts.append
        if etype == _STRING:  # a tokenizer's hundreds of thousands: read in the buffer
            unpack = _STRUCT[_UINT64].unpack_from
            for i in range(count):
                append(self.pos - base)
                lo = self.pos - self._buf_at
                buf = self._buf
                if lo + 8 <= len(buf):
                    (n,) = unpack(buf, lo)
                    if n <= MAX_STRING_BYTES and lo + 8 + n <= len(buf):
                        self.pos += 8 + n
                        continue
                self.raw_string(f"{what}[{i}]")  # across the buffer's end, or refused
        else:
            head = _TYPE_COUNT.unpack_from
            for i in range(count):
                append(self.pos - base)
                lo = self.pos - self._buf_at
                buf = self._buf
                if lo + 12 <= len(buf) and depth + 1 < MAX_ARRAY_DEPTH:
                    inner, n = head(buf, lo)
                    size = _PLAIN_ITEMSIZE.get(inner, 0)  # numbers with nothing to check
                    if size and lo + 12 + n * size <= len(buf):
                        self.pos += 12 + n * size
                        continue
                where = f"{what}[{i}]"  # the slow way, each refusal with its message
                inner, n = self._array_head(where, depth + 1)
                if inner in _SCALAR:
                    self._numbers(inner, n, where, keep=False)
                else:
                    self._walk(inner, n, where, depth + 1)
        append(self.pos - base)
        out = np.frombuffer(starts, dtype=np.uint32 if starts.typecode == "I" else np.int64)
        out.flags.writeable = False
        return out


def _decoded(raw: bytes) -> Union[str, bytes]:
    """A string value: UTF-8 decoded, or its bytes where it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(a == b)


class GGUFList(Sequence[Any]):
    """A metadata array of strings or of arrays (``element_type``, a GGUF value type
    id): held as its bytes in the file and one offset per element, never a Python object
    per element (a tokenizer's 200,000 tokens take about their bytes plus 8 each), each
    element decoded when read as a metadata value is: a str (``bytes`` where it is not
    UTF-8), a read-only numpy array of numbers, or another ``GGUFList``.  Every length in
    it was checked when the file was opened.  Equal to a list or tuple of the same
    elements; ``tolist()`` decodes them all."""

    __slots__ = ("element_type", "_raw", "_starts", "_path", "_what", "_depth")

    def __init__(self, element_type: int, raw: bytearray, starts: np.ndarray, path: str,
                 what: str, depth: int):
        self.element_type = element_type
        self._raw, self._starts = raw, starts
        self._path, self._what, self._depth = path, what, depth

    def __len__(self) -> int:
        return len(self._starts) - 1

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> List[Any]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        i = operator.index(i)
        if not -n <= i < n:
            raise IndexError(f"{self._what}: index {i} of {n} elements")
        i %= n
        lo, hi = int(self._starts[i]), int(self._starts[i + 1])
        if self.element_type == _STRING:
            return _decoded(bytes(memoryview(self._raw)[lo + 8:hi]))
        cur = _Cursor(io.BytesIO(memoryview(self._raw)[lo:hi]), self._path, hi - lo)
        return cur.value(self.element_type, f"{self._what}[{i}]", self._depth + 1)

    def __iter__(self) -> Iterator[Any]:
        if self.element_type != _STRING:
            yield from (self[i] for i in range(len(self)))
            return
        raw, starts = memoryview(self._raw), self._starts.tolist()  # a vocabulary: fast
        for lo, hi in zip(starts, starts[1:], strict=False):
            yield _decoded(bytes(raw[lo + 8:hi]))

    def tolist(self) -> List[Any]:
        return [x.tolist() if isinstance(x, (np.ndarray, GGUFList)) else x for x in self]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GGUFList):
            return (self.element_type == other.element_type and self._raw == other._raw
                    and bool(np.array_equal(self._starts, other._starts)))
        if not isinstance(other, (list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(map(_equal, self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(_short.repr(self[i]) for i in range(min(n, 3)))
        return (f"GGUFList({VALUE_TYPES[self.element_type]}, {n} elements: "
                f"[{head}{', ...' if n > 3 else ''}])")


def _check_alignment(path: str, metadata: Mapping[str, Any], types: Mapping[str, int]) -> int:
    if ALIGNMENT_KEY not in metadata:
        return DEFAULT_ALIGNMENT
    value, vtype = metadata[ALIGNMENT_KEY], types[ALIGNMENT_KEY]
    if vtype != _UINT32:
        raise _bad(path, f"key {ALIGNMENT_KEY!r} is a {VALUE_TYPES[vtype]}, expected a "
                         f"UINT32")
    if value <= 0 or value & (value - 1):
        raise _bad(path, f"key {ALIGNMENT_KEY!r} is {value}, expected a power of two")
    return value


def _parse(fh, path: str, size: int):
    """(version, metadata, value types, alignment, data offset, tensors) of an open
    file, every field checked."""
    cur = _Cursor(fh, path, size)
    magic = bytes(cur.take(min(4, size), "the magic"))
    if magic != MAGIC:
        raise _bad(path, f"not a GGUF file (it starts with {_short.repr(magic)}, not "
                         f"{MAGIC!r})")
    version = cur.u32("the version")
    if version not in VERSIONS:
        if version & 0xFFFF == 0 and (version >> 24) in VERSIONS:
            raise _bad(path, f"a big-endian GGUF file (version {version >> 24}): only "
                             f"little-endian files are read")
        raise _bad(path, f"GGUF version {version}, expected one of {list(VERSIONS)}")
    n_tensors = cur.u64("the tensor count")
    n_kv = cur.u64("the key-value count")
    if n_tensors > MAX_TENSORS:
        raise _bad(path, f"{n_tensors} tensors, more than the cap of {MAX_TENSORS} "
                         f"(gguf.MAX_TENSORS)")
    if n_kv > MAX_KEYS:
        raise _bad(path, f"{n_kv} key-value pairs, more than the cap of {MAX_KEYS} "
                         f"(gguf.MAX_KEYS)")
    # at least 14 bytes per key-value (key length, a 1-byte key, type, a 1-byte value) and
    # 25 per tensor (name length, a 1-byte name, n_dims, type, offset)
    if n_kv * 14 + n_tensors * 25 > size - cur.pos:
        raise _bad(path, f"{n_tensors} tensors and {n_kv} key-value pairs cannot fit in a "
                         f"file of {size} bytes")
    metadata: Dict[str, Any] = {}
    types: Dict[str, int] = {}
    for i in range(n_kv):
        key = cur.text(f"key {i}", MAX_KEY_BYTES)
        what = f"key {_short.repr(key)}"
        if key in metadata:
            raise _bad(path, f"{what} appears twice")
        vtype = cur.u32(f"{what} (its type)")
        if vtype not in VALUE_TYPES:
            raise _bad(path, f"{what}: unknown value type {vtype}")
        metadata[key] = cur.value(vtype, what)
        types[key] = vtype
    alignment = _check_alignment(path, metadata, types)
    if ARCHITECTURE_KEY in metadata and types[ARCHITECTURE_KEY] != _STRING:
        raise _bad(path, f"key {ARCHITECTURE_KEY!r} is a {VALUE_TYPES[types[ARCHITECTURE_KEY]]}"
                         f", expected a STRING")
    # the infos, compactly: names (in order, each once; their infos once the data
    # section's start is known), per tensor its dimension count, dimensions, type and
    # offset in typed arrays (no Python object per number)
    tensors: Dict[str, Any] = {}
    n_dims, dims, ggml_types, offsets = array("B"), array("Q"), array("I"), array("Q")
    for i in range(n_tensors):
        name, ne, ggml_type, offset = _tensor_info(cur, i)
        if name in tensors:
            raise _bad(path, f"tensor {_short.repr(name)} appears twice")
        tensors[name] = None
        n_dims.append(len(ne))
        dims.extend(ne)
        ggml_types.append(ggml_type)
        offsets.append(offset)
    data_start = -(-cur.pos // alignment) * alignment
    at = 0
    for i, name in enumerate(tensors):  # values replaced, no key added: safe
        tensors[name] = _check_tensor(path, name, dims[at:at + n_dims[i]], ggml_types[i],
                                      offsets[i], alignment, data_start, size)
        at += n_dims[i]
    _check_disjoint(path, list(tensors.values()))
    return version, metadata, types, alignment, data_start, tensors


# a tensor info: name length, name, n_dims, ne[n_dims], type, offset
_INFO_MAX_BYTES = 8 + MAX_NAME_BYTES + 4 + 8 * MAX_DIMS + 4 + 8
_NE = [struct.Struct(f"<{n}Q") for n in range(MAX_DIMS + 1)]


def _tensor_info(cur: _Cursor, i: int) -> Tuple[str, Tuple[int, ...], int, int]:
    """Tensor info ``i``: (its name, ne, GGML type, offset), read in the buffer
    when the whole entry is there and plainly well formed (tens of thousands of tensors:
    no read call per field), else field by field with each refusal's own message."""
    buf, lo = cur.window(_INFO_MAX_BYTES, f"tensor {i}")
    end = len(buf)
    if lo + 8 <= end:
        (n,) = _STRUCT[_UINT64].unpack_from(buf, lo)
        at = lo + 8 + n
        if 0 < n <= MAX_NAME_BYTES and at + 4 <= end:
            (n_dims,) = _STRUCT[_UINT32].unpack_from(buf, at)
            tail = at + 4 + 8 * n_dims
            if n_dims <= MAX_DIMS and tail + 12 <= end:
                ne = _NE[n_dims].unpack_from(buf, at + 4)
                ggml_type, offset = _TYPE_COUNT.unpack_from(buf, tail)
                raw = buf[lo + 8:at]
                try:
                    name = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise _bad(cur.path, f"tensor {i}'s name: not UTF-8: "
                                         f"{_short.repr(raw)}") from None
                cur.pos += tail + 12 - lo
                return name, ne, ggml_type, offset
    name = cur.text(f"tensor {i}'s name", MAX_NAME_BYTES)
    if not name:
        raise _bad(cur.path, f"tensor {i}: an empty name")
    what = f"tensor {_short.repr(name)}"
    count = cur.u32(f"{what} (its dimension count)")
    if count > MAX_DIMS:
        raise _bad(cur.path, f"{what}: {count} dimensions (at most {MAX_DIMS})")
    ne = tuple(cur.u64(f"{what} (dimension {j})") for j in range(count))
    ggml_type = cur.u32(f"{what} (its type)")
    offset = cur.u64(f"{what} (its offset)")
    return name, ne, ggml_type, offset


def _check_tensor(path: str, name: str, ne: Sequence[int], ggml_type: int, offset: int,
                  alignment: int, data_start: int, size: int) -> GGUFTensorInfo:
    def bad(why: str) -> ValueError:
        return _bad(path, f"tensor {_short.repr(name)}: {why}")

    ne = list(ne)
    if ggml_type not in GGML_TYPES:
        raise bad(f"unknown GGML type {ggml_type}")
    t = GGML_TYPES[ggml_type]
    if ne and max(ne) >= _MAX_INDEX:
        raise bad(f"dimensions {ne} do not fit 63 bits")
    first = ne[0] if ne else 1
    if first % t.block_size:
        raise bad(f"{t.name} rows of {first} elements, not a multiple of its block of "
                  f"{t.block_size}")
    elements = math.prod(ne)
    # every stride in bytes must be indexable, also when a dimension is 0
    strided = math.prod(max(d, 1) for d in ne) if elements == 0 else elements
    if strided // t.block_size * t.type_size >= _MAX_INDEX:
        raise bad(f"dimensions {ne} too large to index")
    n_bytes = elements // t.block_size * t.type_size
    if offset % alignment:
        raise bad(f"offset {offset} is not a multiple of the alignment {alignment}")
    begin = data_start + offset
    if begin + n_bytes > size:
        raise bad(f"bytes [{begin}, {begin + n_bytes}) ({t.name} {ne}) leave the file of "
                  f"{size} bytes (data section from {data_start})")
    return GGUFTensorInfo(name, ggml_type, tuple(reversed(ne)), begin, begin + n_bytes, path)


def _check_disjoint(path: str, tensors: List[GGUFTensorInfo]) -> None:
    """No byte in two tensors (empty ones hold none): sorted by where they begin (then
    end), each must end before the next begins.  In arrays, as there may be a million."""
    held = [t for t in tensors if t.end > t.begin]
    if len(held) < 2:
        return
    begins = np.fromiter((t.begin for t in held), np.int64, len(held))  # < 2^63: checked
    ends = np.fromiter((t.end for t in held), np.int64, len(held))
    order = np.lexsort((ends, begins))
    clash = np.flatnonzero(begins[order[1:]] < ends[order[:-1]])
    if clash.size:
        first, second = held[order[clash[0]]], held[order[clash[0] + 1]]
        raise _bad(path, f"tensors {_short.repr(first.name)} and {_short.repr(second.name)} "
                         f"share bytes (from offset {second.begin})")


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


def split_files(path: str) -> List[str]:
    """The files of a split GGUF checkpoint that ``path`` (any of them) belongs to, in
    order; ``[path]`` for a file whose name is not ``stem-0000N-of-0000M.gguf``."""
    folder, fname = os.path.split(os.fspath(path))
    m = SPLIT_NAME.match(fname)
    if m is None:
        return [os.fspath(path)]
    count, no = int(m["count"]), int(m["no"])
    if not 1 <= no <= count:
        raise ValueError(f"{path}: split {no} of {count} (expected 1 to {count})")
    return [os.path.join(folder, f"{m['stem']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def _split_value(f: GGUFFile, key: str) -> Optional[int]:
    if key not in f.metadata:
        return None
    value = f.metadata[key]
    if f.value_types[key] not in _INTEGER_TYPES:
        raise ValueError(f"{f.path}: key {key!r} is a {VALUE_TYPES[f.value_types[key]]}, "
                         f"expected an integer")
    return value


class GGUFCheckpoint:
    """A GGUF model: one file, or every file of a split set (any of whose names may be
    given).  ``metadata`` and ``architecture`` are the first file's; tensors are looked
    up by name across the files."""

    def __init__(self, path: str):
        self.root = os.fspath(path)
        if not os.path.exists(self.root):
            raise FileNotFoundError(f"{self.root}: no such file")
        check_regular_file(self.root)
        paths = split_files(self.root)
        for p in paths:
            if not os.path.exists(p):
                raise ValueError(f"{self.root}: split file {os.path.basename(p)!r} of "
                                 f"{len(paths)} is missing")
            check_regular_file(p)
        self.files: List[GGUFFile] = []
        try:
            for p in paths:
                self.files.append(GGUFFile(p))
            self._check_splits()
        except BaseException:
            self.close()
            raise
        self._where: Dict[str, GGUFFile] = {}
        for f in self.files:
            for name in f.tensors:
                if name in self._where:
                    raise ValueError(f"{self.root}: tensor {name!r} is in both "
                                     f"{self._where[name].path} and {f.path}")
                self._where[name] = f
        first = self.files[0]
        self.metadata: Mapping[str, Any] = first.metadata
        self.architecture: Optional[str] = first.architecture
        self.paths: List[str] = [f.path for f in self.files]

    def _check_splits(self) -> None:
        n = len(self.files)
        total = None
        for i, f in enumerate(self.files):
            no, count = _split_value(f, SPLIT_NO), _split_value(f, SPLIT_COUNT)
            tensors = _split_value(f, SPLIT_TENSORS)
            if count is None and n == 1:
                continue
            if (no, count) != (i, n):
                raise ValueError(f"{f.path}: {SPLIT_NO} {no} and {SPLIT_COUNT} {count}, "
                                 f"expected {i} and {n} (file {i + 1} of {n}"
                                 + (", by its name)" if n > 1 else ": name it "
                                    "stem-00001-of-0000N.gguf beside its siblings)"))
            if i == 0:
                total = tensors
        if n > 1 or total is not None:
            held = sum(len(f.tensors) for f in self.files)
            if total != held:
                raise ValueError(f"{self.files[0].path}: {SPLIT_TENSORS} is {total}, the "
                                 f"{n} files hold {held} tensors")

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def _locate(self, name: str) -> GGUFFile:
        if name not in self._where:
            raise KeyError(f"{self.root}: no tensor named {name!r}")
        return self._where[name]

    def tensor(self, name: str) -> GGUFTensorInfo:
        return self._locate(name).tensor(name)

    def get(self, name: str) -> torch.Tensor:
        return self._locate(name).get(name)

    def get_raw(self, name: str) -> torch.Tensor:
        return self._locate(name).get_raw(name)

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._locate(name).get_rows(name, start, end)

    def dequantize(self, name: str) -> torch.Tensor:
        return self._locate(name).dequantize(name)

    def byte_range(self, name: str) -> Tuple[str, int, int]:
        """(file path, first byte, end byte) of a tensor's data."""
        t = self.tensor(name)
        return t.path, t.begin, t.end


def is_gguf(path: str) -> bool:
    """Whether ``path`` is a regular file that starts with the GGUF magic (a named pipe
    or a device is not opened: False)."""
    try:
        with open_regular_file(os.fspath(path)) as f:
            return f.read(4) == MAGIC
    except (OSError, ValueError):
        return False
