"""A minimal safetensors reader (memory-mapped, zero-copy) and writer.

The format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the tensors' bytes (offsets relative to the end of the header).  Reading maps the
file copy-on-write: a tensor is a view of the file's pages until someone writes to it.
"""
import json
import os
import struct
from typing import Callable, Dict, Iterable, Optional, Tuple

import numpy as np
import torch

_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
       "F8_E8M0": np.uint8,
       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
       "BOOL": np.bool_}
# dtypes numpy lacks: stored as same-width integers, viewed back (never cast by value)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_VIEW_AS = {"BF16": torch.bfloat16, **({"F8_E8M0": _E8M0} if _E8M0 is not None else {})}
_TORCH_NAME = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
               torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
               torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
               **({_E8M0: "F8_E8M0"} if _E8M0 is not None else {})}


def _check_entry(path, name, info, data_size):
    """Offsets inside the data section, a known dtype, and a shape that fits the bytes."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        ok = (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_size
              and all(isinstance(d, int) and d >= 0 for d in shape))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: malformed entry for tensor {name!r}: {info!r}")
    if dtype not in _NP:
        return  # reported by get(), so that other tensors stay readable
    if int(np.prod(shape, dtype=np.int64)) * np.dtype(_NP[dtype]).itemsize != end - begin:
        raise ValueError(f"{path}: tensor {name!r}: shape {shape} of {dtype} does not fill "
                         f"bytes [{begin}, {end})")


class SafeTensorsFile:
    """Read access to one .safetensors file; ``get`` returns zero-copy tensors."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            size = os.path.getsize(path)
            if n > size - 8:
                raise ValueError(f"{path}: not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
            except ValueError as exc:
                raise ValueError(f"{path}: not a safetensors file ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
        self.metadata = header.pop("__metadata__", {})
        data_size = size - 8 - n
        for name, info in header.items():
            _check_entry(path, name, info, data_size)
        self.header = header
        self._base = 8 + n
        self._size = size
        self._whole: Optional[np.ndarray] = None  # the whole file, mapped on first get()

    def keys(self) -> Iterable[str]:
        return self.header.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def get(self, name: str) -> torch.Tensor:
        """One tensor, a view of a copy-on-write mapping of the whole file."""
        self._info(name)
        if self._whole is None and self._size:
            self._whole = np.memmap(self.path, dtype=np.uint8, mode="c")
        return self._view(self._whole, 0, name)

    def get_many(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Several tensors as views of one mapping of just the span of the file that holds
        them: a process that serves some of the experts maps only (about) their bytes."""
        names = list(names)
        if not names:
            return {}
        spans = [self._info(n)["data_offsets"] for n in names]
        begin = self._base + min(b for b, _ in spans)
        end = self._base + max(e for _, e in spans)
        window = np.memmap(self.path, dtype=np.uint8, mode="c", offset=begin,
                           shape=(end - begin,)) if end > begin else None
        return {n: self._view(window, begin, n) for n in names}

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of a tensor's first dimension (e.g. some experts of a stacked
        tensor), a view of a mapping of just their bytes."""
        info = self._info(name)
        shape = list(info["shape"])
        if not shape or not 0 <= start <= end <= shape[0]:
            raise ValueError(f"{self.path}: rows [{start}, {end}) of {name!r} {shape}")
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(_NP[info["dtype"]]).itemsize
        begin = info["data_offsets"][0]
        sub = dict(info, shape=[end - start] + shape[1:],
                   data_offsets=[begin + start * row, begin + end * row])
        key = f"{name}[{start}:{end}]"
        self.header[key] = sub  # a derived entry, viewed like any other
        try:
            return self.get_many([key])[key]
        finally:
            del self.header[key]

    def _info(self, name: str) -> dict:
        if name not in self.header:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        info = self.header[name]
        if info["dtype"] not in _NP:
            raise TypeError(f"{self.path}: tensor {name!r} has unsupported dtype "
                            f"{info['dtype']}")
        return info

    def _view(self, mapped: Optional[np.ndarray], mapped_at: int, name: str) -> torch.Tensor:
        info = self.header[name]
        dtype = info["dtype"]
        begin, end = info["data_offsets"]
        if mapped is None or begin == end:
            return torch.empty(info["shape"], dtype=_VIEW_AS.get(dtype) or
                               torch.from_numpy(np.empty(0, _NP[dtype])).dtype)
        raw = mapped[self._base + begin - mapped_at:self._base + end - mapped_at]
        aligned = raw.ctypes.data % np.dtype(_NP[dtype]).itemsize == 0
        # the copy-on-write map is writable, so torch.from_numpy needs no warnings filter;
        # an unaligned tensor is copied into a fresh (aligned, writable) array
        arr: np.ndarray = (raw if aligned else raw.copy()).view(_NP[dtype])
        t = torch.from_numpy(arr.reshape(info["shape"]))
        return t.view(_VIEW_AS[dtype]) if dtype in _VIEW_AS else t


def save_file(tensors: Dict[str, torch.Tensor], path: str,
              metadata: Optional[Dict[str, str]] = None) -> None:
    """Write ``tensors`` (CPU, any layout: made contiguous) as a .safetensors file."""
    def maker(t: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: t

    write_file(path, {name: (t.dtype, tuple(t.shape), maker(t)) for name, t in tensors.items()},
               metadata)


def write_file(path: str, entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...],
                                                   Callable[[], torch.Tensor]]],
               metadata: Optional[Dict[str, str]] = None) -> None:
    """Write a .safetensors file whose tensors are made one at a time while it is
    written (``name -> (dtype, shape, make)``): a file larger than memory can be written.
    A tensor ``make()`` returns None for is left unwritten (all zero bytes, sparse on
    disk)."""
    header: Dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    # widest elements first: every tensor then starts aligned to its element size
    # (the format allows no padding between tensors)
    order = sorted(entries, key=lambda k: -torch.empty((), dtype=entries[k][0]).element_size())
    for name in order:
        dtype, shape = entries[name][0], entries[name][1]
        if dtype not in _TORCH_NAME:
            raise TypeError(f"{name}: cannot store dtype {dtype}")
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _TORCH_NAME[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        base = f.tell()
        for name in order:
            dtype, shape, make = entries[name]
            t = make()
            begin, end = header[name]["data_offsets"]  # type: ignore[index]
            if t is None:
                continue
            t = t.detach().cpu().contiguous()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: made {t.dtype} {tuple(t.shape)}, declared {dtype} "
                                 f"{tuple(shape)}")
            if _TORCH_NAME[dtype] in _VIEW_AS:  # no numpy dtype: the same-width integers
                t = t.view(torch.int16 if t.element_size() == 2 else torch.uint8)
            f.seek(base + begin)
            f.write(t.numpy().tobytes())
        f.truncate(base + offset)  # the full length, also when the last tensors are sparse


class SafeTensorsCheckpoint:
    """A checkpoint: one .safetensors file, or a directory with
    ``model.safetensors.index.json`` (its weight_map) or a single .safetensors file."""

    def __init__(self, path: str):
        self.root = path
        self._files: Dict[str, SafeTensorsFile] = {}
        self._where: Dict[str, str] = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                root = os.path.realpath(path)
                for k, v in weight_map.items():
                    full = os.path.realpath(os.path.join(path, v))
                    if os.path.dirname(full) != root:
                        raise ValueError(f"{index}: {k!r} points outside the checkpoint "
                                         f"folder: {v!r}")
                    self._where[k] = full
            else:
                for fname in sorted(os.listdir(path)):
                    if fname.endswith(".safetensors"):
                        full = os.path.join(path, fname)
                        for k in self._file(full).keys():
                            self._where[k] = full
        else:
            for k in self._file(path).keys():
                self._where[k] = path

    def _file(self, path: str) -> SafeTensorsFile:
        if path not in self._files:
            self._files[path] = SafeTensorsFile(path)
        return self._files[path]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.root}: no tensor named {name!r}")
        return self._file(self._where[name]).get(name)

    def get_many(self, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Tensors as views of one mapping per file of just the span that holds them."""
        by_file: Dict[str, list] = {}
        for n in names:
            if n not in self._where:
                raise KeyError(f"{self.root}: no tensor named {n!r}")
            by_file.setdefault(self._where[n], []).append(n)
        out: Dict[str, torch.Tensor] = {}
        for path, ns in by_file.items():
            out.update(self._file(path).get_many(ns))
        return out

    def get_rows(self, name: str, start: int, end: int) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.root}: no tensor named {name!r}")
        return self._file(self._where[name]).get_rows(name, start, end)

    def byte_range(self, name: str):
        """(file path, first byte, end byte) of a tensor's data in its file."""
        if name not in self._where:
            raise KeyError(f"{self.root}: no tensor named {name!r}")
        f = self._file(self._where[name])
        begin, end = f.header[name]["data_offsets"]
        return f.path, f._base + begin, f._base + end
