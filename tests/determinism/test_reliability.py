"""Reliability: garbage never crashes, determinism, batch invariance, thread safety,
special values under a hostile floating-point environment, huge tensors, no leaks."""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x.testing.layers import assert_matches_reference, random_layer, run_threads

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: conftest.py


_GARBAGE = r"""
import sys, numpy as np, torch, mxfp4x
rng = np.random.default_rng(int(sys.argv[1]))
n_cases = int(sys.argv[2])
NAMES = ["latent_tokens", "packed_weights", "scale_bytes", "selected_experts",
         "mixture_weights", "shared_output"]
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]

def pick(items):
    return items[int(rng.integers(0, len(items)))]

def valid():
    T, K, E, O, G = (int(v) for v in rng.integers(0, 4, 5))
    E = max(E, 1)
    return dict(latent_tokens=torch.randn(T, 32 * G),
                packed_weights=torch.randint(0, 256, (E, O, G, 16), dtype=torch.uint8),
                scale_bytes=torch.randint(0, 256, (E, O, G), dtype=torch.uint8),
                selected_experts=torch.randint(0, E, (T, K)),
                mixture_weights=torch.rand(T, K), shared_output=torch.randn(T, O))

def garbage(v):
    kind = int(rng.integers(0, 12))
    if kind == 0:
        return pick([None, "x", 3.5, 7, {"a": 1}, object(), b"abc", [[]], [[1, 2], [3]]])
    if kind == 1:  # wrong rank
        return torch.randn(tuple(int(d) for d in rng.integers(0, 4, int(rng.integers(0, 6)))))
    if kind == 2:  # wrong dtype
        return torch.zeros(tuple(v.shape), dtype=DTYPES[int(rng.integers(0, len(DTYPES)))]) \
            if isinstance(v, torch.Tensor) else v
    if kind == 3:  # wrong shape, same rank
        return torch.zeros(tuple(int(d) for d in rng.integers(0, 5, v.dim())), dtype=v.dtype)
    if kind == 4:  # negative / huge ids or bytes
        return torch.full(tuple(v.shape), pick([-1, -2**40, 256, 2**40, 2**63 - 1]),
                          dtype=torch.int64)
    if kind == 5:  # float ids / values
        return v.double() * 1.5
    if kind == 6:  # numpy object / string arrays
        return np.array([["a", "b"]], dtype=object)
    if kind == 7:  # NaN / inf everywhere
        return torch.full(tuple(v.shape), pick([np.nan, np.inf]))
    if kind == 8:  # empty dims
        return v[..., :0] if v.dim() else v
    if kind == 9:  # a numpy view with negative strides
        return v.numpy()[::-1] if v.dtype != torch.bfloat16 and v.dim() else v
    if kind == 10:  # sparse
        return v.to_sparse() if v.dim() and not v.dtype.is_complex else v
    return v

ok = raised = 0
for case in range(n_cases):
    args = valid()
    for name in rng.choice(NAMES, int(rng.integers(1, 3)), replace=False).tolist():
        args[name] = garbage(args[name])
    kwargs = {}
    if rng.random() < 0.1:
        kwargs["num_threads"] = pick([0, -1, 1.5, "2", True, 10**12, 3, None])
    if rng.random() < 0.1:
        kwargs["backend"] = pick(["cpu", "torch", "gpu", 3, None])
    try:
        y = mxfp4x.mxfp4_experts(**args, **kwargs)
    except (ValueError, TypeError, IndexError):
        raised += 1
        continue
    assert isinstance(y, torch.Tensor)
    ok += 1
print(f"cases={n_cases} ok={ok} raised={raised}")
"""


def test_garbage_never_crashes():
    """Random garbage for every argument: only ValueError/TypeError/IndexError, no crash
    (run in a subprocess so that a segfault is a failure, not a lost test run)."""
    n = int(os.environ.get("MXFP4X_GARBAGE_CASES", "2000"))
    out = subprocess.run([sys.executable, "-c", _GARBAGE, str(np.random.SeedSequence().entropy
                                                                % 2**32), str(n)],
                         capture_output=True, text=True, timeout=900, cwd=HERE)
    assert out.returncode == 0, f"crashed or failed (rc={out.returncode}):\n{out.stderr[-3000:]}"
    counts = dict(kv.split("=") for kv in out.stdout.split())
    assert int(counts["cases"]) == n and int(counts["raised"]) > n // 4, out.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_bitwise_deterministic_1_to_4_threads_and_repeats(isa, rng, dtype):
    layer = random_layer(rng, 45, 4, 5, 333, 7, dtype=dtype, repeat_expert=True)
    first = mxfp4x.mxfp4_experts(**layer, num_threads=1, isa=isa)
    for n in (2, 3, 4, 1, 4):
        y = mxfp4x.mxfp4_experts(**layer, num_threads=n, isa=isa)
        assert torch.equal(y.view(torch.uint8), first.view(torch.uint8)), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_batch_invariance_1_7_512(isa, rng, dtype):
    """A token's row is bit-identical alone, in a batch of 7 and in a batch of 512 whose
    other tokens go to the same experts (so those experts take the many-token path)."""
    n_experts, top_k = 6, 3
    big = random_layer(rng, 512, top_k, n_experts, 100, 5, dtype=dtype)
    big["selected_experts"][:] = torch.tensor([4, 1, 4])  # everyone: experts 4, 1, 4
    row = 300

    def take(idx):
        return {k: (v if k in ("packed_weights", "scale_bytes") else v[idx])
                for k, v in big.items()}

    y512 = mxfp4x.mxfp4_experts(**big, isa=isa)
    y1 = mxfp4x.mxfp4_experts(**take(slice(row, row + 1)), isa=isa)
    y7 = mxfp4x.mxfp4_experts(**take(slice(row - 3, row + 4)), isa=isa)
    assert torch.equal(y1[0].view(torch.uint8), y512[row].view(torch.uint8))
    assert torch.equal(y7[3].view(torch.uint8), y512[row].view(torch.uint8))
    assert_matches_reference(y1, take(slice(row, row + 1)))


def test_eight_python_threads_concurrently(rng):
    layers = [random_layer(np.random.default_rng(i), 9 + i, 3, 4, 150, 6) for i in range(8)]
    expected = [mxfp4x.mxfp4_experts(**layer, num_threads=1) for layer in layers]
    got = [None] * 8

    def work(i):
        for _ in range(5):
            got[i] = mxfp4x.mxfp4_experts(**layers[i], num_threads=1 + i % 2)
            assert torch.equal(got[i], expected[i])

    errors = run_threads(8, work)
    assert not errors, errors
    for g, e in zip(got, expected, strict=False):
        assert torch.equal(g, e)


def test_gil_is_released_during_the_kernel(rng):
    """While one thread is inside the kernel, another thread keeps running Python code.

    The switch interval is raised to 5 s, so the worker never gives the GIL up while it
    runs Python code: the main thread can only run while the worker is ``inside`` if the
    kernel released the GIL.  (The main thread yields with sleep(0) every iteration, so
    the worker gets the GIL back at once after the kernel.)"""
    import time

    layer = random_layer(rng, 64, 4, 4, 2048, 40)
    state = {"inside": False, "count": 0, "calls": 0}
    done = threading.Event()

    def worker():
        for _ in range(3):
            state["inside"] = True
            mxfp4x.mxfp4_experts(**layer, num_threads=1)
            state["inside"] = False
            state["calls"] += 1
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        t = threading.Thread(target=worker)
        t.start()
        while not done.is_set():
            if state["inside"]:
                state["count"] += 1
            time.sleep(0)
        t.join()
    finally:
        sys.setswitchinterval(old)
    assert state["calls"] == 3
    assert state["count"] > 20, state


def test_subnormal_scale_survives_flush_denormal_and_bf16(isa):
    """s = 0 gives exactly 2^-127 * value on the fp32 and fp64 paths, even after a bf16
    call and with FTZ/DAZ switched on in the calling thread."""
    x = torch.zeros(1, 32)
    x[0, 2] = 1.0
    packed = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    packed[0, 0, 0, 1] = 0x05  # element 2: code 5 = 3.0
    scales = torch.zeros(1, 1, 1, dtype=torch.uint8)
    mxfp4x.mxfp4_experts(x.bfloat16(), packed, scales, [[0]], [[1.0]], [[0.0]], isa=isa)
    had = torch.set_flush_denormal(True)
    try:
        for dtype in (torch.float32, torch.float64):
            y = mxfp4x.mxfp4_experts(x.to(dtype), packed, scales, [[0]], [[1.0]], [[0.0]],
                                     backend="cpu", num_threads=2, isa=isa)
            assert y.item() == 3.0 * 2.0 ** -127, (dtype, y.item())
        # the caller's floating-point environment is restored: it still flushes
        if had:
            tiny = torch.tensor([1e-40], dtype=torch.float32)
            assert (tiny * 1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)


def test_torch_path_keeps_subnormal_scale_under_flush_denormal():
    """The PyTorch path (backend='torch') and dequantize decode scale byte 0 to 2^-127 on
    the CPU with FTZ/DAZ switched on in the calling thread, as the kernels do; the
    caller's flushing is still on afterwards."""
    x = torch.zeros(1, 32)
    x[0, 2] = 1.0
    packed = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    packed[0, 0, 0, 1] = 0x05  # element 2: code 5 = 3.0
    scales = torch.zeros(1, 1, 1, dtype=torch.uint8)
    want = torch.tensor([[3.0 * 2.0 ** -127]])
    had = torch.set_flush_denormal(True)
    try:
        got = {dtype: mxfp4x.mxfp4_experts(x.to(dtype), packed, scales, [[0]], [[1.0]], [[0.0]],
                                           backend="torch")
               for dtype in (torch.float32, torch.bfloat16)}
        weights = mxfp4x.dequantize(packed[0], scales[0])
        still_flushes = (torch.tensor([1e-40]) * 1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
    # compared by their bits, read with flushing off
    assert torch.equal(got[torch.float32].view(torch.int32), want.view(torch.int32))
    assert torch.equal(got[torch.bfloat16], want.bfloat16())
    assert weights[0, 2].view(torch.int32).item() == want.view(torch.int32).item()
    assert still_flushes or not had


def test_dequantize_keeps_subnormal_scale_on_torchs_worker_threads():
    """torch's worker threads started after torch.set_flush_denormal(True) flush too;
    dequantize decodes by lookup (bits copied, nothing computed), so a large decode
    split across them keeps 2^-127 as well (in a subprocess: a fresh pool)."""
    code = textwrap.dedent("""
        import torch, mxfp4x
        torch.set_num_threads(2)
        torch.set_flush_denormal(True)
        torch.ones(1 << 22).sum()  # the pool starts with the flush mode on
        packed = torch.full((1 << 16, 1, 16), 0x55, dtype=torch.uint8)  # code 5: 3.0
        w = mxfp4x.dequantize(packed, torch.zeros((1 << 16, 1), dtype=torch.uint8))
        want = torch.tensor([3.0 * 2.0 ** -127]).view(torch.int32).item()
        print(int((w.view(torch.int32) != want).sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", out.stdout


def _libm_rounding():
    """(fesetround, fegetround, FE_UPWARD) of the C library, or None where unknown."""
    import ctypes
    import ctypes.util
    import platform
    upward = {"x86_64": 0x800, "AMD64": 0x800, "aarch64": 0x400000, "arm64": 0x400000}
    name = ctypes.util.find_library("m") or ctypes.util.find_library("c")
    if name is None or platform.machine() not in upward:
        return None
    lib = ctypes.CDLL(name)
    return lib.fesetround, lib.fegetround, upward[platform.machine()]


def test_callers_rounding_mode_changes_no_bit(isa, rng):
    """A caller that rounds upward (fesetround) gets the bits of round-to-nearest, on one
    thread (the caller's own) and on two (a pool thread beside it): the kernels set the
    rounding mode of their threads, as they do flush-to-zero."""
    fe = _libm_rounding()
    if fe is None:
        pytest.skip("no C library rounding control known here")
    setround, getround, upward = fe
    args = random_layer(rng, 9, 3, 4, 70, 5, dtype=torch.float32)
    want = mxfp4x.mxfp4_experts(**args, backend="cpu", num_threads=1, isa=isa)
    old = getround()
    assert setround(upward) == 0
    try:
        got = [mxfp4x.mxfp4_experts(**args, backend="cpu", num_threads=n, isa=isa)
               for n in (1, 2)]
    finally:
        setround(old)
    for g in got:
        assert torch.equal(g, want)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_overflow_follows_ieee(isa, backend):
    x = torch.zeros(2, 32)
    x[0, 0] = 3e38
    x[1, 0] = -3e38
    packed = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    packed[0, 0, 0, 0] = 0x07  # element 0: code 7 = 6.0
    y = mxfp4x.mxfp4_experts(x, packed, torch.full((1, 1, 1), 127, dtype=torch.uint8),
                             [[0], [0]], [[1.0], [1.0]], [[0.0], [0.0]], backend=backend, isa=isa)
    assert y[0, 0].item() == float("inf") and y[1, 0].item() == float("-inf")


def test_sum_of_negative_zero_weights_is_positive_zero(isa):
    # code 8 decodes to -0.0 (test_decode), but dot products start from +0.0, as BLAS
    # and the float64 reference do: all -0.0 products sum to +0.0, and -0.0 + +0.0 = +0.0
    packed = torch.full((1, 1, 1, 16), 0x88, dtype=torch.uint8)
    y = mxfp4x.mxfp4_experts(torch.ones(1, 32), packed, torch.full((1, 1, 1), 127,
                                                                    dtype=torch.uint8),
                             [[0]], [[1.0]], [[-0.0]], backend="cpu", isa=isa)
    assert y.item() == 0.0 and not np.signbit(y.item())


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_no_leaks_over_10000_calls(rng):
    layer = random_layer(rng, 3, 2, 4, 40, 3)
    bad = dict(layer, selected_experts=layer["selected_experts"] + 10)

    def burst(n):
        for i in range(n):
            if i % 2:
                with pytest.raises(IndexError):
                    mxfp4x.mxfp4_experts(**bad)
            else:
                mxfp4x.mxfp4_experts(**layer, backend="cpu" if i % 4 else "torch")

    burst(1000)
    before = _rss()
    burst(10_000)
    grown = _rss() - before
    assert grown < 4 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 10,000 calls"


@pytest.mark.slow
def test_packed_weights_over_2_to_the_31_bytes():
    """E=384, O=4096, G=224 (5.6 GB): allocated, not filled; only the selected experts
    near the end are written.  64-bit offsets all the way."""
    n_experts, d_out, n_groups = 384, 4096, 224
    packed = torch.empty((n_experts, d_out, n_groups, 16), dtype=torch.uint8)
    scales = torch.empty((n_experts, d_out, n_groups), dtype=torch.uint8)
    assert packed.numel() > 2**32
    rng = np.random.default_rng(7)
    chosen = [383, 381, 200]
    for e in chosen:
        packed[e] = torch.from_numpy(rng.integers(0, 256, (d_out, n_groups, 16),
                                                  dtype=np.uint8))
        scales[e] = torch.from_numpy(rng.integers(120, 130, (d_out, n_groups),
                                                  dtype=np.uint8))
    x = torch.randn(3, 32 * n_groups)
    sel = torch.tensor([[383, 381], [381, 381], [200, 383]])
    mix = torch.rand(3, 2)
    shared = torch.randn(3, d_out)
    layer = dict(latent_tokens=x, packed_weights=packed, scale_bytes=scales,
                 selected_experts=sel, mixture_weights=mix, shared_output=shared)
    for backend in ("cpu", "torch"):
        y = mxfp4x.mxfp4_experts(**layer, backend=backend)
        for rows in (slice(0, 40), slice(d_out - 40, d_out)):
            assert_matches_reference(y[:, rows], layer, rows=rows)


def test_eight_threads_with_numpy_inputs_leave_warning_filters_alone(rng):
    """numpy inputs (read-only ones too: a read-only np.memmap of a checkpoint) from 8
    threads at once: right answers, no warning, and the process's warnings filters are
    exactly what they were (catch_warnings is not thread-safe, so mxfp4x uses none)."""
    import warnings

    layers = []
    for i in range(8):
        layer = random_layer(np.random.default_rng(100 + i), 5 + i, 2, 3, 40, 3)
        as_np = {k: v.numpy().copy() for k, v in layer.items()}
        for k in ("packed_weights", "scale_bytes", "latent_tokens"):
            as_np[k].setflags(write=False)
        layers.append((as_np, mxfp4x.mxfp4_experts(**layer, num_threads=1)))
    filters_before = list(warnings.filters)

    def work(i):
        for _ in range(10):
            got = mxfp4x.mxfp4_experts(**layers[i][0], num_threads=1)
            assert torch.equal(got, layers[i][1])

    with warnings.catch_warnings(record=True) as seen:  # this (main) thread only
        warnings.simplefilter("always")
        filters_inside = list(warnings.filters)
        errors = run_threads(8, work)
        assert list(warnings.filters) == filters_inside
    assert not errors, errors
    assert not [w for w in seen if "writable" in str(w.message)], [str(w.message) for w in seen]
    assert list(warnings.filters) == filters_before


def test_readonly_numpy_input_is_read_in_place(rng):
    layer = random_layer(rng, 3, 2, 2, 16, 2)
    packed = layer["packed_weights"].numpy().copy()
    packed.setflags(write=False)
    t = mxfp4x._core.coerce.as_tensor("packed_weights", packed)
    assert t.data_ptr() == packed.ctypes.data  # a view, not a copy
    assert not packed.flags.writeable


def test_seed_is_stable_across_pythonhashseed():
    """MXFP4X_TEST_SEED reproduces a test's data in any process: the per-test stream does
    not depend on PYTHONHASHSEED (hash() of a str does)."""
    code = ("import conftest; print(conftest.rng_for(7, 'tests/test_x.py::test_y[avx2]')"
            ".integers(0, 2**62, 4).tolist())")
    draws = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, cwd=HERE, env=env)
        assert out.returncode == 0, out.stderr
        draws.append(out.stdout.strip())
    assert draws[0] == draws[1]


_FORK = r"""
import os, sys, time, warnings, torch, mxfp4x
torch.manual_seed(3)
E, O, G, T, K = 6, 96, 4, 40, 3
args = (torch.randn(T, 32 * G), torch.randint(0, 256, (E, O, G, 16), dtype=torch.uint8),
        torch.randint(118, 134, (E, O, G), dtype=torch.uint8), torch.randint(0, E, (T, K)),
        torch.rand(T, K), torch.randn(T, O))
if sys.argv[1] == "none":  # nothing parallel ran in the parent: the child keeps its threads
    y = mxfp4x.mxfp4_experts(*args, num_threads=1)
elif sys.argv[1] == "torch":  # torch's own team (the same runtime) in the parent
    torch.set_num_threads(2)
    a = torch.randn(1024, 1024)
    (a @ a).sum()
    torch.randn(1 << 22).exp().sum()
    y = mxfp4x.mxfp4_experts(*args, num_threads=1)
else:  # one of ours
    y = mxfp4x.mxfp4_experts(*args, num_threads=2)
pid = os.fork()
if pid == 0:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        same = torch.equal(mxfp4x.mxfp4_experts(*args, num_threads=2), y)
    warned = any("forked" in str(w.message) for w in seen)
    os._exit(0 if same and warned == (sys.argv[1] != "none") else 3)
t0 = time.time()
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    if time.time() - t0 > 60:
        os.kill(pid, 9)
        sys.exit("the child's call hung")
    time.sleep(0.05)
"""


@pytest.mark.skipif(not hasattr(os, "fork") or mxfp4x._core.threads.backend() != "openmp",
                    reason="os.fork and an OpenMP build")
@pytest.mark.parametrize("team", ["mxfp4x", "torch", "none"])
def test_a_call_in_a_process_forked_after_threads_ran_does_not_hang(team):
    """GNU OpenMP cannot start a team again in a child forked after one ran, ours or
    torch's (the child's first parallel step waited forever): such a child runs its calls
    on one thread, with the same bits, and says so once; a child of a parent where nothing
    parallel ran keeps its threads (and says nothing)."""
    proc = subprocess.run([sys.executable, "-c", _FORK, team], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
