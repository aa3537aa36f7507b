"""Build of the mxfp4x CPU extension.

One extension, mxfp4x._cpu, built with OpenMP where the compiler has it (flags
chosen by compiler type) and serially otherwise.  No -march / -m<isa> flags:
the SIMD variants carry their own target attributes and are chosen at run time
(include/mxfp4x/dispatch.h).  No fast-math style optimisation (FTZ/DAZ would
flush the 2^-127 scale), and -ffp-contract=off so the compiler never fuses a mul
and an add that the kernels keep separate: the order of operations defines the bits.
"""
import os
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _compiler_kind(compiler):
    if compiler.compiler_type == "msvc":
        return "msvc"
    cc = " ".join(getattr(compiler, "compiler", []) or [])
    if "clang" in cc or sys.platform == "darwin":
        # Apple's clang has no -fopenmp driver flag; a Homebrew/LLVM clang does
        return "apple-clang" if sys.platform == "darwin" and "llvm" not in cc else "clang"
    return "gcc"


def _openmp_flags(kind):
    """(compile flags, link flags) for OpenMP with this compiler kind."""
    if kind == "msvc":
        return ["/openmp"], []
    if kind == "apple-clang":
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    return ["-fopenmp"], ["-fopenmp"]


def _try_compile(compiler, cflags, lflags):
    """Whether a small OpenMP program compiles and links with these flags."""
    src = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "omp_check.c")
        with open(path, "w") as f:
            f.write(src)
        try:
            objs = compiler.compile([path], output_dir=tmp, extra_postargs=cflags)
            compiler.link_executable(objs, os.path.join(tmp, "omp_check"), extra_postargs=lflags)
        except Exception:  # noqa: BLE001 - any failure means "no OpenMP"
            return False
    return True


def _openmp_wanted():
    """OpenMP only where the extension can share torch's runtime.

    Linux: gcc's libgomp, which torch's wheels load first (same soname: one runtime).
    macOS and Windows: torch ships its own runtime (libomp / Intel's libiomp5md); a
    clang libomp or MSVC's vcomp beside it would be a second OpenMP runtime in the
    process, a known source of crashes and oversubscription.  Those builds are serial
    (the README's platform table); MXFP4X_DISABLE_OPENMP=1 makes any build serial.
    """
    if os.environ.get("MXFP4X_DISABLE_OPENMP", "") == "1":
        return False
    return not (sys.platform == "darwin" or sys.platform.startswith("win"))


def _flags_string(args):
    """The compile flags, as one C string literal (recorded in backend_info())."""
    text = " ".join(a for a in args if not a.startswith("-D") and not a.startswith("-I"))
    return '"' + "".join(ch for ch in text if ch not in '"\\') + '"'


class BuildExt(build_ext):
    def build_extensions(self):
        kind = _compiler_kind(self.compiler)
        if kind == "msvc":
            base = ["/O2", "/fp:precise"]
        else:
            base = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing",
                    "-Wno-unused-function"]
        omp_c, omp_l = _openmp_flags(kind)
        use_omp = _openmp_wanted() and _try_compile(self.compiler, omp_c, omp_l)
        if not use_omp:
            omp_c, omp_l = [], []
            print("mxfp4x: building the serial CPU kernels (no OpenMP runtime shared with "
                  "torch on this platform, or MXFP4X_DISABLE_OPENMP=1)", file=sys.stderr)
        # what the compiler will really see: its own command (with CFLAGS from the
        # environment and Python's build flags) plus ours
        driver = list(getattr(self.compiler, "compiler_so", None) or [])[1:]
        for ext in self.extensions:
            ext.extra_compile_args = base + omp_c + list(ext.extra_compile_args or [])
            ext.extra_link_args = omp_l + list(ext.extra_link_args or [])
            if kind != "msvc":
                ext.define_macros = list(ext.define_macros or []) + [
                    ("MXFP4X_BUILD_CFLAGS", _flags_string(driver + ext.extra_compile_args))]
        super().build_extensions()


def _extensions():
    from Cython.Build import cythonize

    here = os.path.dirname(os.path.abspath(__file__))
    ext = Extension(
        "mxfp4x._cpu",
        sources=["mxfp4x/_cpu.pyx"],
        include_dirs=[os.path.join(here, "include")],
        depends=[os.path.join("include", "mxfp4x", n) for n in
                 ("mxfp4x.h", "config.h", "cpu.h", "scalar.h", "avx2.h", "avx512.h",
                  "dispatch.h")],
    )
    return cythonize([ext], compiler_directives={"language_level": "3"},
                     include_path=[here])


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
