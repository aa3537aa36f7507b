"""Writing files without ever leaving a user's file half-written.

Every file the package writes (checkpoints, quantized files, manifests, JSON reports, plots)
goes through :func:`atomic_write`: the bytes go to a temporary file in the target's folder,
which is flushed, synced and renamed over the target only when the writer finished without
an error.  A failure (an exception, Ctrl-C, a full disk) leaves the target as it was and
removes the temporary file.  Renaming also keeps readers safe: a process that maps the old
file (e.g. ``quantize f.safetensors f.safetensors``, whose unquantized tensors are views of
the input's mapping) keeps its pages, because the old file's inode lives on until it is
unmapped.

The path is the user's: a symbolic link is followed (its target is replaced, the link
stays), and a path that is not a regular file (a device such as ``/dev/null`` or
``/dev/stdout``, a named pipe) is written straight through, never renamed over: a rename
would put a regular file where the device or pipe was.
"""
import contextlib
import os
import stat
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


def _special(path: str) -> bool:
    """Whether ``path`` (links followed) exists and is neither a regular file nor a folder:
    a device, a named pipe, a socket; written straight through."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def check_writable(path: str, what: str = "output") -> str:
    """Raise ``ValueError`` naming ``what`` unless ``path`` can be created or replaced: its
    folder exists and is writable, and it is not a folder (a symbolic link: the same of its
    target); or it is a device or a named pipe we may write to.  Checked before any work,
    so a long job never fails at its last step.  Returns the absolute path of the file
    written (a link's target)."""
    given = os.path.abspath(os.fspath(path))
    if os.path.isdir(given):
        raise ValueError(f"{what}: {path!r} is a folder, expected a file path")
    if _special(given):
        if not os.access(given, os.W_OK):
            raise ValueError(f"{what}: {path!r} exists and is not writable")
        return given
    full = os.path.realpath(given)
    folder = os.path.dirname(full)
    where = "" if full == given else f" (the target of the link, {full!r})"
    if not os.path.isdir(folder):
        raise ValueError(f"{what}: the folder of {path!r}{where} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: cannot write in the folder of {path!r}{where}")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise ValueError(f"{what}: {path!r} exists and is not writable")
    return full


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """``with atomic_write(path) as f: ...``: ``f`` is a temporary file beside ``path``
    (mode ``"wb"`` or ``"w"``), renamed over ``path`` once the block ends normally.  A
    symbolic link's target is the file replaced; a device or named pipe is ``f`` itself
    (see the module's text)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode: expected 'wb' or 'w', got {mode!r}")
    given = os.path.abspath(os.fspath(path))
    if _special(given):  # nothing to rename over: write through, errors reach the caller
        with open(given, mode) as f:
            yield f
            f.flush()
        return
    full = os.path.realpath(given)
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
