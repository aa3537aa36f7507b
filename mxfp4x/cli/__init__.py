"""python -m mxfp4x <command>: the main job and the tools.

Every argument is checked before any work starts (a bad one exits with status 2 and a
one-line message, as argparse does), and every file a command writes is replaced whole
(:func:`mxfp4x._core.files.atomic_write`): an error never leaves a user's file half-written.
Inputs are regular files (``_args.existing_file``: a named pipe would be waited on), and
outputs pass one rule (``_args.outputs``): never a file the command reads, nor a file
that would join the checkpoint folder it reads.

A command is a module of this package, each of the same shape: its docstring (the first
paragraph its one-line help, the rest its description), ``add_arguments(parser)``,
``check(args, error)`` (every check of its arguments, run before any work; ``error`` is
its parser's, which exits) and ``run(args)`` (the work; returns the exit status).  Adding
a command is adding its module to ``COMMANDS``.

A termination request (SIGTERM, as ``kill`` and ``torchrun`` send; SIGHUP, a closed
terminal; neither where the caller ignores it, as ``nohup`` does SIGHUP) ends a
command as Ctrl-C does, by an exception in the main thread, so every
``finally`` runs: what a command wrote to remove (a layer of several GB in TMPDIR, a
temporary file beside an output) is removed.  The exit status is 128 + the signal's
number, as a shell reports a process the signal ended.
"""
import argparse
import contextlib
import signal
import sys
import threading

from . import bench, check, ep_bench, info, layer, quantize, roofline, verify

# in the order --help lists them; a module's name, "_" read as "-", is its command's
COMMANDS = (info, bench, check, quantize, verify, layer, roofline, ep_bench)
DEFAULT = bench  # what runs when no command is named


def command_name(module):
    return module.__name__.rpartition(".")[2].replace("_", "-")


def _help(module):
    """(help, description): the first paragraph of the module's docstring, and the rest."""
    first, _, rest = (module.__doc__ or "").strip().partition("\n\n")
    return " ".join(first.split()) + (" (the default)" if module is DEFAULT else ""), rest


def _parser():
    names = [command_name(m) for m in COMMANDS]
    p = argparse.ArgumentParser(
        prog="python -m mxfp4x", description=f"python -m mxfp4x [{' | '.join(names)}]; "
        f"python -m mxfp4x <command> --help for each")
    sub = p.add_subparsers(dest="cmd")
    for module in COMMANDS:
        text, description = _help(module)
        module.add_arguments(sub.add_parser(command_name(module), help=text,
                                            description=description or text))
    return p, sub.choices


# what ends a process without running its ``finally`` blocks unless it is handled
_TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _exit_cleanly_on_termination():
    """SIGTERM and SIGHUP raise ``SystemExit`` in the main thread while a command runs
    where they would end the process on the spot (their default action); a signal the
    caller handles or ignores (``nohup`` ignores SIGHUP) is left so, and the defaults are
    put back after.  Only the main thread may set handlers: elsewhere (a caller running
    ``main`` in a thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mine = [sig for sig in _TERMINATING if signal.getsignal(sig) == signal.SIG_DFL]
    for sig in mine:
        signal.signal(sig, _terminate)
    try:
        yield
    finally:
        for sig in mine:
            signal.signal(sig, signal.SIG_DFL)


def main(argv=None):
    with _exit_cleanly_on_termination():
        return _main(argv)


def _main(argv):
    p, parsers = _parser()
    commands = {command_name(m): m for m in COMMANDS}
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*commands, "-h", "--help"):
        if argv and not argv[0].startswith("-"):
            p.error(f"unknown command {argv[0]!r} (choose from {', '.join(commands)})")
        argv = [command_name(DEFAULT)] + argv
    args = p.parse_args(argv)
    command, error = commands[args.cmd], parsers[args.cmd].error
    command.check(args, error)
    try:
        return command.run(args)
    except OSError as exc:  # a full disk, a file gone: what it is, not a traceback
        print(f"{parsers[args.cmd].prog}: {exc}", file=sys.stderr)
        return 1
