"""What every command's arguments are checked with, before any work: argparse types, and
checks of paths, sizes and memory that report through the command's ``error`` (argparse's
``parser.error``: one line naming the argument, exit status 2)."""
import argparse
import os

from mxfp4x._io import check_writable
from mxfp4x._threads import MAX_THREADS

# what reading a checkpoint's config, index and headers raises on a bad one
CHECKPOINT_ERRORS = (OSError, KeyError, TypeError, ValueError)


def _int_type(lo, hi=None, what="an integer"):
    """An argparse ``type=``: an int in [lo, hi]; argparse reports a refusal as
    ``argument X: expected ..., got ...`` with exit status 2."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive_int = _int_type(1, what="a positive integer")
nonnegative_int = _int_type(0, what="an integer >= 0")
# torch accepts any count and then starts that many threads; the kernels use at most this
thread_count = _int_type(1, MAX_THREADS, what=f"a thread count in [1, {MAX_THREADS}]")


def message(exc):
    # str(KeyError) is the repr of its argument: quotes around the whole message
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def existing_file(path, what, error):
    if not os.path.exists(path):
        error(f"{what}: {path!r} does not exist")
    if os.path.isdir(path):
        error(f"{what}: {path!r} is a folder, expected a file")
    if not os.access(path, os.R_OK):
        error(f"{what}: {path!r} is not readable")


def existing_path(path, what, error):
    if not os.path.exists(path):
        error(f"{what}: {path!r} does not exist")


def writable_folder(path, what, error):
    if not os.path.isdir(path):
        error(f"{what}: {path!r} is not an existing folder")
    if not os.access(path, os.W_OK | os.X_OK):
        error(f"{what}: cannot write in {path!r}")


def folder_to_make(path, what, error):
    """A folder to write in that may not exist yet: its nearest existing ancestor must be
    a folder we can write in, so that ``os.makedirs`` can make the rest.  Nothing is made
    here: a refused command leaves no trace."""
    full = os.path.abspath(path)
    if os.path.exists(full):
        return writable_folder(path, what, error)
    parent = full
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        error(f"{what}: cannot make {path!r}: {parent!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        error(f"{what}: cannot make {path!r}: cannot write in {parent!r}")


def writable(path, what, error):
    try:
        check_writable(path, what)
    except ValueError as exc:
        error(str(exc))


def same_file(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def expert_count(n_experts, top_k, n_model, model, error):
    """``--experts``: at least the experts one token goes to, at most the model's."""
    if n_experts is not None and not top_k <= n_experts <= n_model:
        error(f"argument --experts: expected {top_k} to {n_model} experts ({model} routes "
              f"each token to {top_k} of its {n_model}), got {n_experts}")


def _physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows): not checked
        return None


def memory(n_bytes, what, error):
    """Refuse a size that cannot fit (``n_bytes``: a lower bound of what the command
    holds at once) before the work, rather than fail in an allocation minutes later."""
    total = _physical_memory()
    if total and n_bytes > total:
        error(f"{what}: needs at least {n_bytes / 1e9:.1f} GB of memory, this machine has "
              f"{total / 1e9:.1f} GB")
