"""python -m mxfp4x ended midway (SIGTERM, as kill and torchrun send; Ctrl-C; an error)
removes what it wrote to remove: the layer ``layer`` and ``ep-bench`` write (up to 16 GB
in TMPDIR at model size) is gone when the process is."""
import os
import signal
import subprocess
import sys
import threading

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# the command, its layer's writing replaced by a few bytes and then {then}: a signal
# sent once "written" is printed comes while the layer is on disk
SCRIPT = """
import sys
import time

from mxfp4x import cli
from mxfp4x.cli._families import MODELS


def write(folder, n_experts):
    with open(folder + "/model.safetensors", "wb") as f:
        f.write(b"a layer")
    print("written", flush=True)
    {then}


for family in MODELS.values():
    family.write = write
sys.exit(cli.main(sys.argv[1:]))
"""

COMMANDS = {
    "layer": ["layer", "--experts", "16", "--tokens", "1"],
    "ep-bench": ["ep-bench", "--experts", "16", "--tokens", "1"],
}


def _start(tmp_path, command, then, waits=True, **kw):
    """The command, writing its layer in tmp_path/layers; returns it once written (and,
    if it ``waits`` there, checks the layer is on disk)."""
    folder = tmp_path / "layers"
    folder.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(then=then), *COMMANDS[command],
         "--dir", str(folder)], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, **kw)
    guard = threading.Timer(120, proc.kill)  # a command that never gets there
    guard.start()
    try:
        line = proc.stdout.readline()
    finally:
        guard.cancel()
    assert line == "written\n", line + proc.communicate()[1]
    if waits:
        (written,) = os.listdir(folder)
        assert os.listdir(folder / written) == ["model.safetensors"]
    return proc, folder


def _finish(proc):
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("still running 60 s after the signal")
    return proc.returncode, out, err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_stopped_command_removes_its_layer(tmp_path, command, sig):
    """SIGTERM ends the command through its ``finally`` blocks (it used to end the
    process on the spot: the layer stayed), with exit status 128 + 15; Ctrl-C too
    (ep-bench had no ``finally`` at all)."""
    # at their defaults in the command, as a terminal's foreground job has them: a suite
    # run as a background job (`pytest &`) ignores SIGINT, and the command keeps an
    # ignored signal ignored (below)
    proc, folder = _start(tmp_path, command, "time.sleep(60)", preexec_fn=lambda: [
        signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM)])
    proc.send_signal(getattr(signal, sig))
    code, _, err = _finish(proc)
    assert os.listdir(folder) == [], err
    if sig == "SIGTERM":
        assert code == 128 + signal.SIGTERM, err
    else:
        assert code != 0


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_failed_command_removes_its_layer(tmp_path, command):
    proc, folder = _start(tmp_path, command, "raise RuntimeError('broken')", waits=False)
    code, _, err = _finish(proc)
    assert code == 1 and "RuntimeError: broken" in err
    assert os.listdir(folder) == []


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP")
def test_an_ignored_hangup_stays_ignored(tmp_path):
    """Under nohup (SIGHUP ignored) a hangup does not end the command: only signals
    whose default action ends the process are turned into an exit."""
    proc, folder = _start(tmp_path, "layer", "time.sleep(2); sys.exit(7)",
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    proc.send_signal(signal.SIGHUP)
    code, _, err = _finish(proc)
    assert code == 7, err  # the command's own end, after the hangup
    assert os.listdir(folder) == []


def test_main_puts_the_handlers_back(cli_main):
    """Run in a process of the caller's (as the tests do), main leaves its signal
    handlers as they were."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert cli_main("info")[0] == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before
