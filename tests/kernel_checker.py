"""Building and reading the C-level kernel checker (tests/c/check_kernels.c): shared by
tests/kernels/test_c_kernels.py (native, aarch64 under qemu) and
tests/platform/test_emulation.py (the
SIMDe-emulated AVX-512 kernels)."""
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT / "tests" / "c" / "check_kernels.c"
HEADERS = ROOT / "include"
# as the extension's build (setup.py): no -m<isa>, no fast-math, nothing contracted
FLAGS = ["-O2", "-std=c11", "-ffp-contract=off", "-Wall", "-Wno-unused-function"]


def host_cc():
    """The host's C compiler ($CC, cc, gcc or clang), or None."""
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(cc, out, extra=(), timeout=300):
    """The checker compiled by ``cc`` with ``extra`` flags into ``out``."""
    cmd = [cc, *FLAGS, *extra, f"-I{HEADERS}", str(CHECKER), "-o", str(out), "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-4000:]}"
    return out


def parse(stdout):
    """{(isa, check): (digest, ok)} from the checker's result lines."""
    out = {}
    for line in stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        isa, check, digest, status = line.split()[:4]
        out[(isa, check)] = (digest, status == "ok")
    return out
