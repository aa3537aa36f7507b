"""Release checks that run here: the cibuildwheel configuration yields the expected
build identifiers; the sdist holds everything needed to build the wheel from it; the
wheel holds the two extensions where the package imports them and nothing stale; the
wheel installs into a clean virtual environment and the packaging tests pass against it
(every module imports, the build's flags, the ISA dispatch, the op), run from a directory
outside the checkout.  The full suite runs against the editable install (README command
2); this run checks what the wheel adds: its files and its build.

    python .ci/check_release.py build DIST   # identifiers, sdist -> wheel into DIST
    python .ci/check_release.py test DIST    # DIST's wheel in a clean venv, its tests
    python .ci/check_release.py              # both, in a temporary folder
"""
import glob
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

EXPECTED = {
    "linux": {f"cp3{v}-manylinux_{a}" for v in range(10, 15) for a in ("x86_64", "aarch64")},
    "macos": {f"cp3{v}-macosx_{a}" for v in range(10, 15) for a in ("x86_64", "arm64")},
    "windows": {f"cp3{v}-win_amd64" for v in range(10, 15)},
}


# what the wheel's tests are (paths under tests/): the packaging checks and the op
WHEEL_TESTS = ("platform/test_build.py", "kernels/test_dispatch.py", "api/test_moe.py",
               "api/test_slots.py")


def build(dist):
    for platform, expected in EXPECTED.items():
        out = subprocess.run(["cibuildwheel", "--print-build-identifiers", "--platform",
                              platform], capture_output=True, text=True, check=True).stdout
        got = set(out.split())
        if got != expected:
            sys.exit(f"cibuildwheel {platform}: expected {sorted(expected)}, got {sorted(got)}")
        print(f"cibuildwheel {platform}: {len(got)} identifiers ok")
    # no --sdist / --wheel: build makes the sdist, then the wheel from it, so a file
    # missing from the sdist fails here (with both flags it would build each from the
    # checkout, and a stale build/lib/ of the checkout would end up in the wheel)
    subprocess.run([sys.executable, "-m", "build", "--outdir", dist],
                   check=True, stdout=subprocess.DEVNULL)
    sdist = glob.glob(os.path.join(dist, "*.tar.gz"))[0]
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    need = {"setup.py", "pyproject.toml", "README.md", "LICENSE", "mxfp4x/_core/cpu.pyx",
            "mxfp4x/_core/cpu.pxd", "mxfp4x/_core/probes.pyx", "mxfp4x/_core/capi.pxd",
            "mxfp4x/_core/cpu_tasks.pxi", "mxfp4x/_core/__init__.py",
            "include/mxfp4x/dispatch.h", "include/mxfp4x/avx2.h",
            "include/mxfp4x/avx512.h", "include/mxfp4x/scalar.h", "include/mxfp4x/cpu.h",
            "include/mxfp4x/neon.h", "include/mxfp4x/threads.h", "include/mxfp4x/amx.h",
            "include/mxfp4x/generic/decode.h", "include/mxfp4x/dense/avx512.h"}
    missing = need - names
    if missing:
        sys.exit(f"sdist lacks {sorted(missing)}")
    wheels = glob.glob(os.path.join(dist, "*.whl"))
    check_wheel(wheels[0])
    print(f"sdist ok ({len(names)} files); wheel {os.path.basename(wheels[0])} "
          f"({os.path.getsize(wheels[0]) / 1e6:.2f} MB)")


def main(argv):
    if len(argv) == 3 and argv[1] in ("build", "test"):
        if argv[1] == "build":
            build(argv[2])
        else:
            clean_venv_tests(glob.glob(os.path.join(argv[2], "*.whl"))[0])
        return
    if len(argv) != 1:
        sys.exit(__doc__)
    with tempfile.TemporaryDirectory() as dist:
        build(dist)
        clean_venv_tests(glob.glob(os.path.join(dist, "*.whl"))[0])


def check_wheel(wheel):
    """The wheel's extensions are mxfp4x._core.cpu and mxfp4x._core.probes and no other
    (an extension left at a path the package no longer imports is a stale build's), with
    the sources and stubs beside them."""
    names = set(zipfile.ZipFile(wheel).namelist())
    extensions = sorted(n.split(".", 1)[0] for n in names if n.endswith((".so", ".pyd")))
    if extensions != ["mxfp4x/_core/cpu", "mxfp4x/_core/probes"]:
        sys.exit(f"wheel: expected the extensions mxfp4x/_core/cpu and probes, got {extensions}")
    need = {"mxfp4x/py.typed", "mxfp4x/nn.py", "mxfp4x/_core/cpu.pyi",
            "mxfp4x/_core/probes.pyi", "mxfp4x/_core/cpu.pyx", "mxfp4x/_core/cpu.pxd",
            "mxfp4x/_core/capi.pxd", "mxfp4x/_core/cpu_tasks.pxi", "mxfp4x/models/experts.py"}
    missing = need - names
    if missing:
        sys.exit(f"wheel lacks {sorted(missing)}")


def clean_venv_tests(wheel):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        venv = os.path.join(tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        pip = [py, "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + ["torch==2.13.0"], check=True)
        subprocess.run(pip + [wheel + "[test]"], check=True)
        tests = [os.path.join(root, "tests", t) for t in WHEEL_TESTS]
        out = subprocess.run([py, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider",
                              "-x", "-rfE", "--tb=short"], cwd=tmp, capture_output=True,
                             text=True)
        print(out.stdout[-600:])
        if out.returncode != 0:
            # the failing test's name, its short traceback and the seed, whatever their length
            head = "\n".join(line for line in out.stdout.splitlines()[:8] if "seed=" in line)
            failed = [line for line in out.stdout.splitlines()
                      if line.startswith(("FAILED", "ERROR"))]
            sys.exit("tests against the wheel in a clean venv failed:\n" + head + "\n"
                     + "\n".join(failed) + "\n" + out.stdout[-6000:] + "\n" + out.stderr[-2000:])
        print("clean venv: the packaging tests pass against the installed wheel")


if __name__ == "__main__":
    main(sys.argv)
