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
read)."""
import ctypes
import math
import mmap
import sys
from typing import Iterable, Sequence

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
    """:func:`ask_huge_pages` on the storage of each CPU tensor of at least
    :data:`MIN_BYTES` (each storage once): a checkpoint's mapping that a loader viewed
    (its later faults read 2 MiB folios), or touched memory (the kernel's background
    collapse may join its pages).  Returns how many were advised."""
    seen, n = set(), 0
    for t in tensors:
        if t.device.type != "cpu" or t.is_sparse or not t.numel():
            continue
        storage = t.untyped_storage()
        address, length = storage.data_ptr(), storage.nbytes()
        if length >= MIN_BYTES and address not in seen:
            seen.add(address)
            n += ask_huge_pages(address, length)
    return n
