"""A minimal safetensors reader (memory-mapped, zero-copy) and writer.

The format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the tensors' bytes (offsets relative to the end of the header).  Reading maps the
file copy-on-write, a new mapping of just the bytes asked for on every call: a tensor is a
view of the file's pages, no byte is read before it is used, and a write to a tensor
copies the page it touches, for that call's tensors alone (no other call's tensors,
however many times the name is read, see it).  A mapping lasts as long as a tensor of
it, and holds no file descriptor; a process holding tens of thousands of tensors from
separate calls holds as many mappings (Linux allows 65530 by default,
``vm.max_map_count``): ``get_many`` maps many tensors at once.  Every call checks the
file's current size against the bytes it maps: a file truncated after it was opened is
a ``ValueError``, not a mapping past the end of the file (SIGBUS when read).  What no
reader can guard against: a file truncated or rewritten in place while tensors already
handed out are in use (a bus error, or changed numbers); replace a checkpoint by
renaming a new file over it.

Only regular files are read (symbolic links followed): a named pipe, a device or a
folder is a ``ValueError`` naming it, before it is opened.

Files are untrusted input.  Every number of a header is checked with exact Python ints
(numpy products wrap around), entries may not share bytes, and every read is bounded by
its own entry's ``data_offsets``: a malformed file is a ``ValueError`` naming the file
and the entry, never another tensor's bytes.  Reading never mutates shared state, so one
open file serves many threads.
"""
import json
import math
import operator
import os
import stat
import struct
import threading
from types import MappingProxyType
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from .._core.files import atomic_write
from ._files import MappedFile, _short
from ._header import (  # noqa: F401 (MAX_*_BYTES: public)
    _NP,
    _TORCH_NAME,
    _VIEW_AS,
    MAX_HEADER_BYTES,
    MAX_JSON_BYTES,
    UnsupportedDtypeError,
    _Entry,
    read_header,
    read_json,
)


class SafeTensorsFile(MappedFile):
    """Read access to one .safetensors file; ``get`` returns zero-copy tensors, each call
    its own copy-on-write mapping (a write to one never reaches another).

    The file stays open until :meth:`close`: every mapping is of the file whose header
    was checked, even if the path is replaced meanwhile."""

    def __init__(self, path: str):
        self.path = path
        header, metadata, entries, base = self._open(read_header)
        self.metadata: Dict[str, str] = metadata
        # the parsed JSON, for inspection; reads use the validated entries only
        self.header: Mapping[str, Any] = MappingProxyType(header)
        self._entries: Dict[str, _Entry] = entries
        self._base = base

    def keys(self) -> Iterable[str]:
        return self._entries.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> Tuple[int, ...]:
        """A tensor's shape as its header states it (nothing is mapped or read)."""
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return tuple(self._entries[name].shape)

    def get(self, name: str) -> torch.Tensor:
        """One tensor, a view of a new copy-on-write mapping of just its bytes: the
        caller's own (writes to it are seen by no other call's tensors)."""
        e = self._entry(name)
        begin = self._base + e.begin
        window = self._map(begin, self._base + e.end, [name]) if e.end > e.begin else None
        return self._view(name, e, window, begin, e.shape, e.begin, e.end)

    def get_many(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Several tensors as views of one new mapping of just the span of the file that
        holds them: a process that serves some of the experts maps only (about) their
        bytes.  The tensors hold disjoint bytes, and the mapping is this call's alone."""
        found = {n: self._entry(n) for n in names}
        full = [e for e in found.values() if e.end > e.begin]
        if not full:
            return {n: self._view(n, e, None, 0, e.shape, e.begin, e.end)
                    for n, e in found.items()}
        begin = self._base + min(e.begin for e in full)
        window = self._map(begin, self._base + max(e.end for e in full), found)
        return {n: self._view(n, e, window, begin, e.shape, e.begin, e.end)
                for n, e in found.items()}

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of a tensor's first dimension (e.g. some experts of a stacked
        tensor), a view of a mapping of just their bytes."""
        e = self._entry(name)
        start, end = operator.index(start), operator.index(end)
        if not e.shape or not 0 <= start <= end <= e.shape[0]:
            raise ValueError(f"{self.path}: rows [{start}, {end}) of {name!r} "
                             f"{list(e.shape)}")
        row = math.prod(e.shape[1:]) * np.dtype(_NP[e.dtype]).itemsize
        lo, hi = e.begin + start * row, e.begin + end * row
        shape = (end - start,) + e.shape[1:]
        window = self._map(self._base + lo, self._base + hi, [name]) if hi > lo else None
        return self._view(name, e, window, self._base + lo, shape, lo, hi)

    def byte_range(self, name: str) -> Tuple[int, int]:
        """[first byte, end byte) of a tensor's data in the file."""
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        e = self._entries[name]
        return self._base + e.begin, self._base + e.end

    def _entry(self, name: str) -> _Entry:
        """The entry of a tensor about to be read (the file must still be open)."""
        self._check_open()
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        e = self._entries[name]
        if e.dtype not in _NP:
            raise UnsupportedDtypeError(f"{self.path}: tensor {name!r} has unsupported "
                                        f"dtype {_short.repr(e.dtype)}")
        return e

    def _view(self, name: str, e: _Entry, mapped: Optional[np.ndarray], mapped_at: int,
              shape: Tuple[int, ...], begin: int, end: int) -> torch.Tensor:
        """Bytes [begin, end) of the data section, which must lie inside entry ``e``, as a
        tensor of ``shape``; ``mapped`` holds absolute file bytes from ``mapped_at``."""
        itemsize = np.dtype(_NP[e.dtype]).itemsize
        lo, hi = self._base + begin - mapped_at, self._base + end - mapped_at
        # checked here, where bytes are read, whatever the caller computed
        if not (e.begin <= begin <= end <= e.end and math.prod(shape) * itemsize == end - begin
                and (begin == end or (mapped is not None and 0 <= lo and hi <= len(mapped)))):
            raise ValueError(f"{self.path}: tensor {name!r}: bytes [{begin}, {end}) as "
                             f"{list(shape)} leave its data_offsets [{e.begin}, {e.end})")
        if mapped is None or begin == end:
            return torch.empty(shape, dtype=_VIEW_AS.get(e.dtype) or
                               torch.from_numpy(np.empty(0, _NP[e.dtype])).dtype)
        raw = mapped[lo:hi]
        aligned = raw.ctypes.data % itemsize == 0
        # the copy-on-write map is writable, so torch.from_numpy needs no warnings filter;
        # an unaligned tensor is copied into a fresh (aligned, writable) array
        arr: np.ndarray = (raw if aligned else raw.copy()).view(_NP[e.dtype])
        t = torch.from_numpy(arr.reshape(shape))
        return t.view(_VIEW_AS[e.dtype]) if e.dtype in _VIEW_AS else t


def save_file(tensors: Dict[str, torch.Tensor], path: str,
              metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``tensors`` (CPU, any layout: made contiguous) as a .safetensors file.  The
    tensors may be views of a mapping of ``path`` itself: the file is replaced, not
    overwritten."""
    def maker(t: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: t

    write_file(path, {name: (t.dtype, tuple(t.shape), maker(t)) for name, t in tensors.items()},
               metadata)


Made = Union[None, torch.Tensor, Iterable[torch.Tensor]]


def write_file(path: str, entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...],
                                                   Callable[[], Made]]],
               metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a .safetensors file whose tensors are made one at a time while it is
    written (``name -> (dtype, shape, make)``): a file larger than memory can be written.
    ``make()`` returns the tensor, or an iterable of its pieces along the first dimension
    (rows ``[0, r1)``, ``[r1, r2)``, ... in order, each written as it comes: a tensor
    larger than memory can be written too), or None to leave it unwritten (all zero
    bytes, sparse on disk).  Bytes are written from the tensors' memory, never copied.
    The bytes go to a temporary file renamed over ``path`` at the end: a failure leaves
    ``path`` as it was, and mappings of the old file keep their bytes."""
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError(f"{path}: metadata must map strings to strings, got "
                        f"{_short.repr(meta)}")
    if "__metadata__" in entries:
        raise ValueError(f"{path}: '__metadata__' is reserved, not a tensor name")
    header: Dict[str, Any] = {"__metadata__": meta}
    offset = 0
    # widest elements first: every tensor then starts aligned to its element size
    # (the format allows no padding between tensors)
    order = sorted(entries, key=lambda k: -torch.empty((), dtype=entries[k][0]).element_size())
    for name in order:
        dtype, dims = entries[name][0], [int(d) for d in entries[name][1]]
        if dtype not in _TORCH_NAME:
            raise TypeError(f"{name}: cannot store dtype {dtype}")
        if any(d < 0 for d in dims):
            raise ValueError(f"{name}: negative dimension in {dims}")
        size = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _TORCH_NAME[dtype], "shape": dims,
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with atomic_write(path, "wb") as f:
        # a device or a pipe (atomic_write writes those straight through): the bytes in
        # sequence, unwritten tensors as zeros, no seek
        regular = stat.S_ISREG(os.fstat(f.fileno()).st_mode)
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        base, written = f.tell() if regular else 0, 0
        for name in order:
            dtype, shape, make = entries[name]
            made = make()
            begin, end = header[name]["data_offsets"]
            if made is None:
                continue
            if regular:
                f.seek(base + begin)
            else:
                _write_zeros(f, begin - written)
            shape = tuple(int(d) for d in shape)
            whole = isinstance(made, torch.Tensor)
            rows = 0
            pieces = [made] if isinstance(made, torch.Tensor) else made
            for t in pieces:
                t = t.detach().cpu().contiguous()
                if t.dtype != dtype or (tuple(t.shape) != shape if whole else (
                        t.dim() != len(shape) or not shape or
                        tuple(t.shape[1:]) != shape[1:] or rows + t.shape[0] > shape[0])):
                    raise ValueError(f"{name}: made {t.dtype} {tuple(t.shape)}"
                                     f"{'' if whole else f' after {rows} rows'}, declared "
                                     f"{dtype} {shape}")
                rows += t.shape[0] if t.dim() else 1
                if _TORCH_NAME[dtype] in _VIEW_AS:  # no numpy dtype: same-width integers
                    t = t.view(torch.int16 if t.element_size() == 2 else torch.uint8)
                f.write(t.numpy().reshape(-1).view(np.uint8).data)  # the memory itself
            if not whole and rows != (shape[0] if shape else 1):
                raise ValueError(f"{name}: made {rows} rows, declared {dtype} {shape}")
            written = end
        if regular:
            f.truncate(base + offset)  # the full length, also when the last tensors are sparse
        else:
            _write_zeros(f, offset - written)


def _write_zeros(f, n: int, chunk: int = 1 << 20) -> None:
    """``n`` zero bytes to ``f``, a megabyte at a time."""
    block = bytes(min(n, chunk))
    while n > 0:
        f.write(block[:min(n, chunk)])
        n -= chunk


def _shard_name(index: str, key: str, name: object) -> str:
    """A weight_map value as written: a relative name inside the checkpoint folder.  The
    name is checked, not where it resolves: a Hugging Face cache snapshot's files are
    symlinks into ``../../blobs/``, and following them is fine."""
    if not isinstance(name, str):
        raise ValueError(f"{index}: {_short.repr(key)} maps to {_short.repr(name)}, "
                         f"expected a file name")
    parts = name.replace(os.sep, "/").split("/")
    if (not name or "\0" in name or os.path.isabs(name) or os.path.splitdrive(name)[0]
            or any(p in ("", ".", "..") for p in parts)):
        raise ValueError(f"{index}: {_short.repr(key)} points outside the checkpoint "
                         f"folder: {_short.repr(name)} is not a plain relative file name")
    return name


class SafeTensorsCheckpoint:
    """A checkpoint: one .safetensors file, or a directory with
    ``model.safetensors.index.json`` (its weight_map) or a single .safetensors file."""

    def __init__(self, path: str):
        self.root = path
        self._files: Dict[str, SafeTensorsFile] = {}
        self._lock = threading.Lock()
        self._where: Dict[str, str] = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                for k, v in self._read_index(index).items():
                    self._where[k] = os.path.join(path, _shard_name(index, k, v))
            else:
                for fname in sorted(os.listdir(path)):
                    if fname.endswith(".safetensors"):
                        full = os.path.join(path, fname)
                        for k in self._file(full).keys():
                            if k in self._where:  # which one would be read is a guess
                                raise ValueError(
                                    f"{path}: tensor {k!r} is in both "
                                    f"{os.path.basename(self._where[k])!r} and {fname!r} "
                                    f"(and there is no model.safetensors.index.json)")
                            self._where[k] = full
        else:
            for k in self._file(path).keys():
                self._where[k] = path

    @staticmethod
    def _read_index(index: str) -> Dict[str, object]:
        doc = read_json(index, "the index")
        if not isinstance(doc, dict):
            raise ValueError(f"{index}: the index is not a JSON object")
        weight_map = doc.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map object (got "
                             f"{_short.repr(weight_map)})")
        return weight_map

    def _file(self, path: str) -> SafeTensorsFile:
        with self._lock:  # one SafeTensorsFile per path, however many threads ask
            f = self._files.get(path)
            if f is None:
                f = self._files[path] = SafeTensorsFile(path)
            return f

    def _locate(self, name: str) -> SafeTensorsFile:
        """The open file that holds ``name``; an index that names the wrong file is a
        malformed checkpoint, not a missing tensor."""
        if name not in self._where:
            raise KeyError(f"{self.root}: no tensor named {name!r}")
        f = self._file(self._where[name])
        if name not in f:
            raise ValueError(f"{self.root}: the index puts {name!r} in {f.path}, which has "
                             f"no such tensor")
        return f

    def keys(self) -> Iterable[str]:
        """Every tensor name the checkpoint's files hold (index order, else file order)."""
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> Tuple[int, ...]:
        """A tensor's shape as its file's header states it (nothing is mapped or read)."""
        return self._locate(name).shape(name)

    def get(self, name: str) -> torch.Tensor:
        return self._locate(name).get(name)

    def get_many(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Tensors as views of one mapping per file of just the span that holds them."""
        by_file: Dict[SafeTensorsFile, list] = {}
        for n in names:
            by_file.setdefault(self._locate(n), []).append(n)
        out: Dict[str, torch.Tensor] = {}
        for f, ns in by_file.items():
            out.update(f.get_many(ns))
        return out

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._locate(name).get_rows(name, start, end)

    def byte_range(self, name: str) -> Tuple[str, int, int]:
        """(file path, first byte, end byte) of a tensor's data in its file."""
        f = self._locate(name)
        return (f.path,) + f.byte_range(name)
