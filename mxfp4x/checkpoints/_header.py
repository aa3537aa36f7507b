"""The safetensors header, read as hostile input: the element types, the limits, JSON
without duplicate keys, and every entry checked with exact integers (a known dtype, a shape
that fills exactly its byte range inside the data section, ranges that do not overlap).
Every refusal is a ValueError naming the file and the entry.

Also what every checkpoint reader opens and maps files with: regular files only
(:func:`open_regular_file`: safetensors and GGUF files, indexes, config.json), a new
private mapping of just the bytes each read asks for (:func:`map_file_bytes`), and the
one reader of JSON files, capped at :data:`MAX_JSON_BYTES` (:func:`read_json`)."""
import ctypes
import json
import math
import mmap
import os
import reprlib
import stat
import weakref
from typing import Any, BinaryIO, Dict, Iterable, List, Mapping, NamedTuple, Tuple

import numpy as np
import torch

from .._format import torch_e8m0_dtype

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

_short = reprlib.Repr()
_short.maxstring = 120
_short.maxother = 120
_short.maxlevel = 3  # hostile values may nest deeply: never recurse into them


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _refuse_unless_regular(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "another kind of file")
        raise ValueError(f"{path}: is not a regular file ({kind}); a checkpoint is read "
                         f"from regular files only")


def check_regular_file(path: str) -> None:
    """Refuse ``path`` (symbolic links followed) unless it is a regular file, without
    opening it: opening a named pipe blocks until something writes to it, and a device
    or a folder holds no checkpoint.  A missing path is the ``FileNotFoundError``
    ``open`` raises; anything else there is a ``ValueError`` naming it."""
    _refuse_unless_regular(path, os.stat(path).st_mode)


def open_regular_file(path: str) -> BinaryIO:
    """``path`` opened for reading in binary, refused as :func:`check_regular_file`
    says.  The open itself does not block either (``O_NONBLOCK``, then the opened file
    checked again): a path replaced by a named pipe between the check and the open is
    refused too, not waited on."""
    check_regular_file(path)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | nonblock)
    try:
        _refuse_unless_regular(path, os.fstat(fd).st_mode)
        if nonblock:
            os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    return fh


def _libc_mapping():
    """libc's ``mmap`` and ``munmap`` (None where there are none, as on Windows)."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        map_ = getattr(libc, "mmap64", None) or libc.mmap  # a 64-bit offset everywhere
        unmap = libc.munmap
    except (OSError, AttributeError):
        return None
    map_.restype = ctypes.c_void_p
    map_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                     ctypes.c_int, ctypes.c_int64]
    unmap.restype = ctypes.c_int
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return map_, unmap


_LIBC = _libc_mapping()
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Mapping:
    """One private mapping of file bytes, as numpy sees it (``__array_interface__``):
    every array made from it keeps it alive, and the last one gone unmaps it.  Not at
    interpreter exit, where arrays may still be read: the process's end unmaps it."""

    def __init__(self, addr: int, length: int, skip: int, n: int):
        assert _LIBC is not None
        self.__array_interface__ = {"shape": (n,), "typestr": "|u1", "version": 3,
                                    "data": (addr + skip, False)}
        weakref.finalize(self, _LIBC[1], addr, length).atexit = False


def map_file_bytes(fh: BinaryIO, path: str, begin: int, end: int, size_at_open: int,
                   names: Iterable[str]) -> np.ndarray:
    """Bytes [begin, end) (absolute, end > begin) of the open file ``fh`` as a writable
    uint8 array, a new private copy-on-write mapping: nothing is read until used, and a
    write is seen through this mapping alone (never by the file, nor another mapping).
    The file's size is checked first: a mapping past the end of a file (truncated after
    it was opened, ``size_at_open`` bytes then) is SIGBUS when read, so it is a
    ``ValueError`` naming ``path`` and the tensors ``names`` instead.  No file
    descriptor is held per mapping (Python's ``mmap`` holds a duplicate each: a process
    keeping a few thousand tensors would run out of them)."""
    size = os.fstat(fh.fileno()).st_size
    if end > size:
        raise ValueError(f"{path}: {_tensors(names)}: bytes [{begin}, {end}) pass the end "
                         f"of the file, {size} bytes now and {size_at_open} when it was "
                         f"opened (truncated since)")
    start = begin - begin % mmap.ALLOCATIONGRANULARITY  # offsets are whole pages
    try:
        if _LIBC is None:
            mapped = mmap.mmap(fh.fileno(), end - start, access=mmap.ACCESS_COPY,
                               offset=start)
            return np.frombuffer(mapped, np.uint8, end - begin, begin - start)
        addr = _LIBC[0](None, end - start, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE, fh.fileno(), start)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    except (ValueError, OSError) as exc:  # e.g. truncated since the check, no memory
        raise ValueError(f"{path}: {_tensors(names)}: cannot map bytes [{begin}, {end}): "
                         f"{exc}") from None
    return np.asarray(_Mapping(addr, end - start, begin - start, end - begin))


class MappedFile:
    """What the two readers share (SafeTensorsFile, GGUFFile): every read maps bytes of
    their open file ``_fh`` (``path``, ``_size`` bytes when opened) under ``_lock``, and
    is refused once the file is closed."""

    path: str
    _fh: BinaryIO
    _lock: Any
    _size: int

    def _closed(self) -> ValueError:
        return ValueError(f"{self.path}: the file was closed; tensors already read stay "
                          f"valid, reading another needs the file opened again")

    def _map(self, begin: int, end: int, names: Iterable[str]) -> np.ndarray:
        """A new private mapping of file bytes [begin, end) (absolute), the bytes of
        tensors ``names`` (:func:`map_file_bytes`: checked against the file's size)."""
        with self._lock:  # the file stays open while it is mapped
            if self._fh.closed:
                raise self._closed()
            return map_file_bytes(self._fh, self.path, begin, end, self._size, names)


class UnsupportedDtypeError(ValueError, TypeError):
    """A well-formed entry whose dtype this reader cannot view (the other tensors of the
    file stay readable).  A ``TypeError`` too, as it was before files were validated."""


def _tensors(names: Iterable[str]) -> str:
    """``names`` as an error message names them."""
    names = list(names)
    return (f"tensor {_short.repr(names[0])}" if len(names) == 1
            else f"tensors {_short.repr(names)}")


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
