"""A GGUF file's header, every field checked (:func:`_parse`): the magic and version,
the counts within the caps, keys and tensor names unique, and each tensor's bytes whole
blocks of a known type, aligned, inside the file and shared with no other tensor."""
import math
import struct
from array import array
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from ._files import _short
from ._gguf_format import (
    _MAX_INDEX,
    _STRING,
    _STRUCT,
    _TYPE_COUNT,
    _UINT32,
    _UINT64,
    ALIGNMENT_KEY,
    ARCHITECTURE_KEY,
    DEFAULT_ALIGNMENT,
    GGML_TYPES,
    MAGIC,
    MAX_DIMS,
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_NAME_BYTES,
    MAX_TENSORS,
    VALUE_TYPES,
    VERSIONS,
    GGUFTensorInfo,
)
from ._gguf_values import _bad, _Cursor


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
