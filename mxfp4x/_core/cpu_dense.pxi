# mxfp4x/_core/cpu_dense.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# dense_bf16: bf16 matrices times a few tokens through the entry's dense kernels.

# dense_bf16(): each task owns output rows [task * DENSE_TILE_ROWS, ...) of every token.
# 64 rows of a 7168-wide bf16 matrix are 896 KiB: a K3 projection (3584..7168 rows) is
# 56..112 tasks for the threads to balance.
cdef enum:
    DENSE_TILE_ROWS = 64

cdef struct DenseJob:
    const c.mxfp4x_kernels *k
    const uint16_t *w
    const void *x
    bint x_bf16
    float *out
    int64_t d_out, d_in, n_tok


cdef void _dense_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const DenseJob *j = <const DenseJob *>ctx
    cdef int64_t r0 = task * DENSE_TILE_ROWS
    cdef int64_t r1 = min(j.d_out, r0 + DENSE_TILE_ROWS)
    if j.x_bf16:
        j.k.dense_bf16x(j.w, j.d_in, r0, r1, j.d_in, <const uint16_t *>j.x, j.d_in, j.n_tok,
                        j.out + r0, j.d_out)
    else:
        j.k.dense_bf16(j.w, j.d_in, r0, r1, j.d_in, <const float *>j.x, j.d_in, j.n_tok,
                       j.out + r0, j.d_out)


def dense_bf16(x, w, out, *, isa=None, int n_threads=1):
    """out = x @ w.T for bfloat16 rows w (O, I) given as their uint16 bits and tokens x
    (T, I), float32 or bfloat16 (as their uint16 bits), into out (T, O) float32: every
    product and sum in float32, in the ISA's order, the same for every token whatever T or
    the thread count, and for bf16 tokens the same bits as for them widened to float32
    (mxfp4x.h, mxfp4x_dense_bf16_fn).  All three C-contiguous numpy arrays."""
    cdef DenseJob job
    if not isinstance(x, np.ndarray) or x.ndim != 2 or not isinstance(w, np.ndarray) \
            or w.ndim != 2:
        raise ValueError("x, w: expected 2-D numpy arrays (T, I) float32 or uint16 (bf16 "
                         "bits) and (O, I) uint16")
    if x.dtype != np.float32 and x.dtype != np.uint16:
        raise ValueError(f"x: expected float32 tokens or bfloat16 bits (uint16), got {x.dtype}")
    cdef int64_t n_tok = x.shape[0], d_in = x.shape[1], d_out = w.shape[0]
    cdef int nt = checked_threads(n_threads)
    job.k = kernels_of(isa)
    job.x_bf16 = x.dtype == np.uint16
    cdef uintptr_t xa = _address(x, "x", (n_tok, d_in), 2 if job.x_bf16 else 4,
                                 "bfloat16 bits" if job.x_bf16 else "float32")
    if job.x_bf16 and job.k.dense_bf16x == NULL:  # this ISA widens them first
        x = (x.astype(np.uint32) << 16).view(np.float32)
        job.x_bf16 = False
        xa = _address(x, "x", (n_tok, d_in), 4, "float32")
    cdef uintptr_t wa = _address(w, "w", (d_out, d_in), 2, "bfloat16 bits")
    cdef uintptr_t oa = _address(out, "out", (n_tok, d_out), 4, "float32")
    if out.dtype != np.float32 or not out.flags.writeable:
        raise ValueError("out: expected a writable float32 array")
    job.w, job.x, job.out = <const uint16_t *>wa, <const void *>xa, <float *>oa
    job.d_out, job.d_in, job.n_tok = d_out, d_in, n_tok
    if n_tok == 0 or d_out == 0:
        return
    with nogil:
        parallel_tasks(nt, (d_out + DENSE_TILE_ROWS - 1) // DENSE_TILE_ROWS, _dense_task, &job)
