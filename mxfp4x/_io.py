"""Writing files without ever leaving a user's file half-written.

Every file the package writes (checkpoints, quantized files, manifests, JSON reports, plots)
goes through :func:`atomic_write`: the bytes go to a temporary file in the target's folder,
which is flushed, synced and renamed over the target only when the writer finished without
an error.  A failure (an exception, Ctrl-C, a full disk) leaves the target as it was and
removes the temporary file.  Renaming also keeps readers safe: a process that maps the old
file (e.g. ``quantize f.safetensors f.safetensors``, whose unquantized tensors are views of
the input's mapping) keeps its pages, because the old file's inode lives on until it is
unmapped.
"""
import contextlib
import os
import tempfile
import threading
from typing import IO, Iterator

_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it where the OS says it (Linux); else
    set and restored under a lock (the umask is process-wide state)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def check_writable(path: str, what: str = "output") -> str:
    """Raise ``ValueError`` naming ``what`` unless ``path`` can be created or replaced: its
    folder exists and is writable, and it is not a folder.  Checked before any work, so a
    long job never fails at its last step.  Returns the absolute path."""
    full = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        raise ValueError(f"{what}: {path!r} is a folder, expected a file path")
    if not os.path.isdir(folder):
        raise ValueError(f"{what}: the folder of {path!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: cannot write in the folder of {path!r}")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ValueError(f"{what}: {path!r} exists and is not writable")
    return full


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """``with atomic_write(path) as f: ...``: ``f`` is a temporary file beside ``path``
    (mode ``"wb"`` or ``"w"``), renamed over ``path`` once the block ends normally."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode: expected 'wb' or 'w', got {mode!r}")
    full = os.path.abspath(os.fspath(path))
    folder, name = os.path.split(full)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(full):  # keep the target's permission bits
            os.chmod(tmp, os.stat(full).st_mode & 0o7777)
        else:  # mkstemp made it 0600: give it what open() would have
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, full)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
