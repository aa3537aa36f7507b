"""Large CPU buffers the kernels stream, on transparent huge pages: :func:`zeros`.

A one-token call reads every byte of its experts once, from DRAM, so the rate at which a
core can stream them bounds it.  Memory in 4 KiB pages streams slower than memory in
2 MiB pages (each page a TLB miss, and under a hypervisor each miss a two-level walk; the
hardware prefetchers stop at every page boundary; docs/performance.md, "The regimes and
what bounds them", the Xeon's pages, has the figures).  torch's CPU allocator asks for
no huge pages, and where Linux gives them only on request (``madvise``, the common
setting) its large tensors stay in 4 KiB pages.

:func:`zeros` maps fresh anonymous memory, asks for huge pages on it before anything
touches it, and hands it to torch: the pages arrive (zero, as every anonymous page
does) when first written, 2 MiB at a time where the kernel has them, and go back to the
system when the last tensor viewing them is gone.  Where huge pages cannot be asked for
(not Linux, a small buffer), it is ``torch.zeros``.  :func:`ask_huge_pages` gives the
same hint on a mapping made elsewhere (a checkpoint's bytes, mapped before they are
read), and :func:`ask_file_pages` on every page of a file's mapping: the faults of an
advised mapping read the file into the page cache in 2 MiB folios, which any mapping of
those bytes then maps in 2 MiB pages, but a fault where nothing was asked reads ahead in
small folios into the bytes after it, so a file is asked for whole (its tensors, small
ones too, and their edges), not only the 2 MiB pages inside its large tensors."""
import bisect
import ctypes
import math
import mmap
import os
import sys
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

HUGE_PAGE = 2 << 20
# below this a buffer is torch's: a huge page or two would not pay for the mapping
MIN_BYTES = 4 << 20
_MADV_HUGEPAGE = 14  # Linux's, in every architecture's headers


def _libc_madvise():
    """libc's ``madvise`` on Linux (None elsewhere: no transparent huge pages to ask)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        advise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    advise.restype = ctypes.c_int
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return advise


_MADVISE = _libc_madvise()


def huge_pages_asked() -> bool:
    """Whether this OS is asked for huge pages (Linux): :func:`zeros` and
    :func:`ask_huge_pages` do nothing more than torch's own memory elsewhere."""
    return _MADVISE is not None


def ask_huge_pages(address: int, length: int) -> bool:
    """Ask for transparent huge pages (``MADV_HUGEPAGE``) on the whole 2 MiB pages inside
    ``[address, address + length)`` of a mapping this process made (anonymous memory not
    yet touched, or a file's mapping: its faults then read 2 MiB folios into the page
    cache).  Only a hint: False where it was not given (not Linux, nothing whole inside,
    a kernel without them)."""
    if _MADVISE is None:
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    return end > start and _MADVISE(start, end - start, _MADV_HUGEPAGE) == 0


def ask_file_pages(address: int, length: int) -> bool:
    """Ask for transparent huge pages (``MADV_HUGEPAGE``) on every page that
    ``[address, address + length)`` touches, inside a mapping of a file this process made:
    its faults then read the file in 2 MiB folios, the bytes around a small tensor too.
    Only a hint: False where it was not given (not Linux, nothing to ask, a kernel without
    them)."""
    if _MADVISE is None or length <= 0:
        return False
    start = address - address % mmap.PAGESIZE
    end = -(-(address + length) // mmap.PAGESIZE) * mmap.PAGESIZE
    return _MADVISE(start, end - start, _MADV_HUGEPAGE) == 0


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> Optional[int]:
    """Bytes of memory this process can still take without swapping: Linux's MemAvailable,
    or less where a cgroup (a container, a CI job) caps the process (v2 memory.max minus
    memory.current, v1 memory.limit_in_bytes minus memory.usage_in_bytes); None where the
    system does not say."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 2**60:  # "max" or no limit
            left = max(cap - used, 0)
            free = left if free is None else min(free, left)
    return free


def read_in_huge_folios(paths: Sequence[str],
                        skip: Sequence[Tuple[str, int, int]] = ()) -> int:
    """Read the files ``paths`` into the page cache through private read-only mappings
    that ask for huge pages, one fault per 2 MiB, but the byte ranges ``skip`` ((path,
    start, end) each): the page cache then holds them in 2 MiB folios where the file
    system makes them, and every later mapping of those bytes maps them in 2 MiB pages.  A
    loader that touches a small tensor first through a mapping that asked for none reads
    the bytes around it ahead in small folios (``read_ahead_kb`` of them), and they stay;
    bytes already cached stay as they are.  Nothing is read where huge pages cannot be
    asked for (not Linux, a kernel without them) or where the files would not fit in the
    memory available (they would evict each other before use).  Returns the bytes the
    faults covered."""
    if _MADVISE is None:
        return 0
    plans = []
    for path in paths:
        try:
            size = os.path.getsize(path)
        except OSError:
            return 0
        offsets = np.arange(0, size, HUGE_PAGE, dtype=np.int64)
        for p, start, end in skip:  # the 2 MiB windows wholly inside a skipped range
            if p == path:
                offsets = offsets[(offsets < start) | (offsets + HUGE_PAGE > end)]
        plans.append((path, offsets))
    wanted = sum(len(offsets) for _, offsets in plans) * HUGE_PAGE
    available = available_memory()
    if not wanted or available is None or wanted > available * 4 // 5:
        return 0
    done = 0
    for path, offsets in plans:
        try:
            with open(path, "rb") as fh:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            continue
        data = np.frombuffer(mapped, np.uint8)
        try:
            if _MADVISE(data.ctypes.data, len(data), _MADV_HUGEPAGE) == 0:
                int(data[offsets].sum())  # the faults: each reads its 2 MiB folio ahead
                done += len(offsets) * HUGE_PAGE
        finally:
            del data
            mapped.close()
    return done


def _file_spans() -> List[Tuple[int, int]]:
    """This process's mappings of files (``/proc/self/maps`` lines with a path) as
    ``[start, end)`` address ranges, sorted, adjacent ones joined (one file's mapping is
    several lines once parts of it were advised); empty where that cannot be read."""
    spans: List[Tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    spans.append((lo, hi))
    except (OSError, ValueError):
        return []
    spans.sort()
    joined: List[Tuple[int, int]] = []
    for lo, hi in spans:
        if joined and lo <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(hi, joined[-1][1]))
        else:
            joined.append((lo, hi))
    return joined


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of ``shape`` and ``dtype``; from :data:`MIN_BYTES`
    on Linux, in private anonymous memory that starts on a 2 MiB boundary, with
    transparent huge pages asked for (:func:`ask_huge_pages`) before any page is
    touched."""
    shape = tuple(int(n) for n in shape)
    n_bytes = math.prod(shape) * dtype.itemsize
    if n_bytes < MIN_BYTES or not huge_pages_asked():
        return torch.zeros(shape, dtype=dtype)
    # anonymous pages are zero; whole 2 MiB pages, and room to start on a boundary
    span = -(-n_bytes // HUGE_PAGE) * HUGE_PAGE
    mapped = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = ctypes.c_char.from_buffer(mapped)
    try:
        address = ctypes.addressof(view)
    finally:
        del view  # no export left but torch's
    skip = -address % HUGE_PAGE
    ask_huge_pages(address + skip, span)
    # torch keeps `mapped` alive (it holds the buffer); the last tensor gone unmaps it
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=n_bytes, offset=skip)
    return flat.view(dtype).view(shape)


def ask_huge_pages_of(tensors: Iterable[torch.Tensor]) -> int:
    """Huge pages asked on the storage of each CPU tensor (each storage once): a storage
    inside a mapping of a file (a checkpoint's bytes that a loader viewed) whatever its
    size, every page it touches (:func:`ask_file_pages`: its later faults read 2 MiB
    folios); other memory of at least :data:`MIN_BYTES` on the whole 2 MiB pages inside
    it (:func:`ask_huge_pages`: touched memory the kernel's background collapse may
    join).  Returns how many were advised."""
    spans = _file_spans() if _MADVISE is not None else []
    starts = [lo for lo, _ in spans]
    seen, n = set(), 0
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or not t.numel():
            continue
        storage = t.untyped_storage()
        address, length = storage.data_ptr(), storage.nbytes()
        if address in seen or not length:
            continue
        seen.add(address)
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address + length <= spans[i][1]:
            n += ask_file_pages(address, length)
        elif length >= MIN_BYTES:
            n += ask_huge_pages(address, length)
    return n
