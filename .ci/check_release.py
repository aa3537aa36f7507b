"""Release checks that run here: the cibuildwheel configuration yields the expected
build identifiers; the sdist holds everything needed to build the wheel from it; the
wheel installs into a clean virtual environment and the test suite passes against it,
run from a directory outside the checkout."""
import glob
import os
import subprocess
import sys
import tarfile
import tempfile

EXPECTED = {
    "linux": {f"cp3{v}-manylinux_{a}" for v in range(10, 15) for a in ("x86_64", "aarch64")},
    "macos": {f"cp3{v}-macosx_{a}" for v in range(10, 15) for a in ("x86_64", "arm64")},
    "windows": {f"cp3{v}-win_amd64" for v in range(10, 15)},
}


def main():
    for platform, expected in EXPECTED.items():
        out = subprocess.run(["cibuildwheel", "--print-build-identifiers", "--platform",
                              platform], capture_output=True, text=True, check=True).stdout
        got = set(out.split())
        if got != expected:
            sys.exit(f"cibuildwheel {platform}: expected {sorted(expected)}, got {sorted(got)}")
        print(f"cibuildwheel {platform}: {len(got)} identifiers ok")
    with tempfile.TemporaryDirectory() as dist:
        # --sdist --wheel builds the wheel from the sdist: a missing file fails here
        subprocess.run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", dist],
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
        print(f"sdist ok ({len(names)} files); wheel {os.path.basename(wheels[0])} "
              f"({os.path.getsize(wheels[0]) / 1e6:.2f} MB)")
        clean_venv_tests(wheels[0])


def clean_venv_tests(wheel):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        venv = os.path.join(tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        pip = [py, "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + ["torch==2.13.0"], check=True)
        subprocess.run(pip + [wheel + "[test]"], check=True)
        out = subprocess.run([py, "-m", "pytest", os.path.join(root, "tests"), "-q",
                              "-p", "no:cacheprovider", "-x", "-rfE", "--tb=short"], cwd=tmp,
                             capture_output=True, text=True)
        print(out.stdout[-600:])
        if out.returncode != 0:
            # the failing test's name, its short traceback and the seed, whatever their length
            head = "\n".join(line for line in out.stdout.splitlines()[:8] if "seed=" in line)
            failed = [line for line in out.stdout.splitlines()
                      if line.startswith(("FAILED", "ERROR"))]
            sys.exit("tests against the wheel in a clean venv failed:\n" + head + "\n"
                     + "\n".join(failed) + "\n" + out.stdout[-6000:] + "\n" + out.stderr[-2000:])
        print("clean venv: the test suite passes against the installed wheel")


if __name__ == "__main__":
    main()
