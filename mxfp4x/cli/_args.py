"""What every command's arguments are checked with, before any work: argparse types, and
checks of paths, sizes and memory that report through the command's ``error`` (argparse's
``parser.error``: one line naming the argument, exit status 2)."""
import argparse
import os
import stat

from mxfp4x._core.files import check_writable
from mxfp4x._core.threads import MAX_THREADS
from mxfp4x.checkpoints.families import config_path

# what reading a checkpoint's config, index and headers raises on a bad one
CHECKPOINT_ERRORS = (OSError, KeyError, TypeError, ValueError)
# what a checkpoint's folder is read from: a file of these written there joins the
# checkpoint (a .safetensors of an index-less folder is opened as one of its shards)
INDEX = "model.safetensors.index.json"
CHECKPOINT_SUFFIXES = (".safetensors", ".gguf")
CHECKPOINT_NAMES = ("config.json", INDEX)


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


def _kind(mode):
    """What a path that is not a regular file nor a folder is, in words."""
    for test, kind in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a file"


def existing_file(path, what, error):
    """An input file: it exists, and is a regular file (links followed) we may read.  A
    named pipe or a device is refused: reading one waits for a writer that may never
    come, or never ends."""
    if not os.path.exists(path):
        error(f"{what}: {path!r} does not exist")
    if os.path.isdir(path):
        error(f"{what}: {path!r} is a folder, expected a file")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        error(f"{what}: {path!r} is not a regular file ({_kind(mode)}), expected a file")
    if not os.access(path, os.R_OK):
        error(f"{what}: {path!r} is not readable")


def checkpoint_inputs(path, what, error):
    """Before a safetensors checkpoint (a folder, or a file with config.json beside it)
    or a GGUF file is opened: each file opening it reads is a regular file (a named pipe
    among them would hang the command).  The index's shards are checked once the index
    is read: :func:`regular_inputs` of ``checkpoint_files``."""
    existing_path(path, what, error)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.lexists(index):
            existing_file(index, what, error)
        else:  # every .safetensors of the folder is opened
            try:
                names = sorted(os.listdir(path))
            except OSError as exc:
                error(f"{what}: {exc}")
            for name in names:
                if name.endswith(".safetensors"):
                    existing_file(os.path.join(path, name), what, error)
    else:
        existing_file(path, what, error)
    regular_inputs([config_path(path)], what, error)


def regular_inputs(paths, what, error):
    """Those of ``paths`` that exist are regular files (a missing one is reported by the
    command's own checks)."""
    for path in paths:
        if os.path.lexists(path):
            existing_file(path, what, error)


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
    """Whether two paths name one file: the same path once links are followed, or (both
    existing) the same file under two names (a hard link, a case-insensitive folder)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet)
        return False


def outputs(written, error, reads=(), checkpoints=()):
    """The one rule for every file a command writes, checked before any work.

    ``written``: (path, what) of each output (a path None: not asked for); each must be
    writable (:func:`writable`), none the same file as another, nor as a file the command
    reads (``reads``: (path, description) pairs, e.g. the files of a checkpoint, a
    manifest), nor a file that would join a checkpoint the command reads
    (``checkpoints``: their paths, a folder or a file): a ``.safetensors``, ``.gguf``,
    ``config.json`` or index in its folder.  Writing one of those would replace the
    input while it is read, or make the folder another checkpoint than the one read."""
    done = []
    for path, what in written:
        if path is None:
            continue
        writable(path, what, error)
        for other, other_what in done:
            if same_file(path, other):
                error(f"{what}: {path!r} is the same file as {other_what}'s, expected "
                      f"another file")
        for read, described in reads:
            if same_file(path, read):
                error(f"{what}: {path!r} is {described}, which this command reads: "
                      f"expected another file")
        target = os.path.realpath(path)
        name = os.path.basename(target)
        for checkpoint in checkpoints:
            folder = os.path.dirname(config_path(checkpoint))
            if (name.endswith(CHECKPOINT_SUFFIXES) or name in CHECKPOINT_NAMES) and \
                    same_file(os.path.dirname(target), folder):
                error(f"{what}: {path!r} would be a {name!r} in {folder!r}, the folder of "
                      f"the checkpoint this command reads: expected a path outside it, "
                      f"or a name that is not *.safetensors, *.gguf or config.json")
        done.append((path, what))


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
