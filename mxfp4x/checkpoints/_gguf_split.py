"""A GGUF model of one file or of a split set (``name-00001-of-00003.gguf``, ...):
:class:`GGUFCheckpoint` opens every file of the set, checks that their ``split.*`` keys
agree with their names, and looks tensors up by name across them."""
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from ._files import check_regular_file
from ._gguf_file import GGUFFile
from ._gguf_format import (
    _INTEGER_TYPES,
    SPLIT_COUNT,
    SPLIT_NAME,
    SPLIT_NO,
    SPLIT_TENSORS,
    VALUE_TYPES,
    GGUFTensorInfo,
)


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
