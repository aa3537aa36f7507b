"""What every checkpoint reader opens and maps files with: regular files only
(:func:`open_regular_file`: safetensors and GGUF files, indexes, config.json), a new
private mapping of just the bytes each read asks for (:func:`map_file_bytes`), and the
readers' shared base, their file's life from open to close (:class:`MappedFile`).  Also
how their messages show hostile values (``_short``: shortened, never recursed into)."""
import ctypes
import mmap
import os
import reprlib
import stat
import threading
import weakref
from typing import Any, BinaryIO, Callable, Iterable, TypeVar

import numpy as np

from .._core import memory as _memory

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
    if end - begin >= _memory.MIN_BYTES:  # its faults bring 2 MiB folios where they can
        _memory.ask_file_pages(addr, end - start)
    return np.asarray(_Mapping(addr, end - start, begin - start, end - begin))


_Header = TypeVar("_Header")
_Reader = TypeVar("_Reader", bound="MappedFile")


class MappedFile:
    """What the two readers share (SafeTensorsFile, GGUFFile): their file's life.  The
    file ``path`` is opened once and its header read (:meth:`_open`); it stays open
    until :meth:`close` (or the reader is collected), so every mapping is of the file
    whose header was checked, even if the path is replaced.  Every read maps bytes of
    that open file ``_fh`` (``_size`` bytes when opened) under ``_lock``, and is
    refused once the file is closed."""

    path: str
    _fh: BinaryIO
    _lock: Any
    _size: int

    def _open(self, read_header: Callable[[BinaryIO, str, int], _Header]) -> _Header:
        """Open ``path`` (:func:`open_regular_file`) and return ``read_header(file, path,
        size)``; the file is closed again if that raises."""
        fh = open_regular_file(self.path)
        try:
            size = os.fstat(fh.fileno()).st_size
            header = read_header(fh, self.path, size)
        except BaseException:
            fh.close()
            raise
        self._fh, self._size = fh, size
        self._closer = weakref.finalize(self, fh.close)
        self._lock = threading.Lock()  # a mapping and close() never interleave
        return header

    def close(self) -> None:
        """Close the file; tensors already returned stay valid (their mappings outlive it),
        and reading another is a ``ValueError`` naming the file."""
        with self._lock:
            self._closer()

    def __enter__(self: _Reader) -> _Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        """Refuse a read once the file is closed."""
        if self._fh.closed:
            raise ValueError(f"{self.path}: the file was closed; tensors already read stay "
                             f"valid, reading another needs the file opened again")

    def _map(self, begin: int, end: int, names: Iterable[str]) -> np.ndarray:
        """A new private mapping of file bytes [begin, end) (absolute), the bytes of
        tensors ``names`` (:func:`map_file_bytes`: checked against the file's size)."""
        with self._lock:  # the file stays open while it is mapped
            self._check_open()
            return map_file_bytes(self._fh, self.path, begin, end, self._size, names)



def _tensors(names: Iterable[str]) -> str:
    """``names`` as an error message names them."""
    names = list(names)
    return (f"tensor {_short.repr(names[0])}" if len(names) == 1
            else f"tensors {_short.repr(names)}")
