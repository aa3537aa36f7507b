"""A GGUF header read as hostile input, in sequence (:class:`_Cursor`: every read
checked against the bytes left in the file before anything is read or allocated), and
its metadata values: Python scalars, strings, read-only numpy arrays of numbers, and
:class:`GGUFList` for arrays of strings or of arrays (their bytes and an offset per
element, each element decoded when read)."""
import io
import operator
from array import array
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union, overload

import numpy as np

from ._files import _short
from ._gguf_format import (
    _ARRAY,
    _BOOL,
    _MIN_VALUE_BYTES,
    _SCALAR,
    _STRING,
    _STRUCT,
    _TYPE_COUNT,
    _UINT32,
    _UINT64,
    MAX_ARRAY_DEPTH,
    MAX_STRING_BYTES,
    VALUE_TYPES,
)

_CHUNK = 1 << 20
_PLAIN_ITEMSIZE = {t: np.dtype(f).itemsize for t, f in _SCALAR.items() if t != _BOOL}


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
