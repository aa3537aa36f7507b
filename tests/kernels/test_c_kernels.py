"""The kernel table at the C level: tests/c/check_kernels.c, built natively and for aarch64.

The checker includes include/mxfp4x/dispatch.h and checks every table entry its CPU can
run: all 256 bytes x 256 scale bytes decoded bit for bit, gemv / panel_dot / axpy_rows
against float64 within the documented bound, bit-identity between the one-token, several-
token, split-rows and panel paths, and the flush-to-zero guard (see the file's header);
decode, gemv, panel_dot and bit-identity again on GGUF block_mxfp4 blocks read in place.

* natively, with the host's C compiler (x86-64 here: scalar, avx2, avx512 as runnable);
* cross-compiled with aarch64-linux-gnu-gcc (-static) and run under qemu-aarch64: the NEON
  kernels, proven without ARM hardware.  Skipped when a tool is missing, unless
  MXFP4X_REQUIRE_QEMU=1 (set in CI), which makes a missing tool a failure.
Needs the checkout (include/ and tests/c/); skipped for a test run without them.
"""
import os
import platform
import shutil
import subprocess

import pytest
from kernel_checker import CHECKER, HEADERS, build, host_cc, parse

X86_ISAS = {"avx2", "avx512", "amx", "avx512bf16"}
ARM_ISAS = {"neon"}
CHECKS = ("decode", "gemv", "panel_dot", "batch", "axpy_rows", "fz", "fma_loop", "dense_bf16",
          "gguf_decode", "gguf_gemv", "gguf_panel", "gguf_batch")
BF16_UNITS = {"amx", "avx512bf16"}  # entries with bf16_rows: their bf16 checks too
BF16_CHECKS = ("bf16", "gguf_bf16")
REQUIRE_QEMU = os.environ.get("MXFP4X_REQUIRE_QEMU") == "1"
IS_AARCH64 = platform.machine().lower() in ("aarch64", "arm64")

pytestmark = pytest.mark.skipif(not (CHECKER.is_file() and (HEADERS / "mxfp4x").is_dir()),
                                reason="needs the checkout's include/ and tests/c/")


def _cross_tools():
    cc = shutil.which("aarch64-linux-gnu-gcc")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    return cc, qemu


def _run(cmd, *args):
    res = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
    return res


def _listed(cmd):
    res = _run(cmd, "--list")
    assert res.returncode == 0, res.stderr
    return dict(line.split() for line in res.stdout.splitlines())


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    cc = host_cc()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc, clang) on PATH")
    return [str(build(cc, tmp_path_factory.mktemp("native") / "check_kernels"))]


@pytest.fixture(scope="module")
def emulated_aarch64(tmp_path_factory):
    """The checker cross-built for aarch64, as a command prefix for qemu-aarch64."""
    if IS_AARCH64:
        pytest.skip("an aarch64 host: the native checker runs the NEON kernels itself")
    cc, qemu = _cross_tools()
    if cc is None or qemu is None:
        missing = [n for n, p in (("aarch64-linux-gnu-gcc", cc), ("qemu-aarch64", qemu))
                   if p is None]
        msg = (f"{', '.join(missing)} not installed (Debian: gcc-aarch64-linux-gnu, "
               f"qemu-user)")
        if REQUIRE_QEMU:
            pytest.fail(f"MXFP4X_REQUIRE_QEMU=1 but {msg}")
        pytest.skip(msg)
    exe = build(cc, tmp_path_factory.mktemp("aarch64") / "check_kernels", ["-static"])
    return [qemu, str(exe)]


def _check_all_ok(cmd, expect_isas):
    res = _run(cmd)
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    got = parse(res.stdout)
    listed = _listed(cmd)
    runnable = {name for name, state in listed.items() if state == "runnable"}
    assert expect_isas <= runnable, (listed, res.stdout)
    for isa in runnable:
        for check in CHECKS + (BF16_CHECKS if isa in BF16_UNITS else ()):
            assert (isa, check) in got, f"{isa} {check} missing:\n{res.stdout}"
            assert got[(isa, check)][1], f"{isa} {check} failed:\n{res.stdout}"
    return got, res.stdout


def test_native_kernels(native):
    """Every ISA this CPU runs, at the C level (x86-64: scalar, avx2, avx512)."""
    expect = {"scalar"} | (ARM_ISAS if IS_AARCH64 else set())
    got, stdout = _check_all_ok(native, expect)
    print(stdout)


def test_neon_kernels_under_qemu(emulated_aarch64):
    """The NEON kernels (and scalar) of an aarch64 build, run under qemu-aarch64."""
    got, stdout = _check_all_ok(emulated_aarch64, {"neon", "scalar"})
    print(stdout)
    assert "arch=aarch64" in stdout


def test_named_isa_runs_only_that_one(native):
    res = _run(native, "scalar")
    assert res.returncode == 0, res.stdout + res.stderr
    assert {isa for isa, _ in parse(res.stdout)} == {"scalar"}
    bad = _run(native, "sse9")
    assert bad.returncode == 2 and "unknown ISA sse9" in bad.stderr


def test_kernel_tables_stay_on_their_architecture(native):
    """An x86-64 build never lists neon, an aarch64 build never lists an x86 ISA; the
    extension itself agrees with the checker's build of the same headers."""
    from mxfp4x._core import cpu as _cpu

    names = set(_listed(native))
    compiled = set(_cpu.compiled_isas())
    assert "scalar" in names and "scalar" in compiled
    if IS_AARCH64:
        assert not names & X86_ISAS and not compiled & X86_ISAS, (names, compiled)
        assert "neon" in names and "neon" in _cpu.runnable_isas()
    else:
        assert not names & ARM_ISAS and not compiled & ARM_ISAS, (names, compiled)


def test_aarch64_table_lists_no_x86_isa(emulated_aarch64):
    listed = _listed(emulated_aarch64)
    assert not set(listed) & X86_ISAS, listed
    assert listed.get("neon") == "runnable" and listed.get("scalar") == "runnable", listed
    assert list(listed)[-1] == "scalar", "scalar is the last entry (the fallback)"


def test_bits_agree_across_builds(native, emulated_aarch64):
    """Decode is exact, so its digest is one value for every ISA of both builds; the
    scalar kernels (IEEE mul and add, never contracted) give the same bits on x86-64 and
    aarch64.  (Today NEON also matches AVX-512 bit for bit: the same 16-lane fused
    order; printed, not required.)"""
    a = parse(_run(native).stdout)
    b = parse(_run(emulated_aarch64).stdout)
    for name in ("decode", "gguf_decode"):
        decode = {d for (isa, check), (d, _) in {**a, **b}.items() if check == name}
        assert len(decode) == 1, (name, decode)
    for check in CHECKS:
        assert a[("scalar", check)] == b[("scalar", check)], check
    if ("avx512", "gemv") in a:
        same = [c for c in CHECKS if a[("avx512", c)][0] == b[("neon", c)][0]]
        print(f"neon digests equal to avx512's for: {same}")


def test_bf16_panel_slices_give_the_same_bits(native, tmp_path):
    """avx512bf16's panel path walks a row's chunks in slices of at most MXFP4X_BF16DP_KC
    (the partials kept in memory between slices; whole rows on an AMD Zen 4, where
    MXFP4X_BF16DP_KC_ZEN4 applies).  The checker's rows have 37 groups, one slice at the
    default lengths; built with slices of 8 on every CPU (five slices, the last of 5) every
    bf16 check must pass and give the default build's digests."""
    from mxfp4x._core import cpu as _cpu

    if "avx512bf16" not in _cpu.runnable_isas():
        pytest.skip("this CPU cannot run avx512bf16")
    flags = ["-DMXFP4X_BF16DP_KC=8", "-DMXFP4X_BF16DP_KC_ZEN4=8"]
    sliced = [str(build(host_cc(), tmp_path / "check_kc8", flags))]
    a = parse(_run(native, "avx512bf16").stdout)
    res = _run(sliced, "avx512bf16")
    assert res.returncode == 0, res.stdout + res.stderr
    b = parse(res.stdout)
    for check in BF16_CHECKS:
        assert b[("avx512bf16", check)][1], f"{check} failed with 8-chunk slices:\n{res.stdout}"
        assert a[("avx512bf16", check)][0] == b[("avx512bf16", check)][0], check


def test_amx_kernels_with_emulated_tiles(native, tmp_path):
    """The amx entry on any AVX-512 host: the checker built with -DMXFP4X_EMULATE_AMX runs
    its tile instructions in C (include/mxfp4x/emulate_amx.h: tdpbf16ps as amx.h models
    it) and the rest of the entry natively.  Every check passes: the register gemv, the
    tiles, partial blocks, the exact-path scans and split row ranges give the same bits,
    and the float32 kernels are avx512's.  On a host with AMX the emulated build's digests
    are the hardware's, check for check (the model against the unit)."""
    emulated = [str(build(host_cc(), tmp_path / "check_amx_emulated", ["-DMXFP4X_EMULATE_AMX"]))]
    if _listed(emulated).get("amx") != "runnable":
        pytest.skip("the amx entry, emulated tiles or not, needs AVX-512 F and BW")
    res = _run(emulated, "amx")
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout}\n{res.stderr[-3000:]}"
    got = parse(res.stdout)
    for check in CHECKS + BF16_CHECKS + ("bf16_dot_loop",):
        assert got.get(("amx", check), (None, False))[1], f"amx {check}:\n{res.stdout}"
    ref = parse(_run(native).stdout)
    for check in CHECKS:  # the entry's float32 kernels are avx512's
        assert got[("amx", check)][0] == ref[("avx512", check)][0], check
    if ("amx", "bf16") in ref:  # a host with the tiles
        for check in CHECKS + BF16_CHECKS + ("bf16_dot_loop",):
            assert got[("amx", check)][0] == ref[("amx", check)][0], (check, res.stdout)


def test_dense_bits_do_not_depend_on_the_row_stream(tmp_path):
    """The AVX-512 dense product at one token streams its rows as cpu.h's
    mxfp4x_dense_stream says (blocks of 8 rows; one row at a time from aligned loads with
    the far prefetch on an AMD Zen 5; one row at a time from plain loads on a Zen 4): the
    checker built each way (MXFP4X_DENSE_STREAM) passes (bf16 tokens against their float32
    widening, the weights at several offsets in a line) and gives the same dense digest
    (which hashes the one-token bf16 results), so every form is checked whichever CPU runs
    the tests."""
    cc = host_cc()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc, clang) on PATH")
    got = {}
    for stream in (0, 1, 2):
        exe = build(cc, tmp_path / f"check_stream{stream}", [f"-DMXFP4X_DENSE_STREAM={stream}"])
        if _listed([str(exe)]).get("avx512") != "runnable":
            pytest.skip("this CPU cannot run avx512")
        res = _run([str(exe)], "avx512")
        assert res.returncode == 0, res.stdout + res.stderr
        got[stream] = parse(res.stdout)[("avx512", "dense_bf16")]
        assert got[stream][1], res.stdout
    assert got[0][0] == got[1][0] == got[2][0], got
