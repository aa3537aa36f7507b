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
read is bounded by its own tensor's range.  A malformed file is a ``ValueError`` naming
the file and the key or tensor.  Only regular files are opened (symbolic links
followed): a named pipe, a device or a folder is a ``ValueError`` naming it.  The file
is opened read-only and never written.  Every call that hands out tensors makes a new
copy-on-write mapping of just their bytes (as the safetensors reader does): a tensor is
a view of the file's pages, and a write to it copies the page it touches for that
call's tensors alone.  Each call checks the file's size then: a file truncated after it
was opened is a ``ValueError``.  A file truncated or rewritten in place while tensors
already handed out are in use cannot be guarded against (a bus error, or changed
numbers): replace a model's file by renaming a new one over it.
"""
import math
import operator
import os
import re
import struct
import threading
import weakref
from types import MappingProxyType
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch

from .._format import E2M1_TABLE, E8M0_BIAS, E8M0_NAN, GROUP
from ._header import MappedFile, _short, check_regular_file, open_regular_file

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
ARCHITECTURE_KEY = "general.architecture"
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>[0-9]{5})-of-(?P<count>[0-9]{5})\.gguf$")

# ggml's limits (GGML_MAX_DIMS, GGML_MAX_NAME: a name and its NUL in 64 bytes)
MAX_DIMS = 4
MAX_NAME_BYTES = 63
MAX_KEY_BYTES = 65535
# a chat template or a token is kilobytes: a longer string is not a model's
MAX_STRING_BYTES = 1 << 24
# ggml reads no nested arrays; the gguf package does: a few levels, never recursion
# as deep as a hostile file asks
MAX_ARRAY_DEPTH = 4
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
    left in the file before anything is read or allocated."""

    def __init__(self, fh, path: str, size: int):
        self.fh, self.path, self.size = fh, path, size
        self.pos = 0
        self._buf = b""
        self._buf_at = 0

    def take(self, n: int, what: str) -> memoryview:
        if n > self.size - self.pos:
            raise _bad(self.path, f"{what}: needs {n} bytes at offset {self.pos}, the file "
                                  f"ends at {self.size} (truncated or not a GGUF file)")
        lo = self.pos - self._buf_at
        if lo + n > len(self._buf):
            self.fh.seek(self.pos)
            self._buf = self.fh.read(max(n, min(_CHUNK, self.size - self.pos)))
            self._buf_at, lo = self.pos, 0
            if len(self._buf) < n:
                raise _bad(self.path, f"{what}: the file shrank while it was read")
        self.pos += n
        return memoryview(self._buf)[lo:lo + n]

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

    def raw_string(self, what: str, limit: int = MAX_STRING_BYTES) -> bytes:
        n = self.u64(f"{what} (its length)")
        if n > limit:
            raise _bad(self.path, f"{what}: a string of {n} bytes (at most {limit})")
        return bytes(self.take(n, what))

    def text(self, what: str, limit: int) -> str:
        raw = self.raw_string(what, limit)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(self.path, f"{what}: not UTF-8: {_short.repr(raw)}") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """A metadata value: a Python scalar, a str (``bytes`` where it is not UTF-8: a
        tokenizer's token may not be), a read-only numpy array of numbers, or a list of
        strings or arrays."""
        if vtype in _SCALAR:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            raw = self.raw_string(what)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return raw
        if vtype != _ARRAY:
            raise _bad(self.path, f"{what}: unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise _bad(self.path, f"{what}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        etype = self.u32(f"{what} (its element type)")
        if etype not in VALUE_TYPES:
            raise _bad(self.path, f"{what}: an array of unknown value type {etype}")
        count = self.u64(f"{what} (its length)")
        # the least bytes each element takes: a hostile count fails here, before any
        # allocation proportional to it
        if count * _MIN_VALUE_BYTES[etype] > self.size - self.pos:
            raise _bad(self.path, f"{what}: an array of {count} {VALUE_TYPES[etype]} "
                                  f"values does not fit in the {self.size - self.pos} bytes "
                                  f"left in the file")
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            arr = np.frombuffer(self.take(count * np.dtype(fmt).itemsize, what), dtype=fmt)
            if etype == _BOOL:
                if arr.size and arr.max() > 1:
                    raise _bad(self.path, f"{what}: a bool array holds values other than 0 "
                                          f"and 1")
                arr = arr.astype(np.bool_)
            else:
                arr = arr.astype(arr.dtype.newbyteorder("="))  # a copy, native order
            arr.flags.writeable = False
            return arr
        if etype == _STRING:
            return self._strings(count, what)
        return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]

    def _strings(self, count: int, what: str) -> list:
        """``count`` strings (a tokenizer's hundreds of thousands: read from the buffer
        directly, through :meth:`take` only at its end)."""
        out: List[Union[str, bytes]] = []
        unpack = _STRUCT[_UINT64].unpack_from
        for i in range(count):
            lo = self.pos - self._buf_at
            buf = self._buf
            if lo + 8 <= len(buf):
                (n,) = unpack(buf, lo)
                if n <= MAX_STRING_BYTES and lo + 8 + n <= len(buf):
                    raw = buf[lo + 8:lo + 8 + n]
                    self.pos += 8 + n
                else:
                    raw = b""
            else:
                raw = b""
                n = -1
            if n < 0 or len(raw) != n:  # across the buffer's end, or refused: the slow way
                raw = self.raw_string(f"{what}[{i}]")
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(raw)
        return out


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
    infos = []
    names = set()
    for i in range(n_tensors):
        name = cur.text(f"tensor {i}'s name", MAX_NAME_BYTES)
        what = f"tensor {_short.repr(name)}"
        if not name:
            raise _bad(path, f"tensor {i}: an empty name")
        if name in names:
            raise _bad(path, f"{what} appears twice")
        names.add(name)
        n_dims = cur.u32(f"{what} (its dimension count)")
        if n_dims > MAX_DIMS:
            raise _bad(path, f"{what}: {n_dims} dimensions (at most {MAX_DIMS})")
        ne = [cur.u64(f"{what} (dimension {j})") for j in range(n_dims)]
        ggml_type = cur.u32(f"{what} (its type)")
        offset = cur.u64(f"{what} (its offset)")
        infos.append((name, ne, ggml_type, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: Dict[str, GGUFTensorInfo] = {}
    for name, ne, ggml_type, offset in infos:
        tensors[name] = _check_tensor(path, name, ne, ggml_type, offset, alignment,
                                      data_start, size)
    _check_disjoint(path, tensors.values())
    return version, metadata, types, alignment, data_start, tensors


def _check_tensor(path: str, name: str, ne: List[int], ggml_type: int, offset: int,
                  alignment: int, data_start: int, size: int) -> GGUFTensorInfo:
    what = f"tensor {_short.repr(name)}"
    if ggml_type not in GGML_TYPES:
        raise _bad(path, f"{what}: unknown GGML type {ggml_type}")
    t = GGML_TYPES[ggml_type]
    if any(d >= _MAX_INDEX for d in ne):
        raise _bad(path, f"{what}: dimensions {ne} do not fit 63 bits")
    first = ne[0] if ne else 1
    if first % t.block_size:
        raise _bad(path, f"{what}: {t.name} rows of {first} elements, not a multiple of its "
                         f"block of {t.block_size}")
    # every stride in bytes must be indexable, also when a dimension is 0
    if math.prod(max(d, 1) for d in ne) // t.block_size * t.type_size >= _MAX_INDEX:
        raise _bad(path, f"{what}: dimensions {ne} too large to index")
    n_bytes = math.prod(ne) // t.block_size * t.type_size
    if offset % alignment:
        raise _bad(path, f"{what}: offset {offset} is not a multiple of the alignment "
                         f"{alignment}")
    begin = data_start + offset
    if begin + n_bytes > size:
        raise _bad(path, f"{what}: bytes [{begin}, {begin + n_bytes}) ({t.name} {ne}) leave "
                         f"the file of {size} bytes (data section from {data_start})")
    return GGUFTensorInfo(name, ggml_type, tuple(reversed(ne)), begin, begin + n_bytes, path)


def _check_disjoint(path: str, tensors: Iterable[GGUFTensorInfo]) -> None:
    spans = sorted((t.begin, t.end, t.name) for t in tensors if t.end > t.begin)
    for (_, end0, name0), (begin1, _, name1) in zip(spans, spans[1:], strict=False):
        if begin1 < end0:
            raise _bad(path, f"tensors {_short.repr(name0)} and {_short.repr(name1)} share "
                             f"bytes (from offset {begin1})")


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

    ``metadata`` (key -> value), ``value_types`` (key -> GGUF value type id),
    ``architecture`` (``general.architecture`` or None), ``tensors`` (name ->
    :class:`GGUFTensorInfo`, in the file's order).  ``get`` returns zero-copy tensors
    (dequantized ones for block types other than MXFP4), each call its own copy-on-write
    mapping (a write to one never reaches another).  The file stays open until
    :meth:`close`: every mapping is of the file whose header was checked, even if the
    path is replaced."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        fh = open_regular_file(self.path)
        try:
            size = os.fstat(fh.fileno()).st_size
            version, metadata, types, alignment, data_start, tensors = _parse(
                fh, self.path, size)
        except BaseException:
            fh.close()
            raise
        self._fh = fh
        self._closer = weakref.finalize(self, fh.close)
        self.version: int = version
        self.alignment: int = alignment
        self.data_offset: int = data_start
        self.metadata: Mapping[str, Any] = MappingProxyType(metadata)
        self.value_types: Mapping[str, int] = MappingProxyType(types)
        self.tensors: Mapping[str, GGUFTensorInfo] = MappingProxyType(tensors)
        arch = metadata.get(ARCHITECTURE_KEY)
        self.architecture: Optional[str] = arch if isinstance(arch, str) else None
        self._size = size
        self._lock = threading.Lock()  # a mapping and close() never interleave

    def close(self) -> None:
        """Close the file; tensors already returned stay valid (their mappings outlive it),
        and reading another is a ``ValueError`` naming the file."""
        with self._lock:
            self._closer()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        if self._fh.closed:
            raise self._closed()
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
