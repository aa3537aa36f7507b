"""Build of the mxfp4x CPU extensions.

Two extensions with the same flags: mxfp4x._core.cpu (the kernels and the parallel driver)
and mxfp4x._core.probes (the roofline loops and test hooks, which run through the driver's
own parallel mechanism), built with OpenMP where the compiler has it (flags chosen by
compiler type), on a pool of POSIX threads or serially otherwise (_threads below).
No -march / -m<isa> flags: the SIMD variants carry their own target attributes and are
chosen at run time (include/mxfp4x/dispatch.h).  No fast-math style optimisation
(FTZ/DAZ would flush the 2^-127 scale), and -ffp-contract=off so the compiler never
fuses a mul and an add that the kernels keep separate: the order of operations defines
the bits.
"""
import hashlib
import os
import platform
import shutil
import sys
import sysconfig
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


def _threads():
    """How the driver's tasks run in parallel (include/mxfp4x/threads.h): "openmp" where
    the extension can share torch's OpenMP runtime, "pthreads" on macOS, "serial" on
    Windows.  MXFP4X_THREADS=openmp|pthreads|serial overrides (CI builds the pthreads
    path on Linux to test it); MXFP4X_DISABLE_OPENMP=1 means serial.

    Linux x86-64: gcc's libgomp, which torch's wheels load first (same soname: one
    runtime).  Linux aarch64: pthreads, see below.
    macOS and Windows: torch ships its own runtime (libomp / Intel's libiomp5md); a
    clang libomp or MSVC's vcomp beside it would be a second OpenMP runtime in the
    process, a known source of crashes and oversubscription.  macOS runs the driver's
    tasks on POSIX threads of its own instead; Windows builds are serial.

    This is the build-time half of the thread policy (what gets compiled, decided before
    the package exists); at run time mxfp4x/_core/threads.py owns it, reading what was built.
    """
    if os.environ.get("MXFP4X_DISABLE_OPENMP", "") == "1":
        return "serial"
    choice = os.environ.get("MXFP4X_THREADS", "")
    if choice:
        if choice not in ("openmp", "pthreads", "serial"):
            raise SystemExit(f"mxfp4x: MXFP4X_THREADS={choice!r}: expected openmp, "
                             "pthreads or serial")
        return choice
    if sys.platform == "darwin":
        return "pthreads"
    if sys.platform.startswith("linux") and platform.machine().lower() in ("aarch64", "arm64"):
        # torch's aarch64 wheels vendor libgomp under a hashed soname (torch 2.9.1:
        # torch.libs/libgomp-a49a47f9.so.1.0.0): the system libgomp would be a second
        # runtime in the process (scripts/arm64_python_check.sh found it)
        return "pthreads"
    return "serial" if sys.platform.startswith("win") else "openmp"


def _flags_string(args):
    """The compile flags, as one C string literal (recorded in backend_info())."""
    text = " ".join(a for a in args if not a.startswith("-D") and not a.startswith("-I"))
    return '"' + "".join(ch for ch in text if ch not in '"\\') + '"'


def _emulate_avx512():
    """MXFP4X_EMULATE_AVX512=1: a test build whose AVX-512 kernels are compiled through
    SIMDe for the x86-64 baseline (include/mxfp4x/emulate_avx512.h), so that their
    source runs, and is tested, on any x86-64.  Never a build to ship or benchmark."""
    return os.environ.get("MXFP4X_EMULATE_AVX512", "") == "1"


def _emulate_amx():
    """MXFP4X_EMULATE_AMX=1: a test build whose amx entry runs its tile instructions in C
    (include/mxfp4x/emulate_amx.h) and the rest natively, so that the entry runs, and is
    tested, on any CPU with AVX-512 F and BW.  Never a build to ship or benchmark."""
    return os.environ.get("MXFP4X_EMULATE_AMX", "") == "1"


def _simde_include():
    """The folder holding simde/x86/avx512.h: MXFP4X_SIMDE_INCLUDE, the simde-py
    package, or the system's (Debian/Ubuntu libsimde-dev).  None for a folder the
    compiler searches anyway; a build error saying how to get SIMDe if none has it."""
    candidates = [os.environ.get("MXFP4X_SIMDE_INCLUDE", "")]
    try:
        import simde_py
        candidates.append(simde_py.get_include())
    except ImportError:
        pass
    system = ["/usr/include", "/usr/local/include"]
    for folder in candidates + system:
        if folder and os.path.isfile(os.path.join(folder, "simde", "x86", "avx512.h")):
            return None if folder in system else folder
    raise SystemExit("mxfp4x: MXFP4X_EMULATE_AVX512=1 needs the SIMDe headers: "
                     "apt-get install libsimde-dev, or pip install simde-py, or set "
                     "MXFP4X_SIMDE_INCLUDE to the folder that holds simde/x86/avx512.h")


# pip's editable installs build in a new temporary folder every time, so each
# `pip install -e .` compiled both extensions again; a built extension is kept here, keyed
# by everything that goes into it, and copied back while none of that changed
_CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "build", "ext-cache")


def _file_identity(path):
    """What identifies a tool: its resolved path, size and modification time."""
    found = shutil.which(path) or path
    try:
        st = os.stat(found)
    except OSError:
        return repr(found)
    return repr((os.path.realpath(found), st.st_size, st.st_mtime_ns))


class BuildExt(build_ext):
    def _cache_key(self, ext):
        h = hashlib.sha256()
        compiler_so = list(getattr(self.compiler, "compiler_so", None) or [])
        linker_so = list(getattr(self.compiler, "linker_so", None) or [])
        for part in (ext.name, sys.version, sysconfig.get_config_var("EXT_SUFFIX"),
                     ext.extra_compile_args, ext.extra_link_args, ext.define_macros,
                     ext.undef_macros, ext.include_dirs, ext.libraries, ext.library_dirs,
                     compiler_so, linker_so, self.compiler.compiler_type,
                     [_file_identity(c) for c in (compiler_so[:1] + linker_so[:1])]):
            h.update(repr(part).encode() + b"\0")
        for path in sorted(set(ext.sources) | set(ext.depends or [])):
            h.update(path.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        return h.hexdigest()[:32]

    def build_extension(self, ext):
        """The extension from the cache where everything that goes into it is unchanged
        (never with --force, which the test lanes' builds use); else built, then kept."""
        target = self.get_ext_fullpath(ext.name)
        if self.compiler.compiler_type == "msvc":
            return super().build_extension(ext)
        cached = os.path.join(_CACHE, ext.name + "-" + self._cache_key(ext) +
                              os.path.splitext(target)[1])
        if not self.force and os.path.isfile(cached):
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            partial = f"{target}.{os.getpid()}"  # a new file: a process may map the old
            shutil.copyfile(cached, partial)
            os.replace(partial, target)
            print(f"mxfp4x: {ext.name} unchanged: {cached}", file=sys.stderr)
            return None
        super().build_extension(ext)
        try:  # another build may store the same key at once: whole files only
            os.makedirs(_CACHE, exist_ok=True)
            earlier = sorted((os.path.join(_CACHE, n) for n in os.listdir(_CACHE)
                              if n.startswith(ext.name + "-")), key=os.path.getmtime)
            for old in earlier[:-2]:  # this extension's last two builds kept, and this one
                os.remove(old)
            partial = f"{cached}.{os.getpid()}"
            shutil.copyfile(target, partial)
            os.replace(partial, cached)
        except OSError:
            pass
        return None

    def build_extensions(self):
        kind = _compiler_kind(self.compiler)
        if kind == "msvc":
            base = ["/O2", "/fp:precise"]
        else:
            base = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing",
                    "-Wno-unused-function"]
        omp_c, omp_l = _openmp_flags(kind)
        threads = _threads()
        if threads == "openmp" and not _try_compile(self.compiler, omp_c, omp_l):
            threads = "serial"
        if threads != "openmp":
            omp_c, omp_l = [], []
            print(f"mxfp4x: the CPU driver's threads: {threads} (no OpenMP runtime shared "
                  "with torch on this platform, or MXFP4X_THREADS / MXFP4X_DISABLE_OPENMP "
                  "says so)", file=sys.stderr)
        if threads == "pthreads":
            if kind == "msvc":
                raise SystemExit("mxfp4x: MXFP4X_THREADS=pthreads needs gcc or clang")
            omp_c, omp_l = ["-pthread"], ["-pthread"]
            for ext in self.extensions:
                ext.define_macros = list(ext.define_macros or []) + [("MXFP4X_PTHREADS", "1")]
        # what the compiler will really see: its own command (with CFLAGS from the
        # environment and Python's build flags) plus ours
        driver = list(getattr(self.compiler, "compiler_so", None) or [])[1:]
        if _emulate_avx512():
            if kind == "msvc":
                raise SystemExit("mxfp4x: MXFP4X_EMULATE_AVX512=1 needs gcc or clang")
            simde = _simde_include()
            print("mxfp4x: building the SIMDe-emulated AVX-512 kernels (a test build, "
                  f"SIMDe from {simde or 'the system include path'})", file=sys.stderr)
            for ext in self.extensions:
                ext.define_macros = list(ext.define_macros or []) + [
                    ("MXFP4X_EMULATE_AVX512", "1")]
                ext.include_dirs = list(ext.include_dirs or []) + ([simde] if simde else [])
                # SIMDe passes 64-byte vectors by value without AVX-512: GCC's ABI note
                ext.extra_compile_args = list(ext.extra_compile_args or []) + ["-Wno-psabi"]
                ext.libraries = list(ext.libraries or []) + ["m"]  # fmaf
        if _emulate_amx():
            if kind == "msvc" or _emulate_avx512():
                raise SystemExit("mxfp4x: MXFP4X_EMULATE_AMX=1 needs gcc or clang, and "
                                 "not MXFP4X_EMULATE_AVX512=1 (the SIMDe build has no amx)")
            print("mxfp4x: building the amx entry with its tiles in C (a test build)",
                  file=sys.stderr)
            for ext in self.extensions:
                ext.define_macros = list(ext.define_macros or []) + [
                    ("MXFP4X_EMULATE_AMX", "1")]
                ext.libraries = list(ext.libraries or []) + ["m"]  # fmaf
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
    headers = sorted(os.path.relpath(os.path.join(d, n), here)
                     for d, _, names in os.walk(os.path.join(here, "include", "mxfp4x"))
                     for n in names if n.endswith(".h"))
    exts = [Extension(f"mxfp4x._core.{name}", sources=[f"mxfp4x/_core/{name}.pyx"],
                      include_dirs=[os.path.join(here, "include")], depends=headers)
            for name in ("cpu", "probes")]
    return cythonize(exts, compiler_directives={"language_level": "3"},
                     include_path=[here])


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt})
