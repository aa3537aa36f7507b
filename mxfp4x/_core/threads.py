"""How many threads the CPU driver uses, and how they run: the one owner of the thread
policy at run time (as scikit-learn's ``utils/_openmp_helpers`` owns "how many threads,
and is OpenMP there").  Every other module asks here.

What was built is a fact of the extension, read once: the backend (setup.py chose it;
include/mxfp4x/threads.h runs it) and the cap, threads.h's MXFP4X_MAX_THREADS (the size
of the pthreads workers's arrays; libgomp keeps the threads of its last team alive
between parallel steps, so a larger request would only leave idle OS threads behind).  What a call
asks for is resolved here: ``num_threads=None`` (or 0, its deferred form) means
``torch.get_num_threads()`` when the call runs.  Requests are checked for type and sign
where the user passes them (``arguments.check_num_threads``), which caps them here.
"""
import contextlib
import warnings
from typing import Iterator, Optional

import torch

from . import cpu as _cpu

BACKENDS = ("openmp", "pthreads", "serial")  # threads.h's MXFP4X_THREADS_NAME values

_BACKEND: str = _cpu.threads_backend()
MAX_THREADS: int = _cpu.MAX_THREADS
_WARNED_FORK = False


def backend() -> str:
    """How the driver's tasks run in parallel in this build: "openmp" (prange over the
    OpenMP runtime torch also loads; Linux x86-64), "pthreads" (threads.h's workers started
    per parallel step; macOS and Linux aarch64, where torch brings a runtime of its own),
    or "serial" (Windows, and MXFP4X_THREADS=serial / MXFP4X_DISABLE_OPENMP=1 builds)."""
    return _BACKEND


def have_openmp() -> bool:
    """Whether the extension was built with OpenMP (and so shares torch's runtime)."""
    return _BACKEND == "openmp"


def max_threads() -> int:
    """The most threads one call uses; larger requests are capped to it."""
    return MAX_THREADS


def resolve(num_threads: Optional[int] = None) -> int:
    """The threads a call runs on: ``num_threads``, or ``torch.get_num_threads()`` for
    None or 0 (read now, so a torch.set_num_threads between calls is followed), at least
    1 and at most :data:`MAX_THREADS`.  A serial build runs every task on the calling
    thread whatever this says."""
    n = max(1, min(int(num_threads) if num_threads else torch.get_num_threads(), MAX_THREADS))
    if n > 1 and _cpu.forked_after_teams():
        global _WARNED_FORK
        if not _WARNED_FORK:
            _WARNED_FORK = True
            warnings.warn("mxfp4x: this process was forked after OpenMP threads ran, and "
                          "GNU OpenMP cannot start them again here: calls run on one "
                          "thread (the same results); start worker processes with the "
                          "'spawn' or 'forkserver' method to use more", RuntimeWarning,
                          stacklevel=4)
    return n


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's thread count set to ``n`` inside the block, and restored after it: what
    measures a thread count within one process (the roofs, the measuring commands, the
    benchmarks) runs under this, and leaves the caller's setting as it found it."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
