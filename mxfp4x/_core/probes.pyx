# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""Probes of the CPU driver, kept out of its module (mxfp4x/_core/cpu.pyx): the roofline's
loops (``fma_peak``, ``read_peak``) and the test hooks (``threads_used``,
``step_threads``, ``decode_rows``, ``isa_decision``, ``default_decision``).

Everything parallel here runs through the driver's own mechanism
(``mxfp4x._core.cpu.parallel_tasks``: prange under OpenMP, threads.h's workers otherwise), and
every kernel is the driver's table entry (``kernels_of``), so a probe measures the code a
call runs.  Numpy only, no torch: the QEMU portability tests load this module alone.
"""
import time

import numpy as np

from libc.stdint cimport int64_t, uint8_t, uint64_t, uintptr_t
from libc.stdlib cimport free

cimport mxfp4x._core.capi as c
cimport mxfp4x._core.cpu as driver

from mxfp4x._core.cpu import MAX_THREADS, Call, Experts, combine


# ---- roofline ---------------------------------------------------------------------------

cdef struct FmaJob:
    c.mxfp4x_fma_loop_fn loop
    int64_t iters
    int64_t *flops      # per task


cdef void _fma_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef FmaJob *j = <FmaJob *>ctx
    j.loop(j.iters, <float>(1 + task), &j.flops[task])


def fma_peak(isa=None, int n_threads=1, double seconds=0.2):
    """The ISA's float32 multiply-add peak in FLOP/s with ``n_threads`` threads, from a
    register-resident loop compiled for that ISA (the roofline's compute floor): one task
    per thread, each its own loop of about ``seconds``, all of their FLOPs over the time
    from the first start to the last end."""
    return _loop_peak(driver.kernels_of(isa).fma_loop, n_threads, seconds)


def bf16_dot_peak(isa=None, int n_threads=1, double seconds=0.2):
    """As ``fma_peak``, for the ISA's bf16 dot-product unit (bf16 products, float32 sums:
    the compute floor of bf16 latents there); None where the ISA measures none."""
    cdef c.mxfp4x_fma_loop_fn loop = driver.kernels_of(isa).bf16_dot_loop
    driver.checked_threads(n_threads)
    return None if loop == NULL else _loop_peak(loop, n_threads, seconds)


cdef double _loop_peak(c.mxfp4x_fma_loop_fn loop, int n_threads, double seconds) except -1:
    cdef FmaJob job
    cdef int nt = driver.checked_threads(n_threads)
    cdef int64_t calib = 1 << 16, flops = 0, i
    job.loop = loop
    job.flops = <int64_t *>driver.xmalloc(nt * 8, True)
    try:
        # calibrate one thread's rounds to about `seconds`
        t0 = time.perf_counter()
        with nogil:
            job.loop(calib, 1.0, &flops)
        dt = max(time.perf_counter() - t0, 1e-6)
        job.iters = max(calib, <int64_t>(calib * seconds / dt))
        t0 = time.perf_counter()
        with nogil:
            driver.parallel_tasks(nt, nt, _fma_task, &job)
        dt = time.perf_counter() - t0
        return sum(job.flops[i] for i in range(nt)) / dt
    finally:
        free(job.flops)


cdef struct ReadJob:
    const uint64_t *p
    int64_t n_words, share
    uint64_t *sums


cdef void _read_task(void *ctx, int64_t t, int tid) noexcept nogil:
    cdef ReadJob *j = <ReadJob *>ctx
    j.sums[t] = c.mxfp4x_read_words(j.p + t * j.share,
                                    max(0, min(j.share, j.n_words - t * j.share)))


def read_peak(buf, int n_threads=1, int repeats=3):
    """Bytes per second reading ``buf`` (a C-contiguous numpy array, larger than the
    last-level cache) once with ``n_threads`` threads of the driver's kind, in 64 chunks
    per thread summed as 64-bit words: the roofline's memory read bandwidth (the best
    of ``repeats``)."""
    cdef ReadJob job
    cdef int nt = driver.checked_threads(n_threads)
    cdef int64_t n_chunks = 64 * nt
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ValueError("buf: expected a C-contiguous numpy array")
    job.p = <const uint64_t *><uintptr_t>buf.ctypes.data
    job.n_words = buf.nbytes // 8
    job.share = (job.n_words + n_chunks - 1) // n_chunks
    job.sums = <uint64_t *>driver.xmalloc(n_chunks * 8, True)
    best = float("inf")
    try:
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            with nogil:
                driver.parallel_tasks(nt, n_chunks, _read_task, &job)
            best = min(best, time.perf_counter() - t0)
        return job.n_words * 8 / best
    finally:
        free(job.sums)


# ---- test hooks: the threads ----------------------------------------------------------

cdef void _spin_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef uint64_t *seen = <uint64_t *>ctx
    cdef uint64_t spin = 0
    cdef int64_t _i
    seen[task] = c.mxfp4x_thread_token()
    for _i in range(200000):  # about 0.1 ms: long enough for every thread to take some
        spin = spin * 1103515245 + 12345
    if spin == 0:
        seen[task] = 0


def threads_used(int n_threads, int64_t n_tasks=1024):
    """How many OS threads ran ``n_tasks`` small tasks given ``n_threads``, through the
    driver's own mechanism (prange, or the pthreads workers)."""
    cdef int nt = driver.checked_threads(n_threads)
    cdef uint64_t *seen = <uint64_t *>driver.xmalloc(n_tasks * 8, True)
    cdef int64_t t
    try:
        with nogil:
            driver.parallel_tasks(nt, n_tasks, _spin_task, seen)
        return len({seen[t] for t in range(n_tasks)})
    finally:
        free(seen)


def _distinct(log):
    return len({int(v) for v in log if v})


def step_threads(int n_threads, isa=None):
    """How many OS threads ran each parallel step of the driver given ``n_threads``:
    "prepare" (bfloat16 latents into the kernel layout) and "tasks" of a forward call,
    "finish" (dx out of the layout) of a transposed one, and :func:`combine`, on sizes
    that give every step many tasks (64 of prepare and finish, 128 of combine)."""
    rng = np.random.default_rng(0)
    n_tokens, n_experts, d_out, n_groups = 2048, 2, 96, 64
    d_in = 32 * n_groups
    pk = rng.integers(0, 256, (n_experts, d_out, n_groups, 16), dtype=np.uint8)
    sc = rng.integers(120, 132, (n_experts, d_out, n_groups), dtype=np.uint8)
    table = np.array([[pk[e].ctypes.data, sc[e].ctypes.data, pk.strides[1], sc.strides[1]]
                      for e in range(n_experts)], dtype=np.int64)
    experts = Experts(table, d_out=d_out, n_groups=n_groups, owner=(pk, sc))
    sel = rng.integers(0, n_experts, (n_tokens, 1)).astype(np.int64)
    mix = np.ones((n_tokens, 1), np.float32)
    x = rng.integers(0x3f00, 0x4000, (n_tokens, d_in)).astype(np.int16)  # bfloat16 bits
    forward = np.zeros((driver.N_STEPS, MAX_THREADS), np.uint64)
    Call(experts, product="forward", compute="float32", selected=sel, mix=mix, src=x,
         src_dtype="bfloat16", src_rows="token", dst=np.zeros((n_tokens, d_out), np.float32),
         dst_rows="token", isa=isa, n_threads=n_threads).run(thread_log=forward)
    transposed = np.zeros((driver.N_STEPS, MAX_THREADS), np.uint64)
    Call(experts, product="transposed", compute="float32", selected=sel, mix=mix,
         src=rng.standard_normal((n_tokens, d_out)).astype(np.float32), src_dtype="float32",
         src_rows="token", dst=np.empty((n_tokens, d_in), np.float32), dst_rows="token",
         isa=isa, n_threads=n_threads).run(thread_log=transposed)
    top_k, width = 2, 2048
    combined = np.zeros(MAX_THREADS, np.uint64)
    combine(np.zeros((n_tokens, width), np.float32),
            rng.standard_normal((n_tokens * top_k, width)).astype(np.float32),
            rng.integers(0, 8, (n_tokens, top_k)).astype(np.int64),
            np.ones((n_tokens, top_k), np.float32), n_threads=n_threads,
            thread_log=combined)
    return {"prepare": _distinct(forward[driver.STEP_PREPARE]),
            "tasks": _distinct(forward[driver.STEP_TASKS]),
            "finish": _distinct(transposed[driver.STEP_FINISH]),
            "combine": _distinct(combined)}


def built_with():
    """This module's threads backend and compile flags: the same as cpu's (setup.py
    builds both extensions alike), which a test checks."""
    return {"threads": c.mxfp4x_threads_name().decode(),
            "cflags": (<bytes>c.MXFP4X_BUILD_CFLAGS).decode()}


# ---- test hooks: decode and the CPU decision ---------------------------------------------

def decode_rows(packed, scales, *, isa=None, str compute="float32"):
    """(n_rows, n_groups, 16) uint8 bytes and (n_rows, n_groups) scale bytes -> the
    (n_rows, 32 n_groups) weights, decoded by the ISA's own decode kernel (its float64
    path's for compute="float64"), in natural element order.  ``scales`` None: ``packed``
    is (n_rows, n_groups, 17) GGUF block_mxfp4 blocks (the scale byte first)."""
    cdef const c.mxfp4x_kernels *k = driver.kernels_of(isa)
    cdef c.mxfp4x_rows rows
    cdef int64_t n_rows, n_groups, r, d_in
    cdef bint f64 = compute == "float64"
    cdef int half = c.MXFP4X_LAYOUT_16 if f64 else k.layout_half
    cdef uintptr_t p, o
    if compute not in ("float32", "float64"):
        raise ValueError(f"compute: expected 'float32' or 'float64', got {compute!r}")
    cdef bint gguf = scales is None
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    scales = packed[..., 0] if gguf else np.ascontiguousarray(scales, dtype=np.uint8)
    if packed.ndim != 3 or packed.shape[2] != (c.MXFP4X_GGUF_BLOCK_BYTES if gguf else
                                               c.MXFP4X_GROUP_BYTES) or \
            scales.shape != packed.shape[:2]:
        raise ValueError(f"decode_rows: expected (R, G, 16) and (R, G), or (R, G, 17) and "
                         f"None, got {packed.shape}, {getattr(scales, 'shape', None)}")
    n_rows, n_groups = packed.shape[0], packed.shape[1]
    d_in = n_groups * c.MXFP4X_GROUP
    panel = np.empty((n_rows, d_in), np.float64 if f64 else np.float32)
    out = np.empty_like(panel)
    if gguf:
        rows = c.mxfp4x_rows_gguf(<const uint8_t *><uintptr_t>packed.ctypes.data,
                                  n_groups * c.MXFP4X_GGUF_BLOCK_BYTES, n_groups)
    else:
        rows = c.mxfp4x_rows_split(<const uint8_t *><uintptr_t>packed.ctypes.data,
                                   <const uint8_t *><uintptr_t>scales.ctypes.data,
                                   n_groups * c.MXFP4X_GROUP_BYTES, n_groups, n_groups)
    p, o = panel.ctypes.data, out.ctypes.data
    with nogil:
        if f64:
            k.decode_f64(&rows, 0, n_rows, <double *>p)
            for r in range(n_rows):
                c.mxfp4x_natural_f64(<double *>p + r * d_in, n_groups, half, rows.nibbles,
                                     <double *>o + r * d_in)
        else:
            k.decode_f32(&rows, 0, n_rows, <float *>p)
            for r in range(n_rows):
                c.mxfp4x_natural_f32(<float *>p + r * d_in, n_groups, half, rows.nibbles,
                                     <float *>o + r * d_in)
    return out


def isa_decision(*, bint osxsave, bint avx, bint fma, bint avx2, bint avx512f,
                 unsigned long long xcr0, int darwin_avx512=-1, bint avx512bw=False,
                 bint amx_tile=False, bint amx_bf16=False, bint amx_granted=False,
                 bint avx512_bf16=False):
    """The ISAs cpu.h would allow for these CPUID / XCR0 / macOS sysctl facts, named as
    mxfp4x.h names them (every ISA, compiled here or not), sorted."""
    cdef c.mxfp4x_cpu_facts f
    f.osxsave, f.avx, f.fma, f.avx2, f.avx512f = osxsave, avx, fma, avx2, avx512f
    f.xcr0 = xcr0
    f.darwin_avx512 = darwin_avx512
    f.avx512bw, f.amx_tile, f.amx_bf16, f.amx_granted = avx512bw, amx_tile, amx_bf16, \
        amx_granted
    f.avx512_bf16 = avx512_bf16
    mask = c.mxfp4x_isa_decision(&f)
    return sorted(c.mxfp4x_isa_name(b).decode() for b in range(c.MXFP4X_ISA_COUNT)
                  if (mask >> b) & 1)


def default_decision(isas, *, bint vendor_amd):
    """The ISA this build's table would run by default (cpu.h's rule, dispatch.h's order)
    on a CPU that can run ``isas`` (names, as isa_decision gives them), made by AMD or
    not; None when this build compiles none of them."""
    names = {c.mxfp4x_isa_name(b).decode(): b for b in range(c.MXFP4X_ISA_COUNT)}
    cdef int mask = 0
    for name in isas:
        mask |= 1 << names[name]
    i = c.mxfp4x_kernel_default_in(c.mxfp4x_isa_default_mask(vendor_amd, mask))
    return None if i < 0 else c.mxfp4x_kernel_at(i).name.decode()
