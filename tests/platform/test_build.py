"""The build as it really is: the flags the extension was compiled with, what the
compiler's own macros say, and how the package imports (or refuses to)."""
import os
import shutil
import subprocess
import sys

import pytest

import mxfp4x

# flags that change results (FTZ/DAZ flush the 2^-127 scale; reassociation changes sums)
# or tie the binary to the build machine's CPU
_FORBIDDEN = ("-ffast-math", "-Ofast", "-funsafe-math-optimizations", "-ffinite-math-only",
              "-march=native", "-mavx", "-mavx2", "-mavx512f", "-mfma", "-mtune=native")


def test_build_flags_are_shippable():
    build = mxfp4x.backend_info()["build"]
    assert not build["fast_math"], build       # __FAST_MATH__ / __FINITE_MATH_ONLY__ seen
    assert not build["global_isa_flags"], build  # __AVX__ etc. defined at file scope
    if build["cflags"] == "unknown":
        pytest.skip("this compiler's flags are not recorded (MSVC)")
    flags = build["cflags"].split()
    for flag in _FORBIDDEN:
        assert flag not in flags, (flag, build["cflags"])
    assert not any(f.startswith("-march=") and f != "-march=x86-64" for f in flags), flags
    contract = [f for f in flags if f.startswith("-ffp-contract=")]
    assert contract and contract[-1] == "-ffp-contract=off", flags  # the last one wins


def test_build_is_not_emulated_unless_asked():
    """MXFP4X_EMULATE_AVX512=1 builds the AVX-512 kernels through SIMDe, and
    MXFP4X_EMULATE_AMX=1 the amx entry with its tiles in C (test builds: exact but slow,
    tests/platform/test_emulation.py, include/mxfp4x/emulate_amx.h); a build without them
    never is one."""
    emulated = mxfp4x.backend_info()["build"]["emulated"]
    asked = "avx512" if os.environ.get("MXFP4X_EMULATE_AVX512") == "1" else \
        "amx" if os.environ.get("MXFP4X_EMULATE_AMX") == "1" else None
    assert emulated == asked, (emulated, asked)


def test_version_is_known():
    assert mxfp4x.__version__ != "0+unknown" or not os.environ.get("CI"), \
        "CI runs an installed (or editable-installed) mxfp4x, which has metadata"


def test_nn_is_an_attribute_after_import():
    out = subprocess.run([sys.executable, "-c", "import mxfp4x, sys; "
                          "assert 'mxfp4x.nn' not in sys.modules; "
                          "print(mxfp4x.nn.MXFP4Experts.__name__)"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MXFP4Experts"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mxfp4x.nope  # noqa: B018


def test_unbuilt_checkout_fails_with_how_to_build(tmp_path):
    """A source tree without the compiled extension does not silently import another
    copy: it fails and says how to build.  (The copy gets another name, so that an
    editable install's import hook cannot resolve it to the real checkout.)"""
    pkg = os.path.dirname(os.path.abspath(mxfp4x.__file__))
    shutil.copytree(pkg, tmp_path / "mxfp4x_unbuilt",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "*.c"))
    out = subprocess.run([sys.executable, "-c", "import mxfp4x_unbuilt"], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "pip install -e ." in out.stderr, out.stderr


# the optional dependencies a module of the package may need (installed separately)
_OPTIONAL = {"vllm", "triton"}


def test_every_module_imports():
    """Every module of the installed package imports (run against the wheel too, by the
    release check): nothing it needs was left out of the wheel or the dependencies.  A
    module needing an optional dependency that is absent is the only exception."""
    import importlib
    import pkgutil
    imported, optional = 0, []
    for info in pkgutil.walk_packages(mxfp4x.__path__, "mxfp4x."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in _OPTIONAL:
                raise
            optional.append(info.name)
        imported += 1
    assert imported > 50 and len(optional) < 5, (imported, optional)
