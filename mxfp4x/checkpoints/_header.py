"""The safetensors header, read as hostile input: the element types, the limits, JSON
without duplicate keys, and every entry checked with exact integers (a known dtype, a shape
that fills exactly its byte range inside the data section, ranges that do not overlap).
Every refusal is a ValueError naming the file and the entry.

Also the one reader of JSON files, capped at :data:`MAX_JSON_BYTES` (:func:`read_json`);
files are opened as every checkpoint file is (``_files``: regular files only)."""
import json
import math
import os
import struct
from typing import Any, BinaryIO, Dict, List, Mapping, NamedTuple, Tuple

import numpy as np
import torch

from .._core.format import torch_e8m0_dtype
from ._files import _short, open_regular_file

_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
       "F8_E8M0": np.uint8,
       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
       "BOOL": np.bool_}
# dtypes numpy lacks: stored as same-width integers, viewed back (never cast by value)
_E8M0 = torch_e8m0_dtype()
_VIEW_AS = {"BF16": torch.bfloat16, **({"F8_E8M0": _E8M0} if _E8M0 is not None else {})}
_TORCH_NAME = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
               **({_E8M0: "F8_E8M0"} if _E8M0 is not None else {})}

# The one cap on JSON: every JSON file the package reads (config.json, a safetensors
# index, a verify manifest, through read_json) and a safetensors header.  The safetensors
# reference implementation's header limit; real files are far below it (a config.json is
# kilobytes; an index names each tensor in ~100 bytes: ~50 MB for one tensor per expert
# of Kimi K3).  A longer file is refused before it is read, not parsed into gigabytes.
MAX_JSON_BYTES = 100_000_000
# the safetensors header's cap, by its historical name
MAX_HEADER_BYTES = MAX_JSON_BYTES
# numpy 1.x arrays have at most 32 dimensions (numpy 2: 64)
MAX_DIMS = 32
# torch and numpy index with signed 64-bit strides: every stride in bytes must fit
_MAX_INDEX = 2 ** 63


class UnsupportedDtypeError(ValueError, TypeError):
    """A well-formed entry whose dtype this reader cannot view (the other tensors of the
    file stay readable).  A ``TypeError`` too, as it was before files were validated."""



class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    # json keeps the last of repeated keys: two meanings for one name, so refuse it
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate key {_short.repr(key)}")
        out[key] = value
    return out


def _parse_json(path: str, raw: bytes, what: str) -> Any:
    """``raw`` as strict UTF-8 JSON without repeated keys, any failure a ValueError
    naming ``path``."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ValueError(f"{path}: {what} is not valid JSON ({reason})") from None


def read_json(path: str, what: str) -> Any:
    """The JSON document in ``path`` (``what`` it is, for messages: "config.json", "the
    index", ...), parsed as :func:`_parse_json` does (strict UTF-8, no repeated keys),
    from a regular file (:func:`open_regular_file`) of at most :data:`MAX_JSON_BYTES`.  A
    larger one is a ``ValueError`` naming it, its size and the cap, refused from its size
    before any byte is read; at most the cap + 1 bytes are ever read (a file that grows
    meanwhile is refused too)."""
    with open_regular_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        raw = b""
        if size <= MAX_JSON_BYTES:
            # its size and one byte more (read(n) allocates n bytes first: never the cap)
            raw = f.read(size + 1)
            if len(raw) > size:  # it grew since: on to the cap
                raw += f.read(MAX_JSON_BYTES + 1 - len(raw))
    if size > MAX_JSON_BYTES or len(raw) > MAX_JSON_BYTES:
        got = (f"{size} bytes" if size > MAX_JSON_BYTES else
               f"over {MAX_JSON_BYTES} bytes (it grew while it was read)")
        raise ValueError(f"{path}: {what} is {got}, more than the cap of {MAX_JSON_BYTES} "
                         f"bytes on a JSON file (MAX_JSON_BYTES)")
    return _parse_json(path, raw, what)


class _Entry(NamedTuple):
    """A validated header entry; ``begin``/``end`` are relative to the data section."""
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is not a size


def _check_entry(path: str, name: str, info: object, data_size: int) -> _Entry:
    """Offsets inside the data section, a shape of at most MAX_DIMS non-negative ints
    whose strides fit 64 bits, and, for a known dtype, a shape that fills the bytes."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: tensor {_short.repr(name)}: {why}: {_short.repr(info)}")

    if not isinstance(info, dict):
        raise bad("expected an object with dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise bad(f"missing {', '.join(missing)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise bad("dtype is not a string")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("shape is not a list of non-negative integers")
    if len(shape) > MAX_DIMS:
        raise bad(f"more than {MAX_DIMS} dimensions")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise bad("data_offsets is not a list of two integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise bad(f"data_offsets leave the data section [0, {data_size})")
    itemsize = np.dtype(_NP[dtype]).itemsize if dtype in _NP else 1
    # a zero-size tensor still has strides: its other dimensions must be indexable
    if math.prod(max(d, 1) for d in shape) * itemsize >= _MAX_INDEX:
        raise bad("dimensions too large to index")
    if dtype in _NP and math.prod(shape) * itemsize != end - begin:
        raise bad(f"shape {shape} of {dtype} does not fill bytes [{begin}, {end})")
    # an unknown dtype is reported by get(), so that the other tensors stay readable
    return _Entry(dtype, tuple(shape), begin, end)


def _check_disjoint(path: str, entries: Mapping[str, _Entry]) -> None:
    """No byte belongs to two tensors (empty tensors hold no byte)."""
    spans = sorted((e.begin, e.end, name) for name, e in entries.items() if e.end > e.begin)
    for (_, end0, name0), (begin1, _, name1) in zip(spans, spans[1:], strict=False):
        if begin1 < end0:
            raise ValueError(f"{path}: tensors {_short.repr(name0)} and {_short.repr(name1)} "
                             f"share bytes (data_offsets overlap at {begin1})")


def read_header(fh: BinaryIO, path: str, size: int) -> Tuple[
        Dict[str, Any], Dict[str, str], Dict[str, _Entry], int]:
    """The header of the open safetensors file ``fh`` (``path``, ``size`` bytes), every
    entry checked: (the parsed JSON less ``__metadata__``, the metadata, the entries,
    where the data section starts)."""
    head = fh.read(8)
    if len(head) != 8:
        raise ValueError(f"{path}: not a safetensors file ({size} bytes, shorter "
                         f"than the 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: not a safetensors file (header length {n}, file "
                         f"size {size})")
    raw = fh.read(n)
    if len(raw) != n:
        raise ValueError(f"{path}: the file shrank while its header was read")
    header = _parse_json(path, raw, "the header")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON "
                         f"object)")
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict)
            and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError(f"{path}: __metadata__ is not an object of strings: "
                         f"{_short.repr(metadata)}")
    data_size = size - 8 - n
    entries = {name: _check_entry(path, name, info, data_size)
               for name, info in header.items()}
    _check_disjoint(path, entries)
    return header, metadata, entries, 8 + n
