# mxfp4x/_core/cpu_dense.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# dense_bf16: bf16 matrices times a few tokens through the entry's dense kernels.

# dense_bf16(): the kernels run tiles of DENSE_TILE_ROWS output rows of every token, and
# each task owns a run of consecutive tiles (_dense_job_tasks): a thread then streams its
# rows in one piece, each tile's far prefetch already fetching the next tile's first
# rows, where tasks of one tile each sent the threads' streams jumping over each other's
# tiles.  64 rows of a 7168-wide bf16 matrix are 896 KiB.
cdef enum:
    DENSE_TILE_ROWS = 64
    DENSE_TASKS_PER_THREAD = 4  # runs per thread: the balance of a call's last ones

# The bf16 unit's dense product (dense_bf16(..., unit=True)) takes calls of this many
# tokens: from one past the exact kernels' range (mxfp4x._core.dense.MAX_TOKENS) to where
# torch's bf16 product reads as fast (docs/performance.md, "The dense bf16 kernel").
cdef enum:
    DENSE_UNIT_MAX_TOKENS_C = 16  # also the most tokens of the epilogue (a task's sums)
DENSE_UNIT_MIN_TOKENS = 5
DENSE_UNIT_MAX_TOKENS = DENSE_UNIT_MAX_TOKENS_C

cdef struct DenseJob:
    const c.mxfp4x_kernels *k
    const uint16_t *w
    const void *x
    bint x_bf16
    bint unit
    float *out  # the float32 sums, or NULL: a task's own, then the epilogue into dst
    int64_t d_out, d_in, n_tok
    const void *bias  # the epilogue: out = round(sum + bias) into dst (dst_dtype)
    int bias_dtype
    void *dst
    int dst_dtype
    int64_t n_tiles, n_tasks  # set by _dense_job_tasks


cdef int64_t _dense_job_tasks(DenseJob *j, int n_threads) noexcept nogil:
    """The job's tasks on n_threads threads: its tiles in DENSE_TASKS_PER_THREAD runs a
    thread (at least one tile each) whose lengths differ by at most one tile, so that the
    threads' last runs end together (with runs of a fixed length, 45 tiles on 2 threads
    would be 9 runs of 5, the last one run alone)."""
    j.n_tiles = (j.d_out + DENSE_TILE_ROWS - 1) // DENSE_TILE_ROWS
    j.n_tasks = max(1, min(j.n_tiles, DENSE_TASKS_PER_THREAD * max(1, n_threads)))
    return j.n_tasks


cdef void _dense_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const DenseJob *j = <const DenseJob *>ctx
    cdef int64_t tile = task * j.n_tiles // j.n_tasks
    cdef int64_t end = (task + 1) * j.n_tiles // j.n_tasks
    while tile < end:
        _dense_tile(j, tile)
        tile += 1


cdef void _dense_tile(const DenseJob *j, int64_t tile) noexcept nogil:
    cdef int64_t r0 = tile * DENSE_TILE_ROWS
    cdef int64_t r1 = min(j.d_out, r0 + DENSE_TILE_ROWS)
    cdef float sums[DENSE_UNIT_MAX_TOKENS_C * DENSE_TILE_ROWS]
    cdef float b[DENSE_TILE_ROWS]
    cdef float *o = j.out + r0 if j.out != NULL else sums
    cdef int64_t os = j.d_out if j.out != NULL else r1 - r0
    cdef int64_t t, i, n = r1 - r0
    cdef size_t size = 4 if j.dst_dtype == c.MXFP4X_DTYPE_F32 else 2
    if j.unit:
        j.k.dense_bf16_unit(j.w, j.d_in, r0, r1, j.d_in, <const uint16_t *>j.x, j.d_in,
                            j.n_tok, o, os)
    elif j.x_bf16:
        j.k.dense_bf16x(j.w, j.d_in, r0, r1, j.d_in, <const uint16_t *>j.x, j.d_in, j.n_tok,
                        o, os)
    else:
        j.k.dense_bf16(j.w, j.d_in, r0, r1, j.d_in, <const float *>j.x, j.d_in, j.n_tok,
                       o, os)
    if j.out != NULL:
        return
    if j.bias != NULL:  # in float32, before the one rounding
        c.mxfp4x_act_load(j.bias, j.bias_dtype, r0, 1, n, b)
        for t in range(j.n_tok):
            for i in range(n):
                o[t * os + i] = o[t * os + i] + b[i]
    for t in range(j.n_tok):
        c.mxfp4x_act_store(o + t * os, n, j.dst_dtype,
                           <char *>j.dst + <size_t>(t * j.d_out + r0) * size)


def dense_unit(isa=None):
    """Whether the ISA's entry (None: this CPU's default) has the dense product on a
    bf16 unit (``dense_bf16(..., unit=True)``)."""
    return kernels_of(isa).dense_bf16_unit != NULL


def dense_bf16(x, w, out, *, isa=None, int n_threads=1, bint unit=False, bias=None,
               str bias_dtype="float32", str out_dtype="float32"):
    """out = x @ w.T for bfloat16 rows w (O, I) given as their uint16 bits and tokens x
    (T, I), float32 or bfloat16 (as their uint16 bits), into out (T, O) float32: every
    product and sum in float32, in the ISA's order, the same for every token whatever T or
    the thread count, and for bf16 tokens the same bits as for them widened to float32
    (mxfp4x.h, mxfp4x_dense_bf16_fn).  All three C-contiguous numpy arrays.

    ``bias`` (O,) of ``bias_dtype`` (16-bit floats as their uint16 bits) is added to the
    float32 sums and ``out_dtype`` ('float32', 'bfloat16', 'float16': out's dtype, as
    uint16 bits) takes them rounded once, in the same tasks (up to
    ``DENSE_UNIT_MAX_TOKENS`` tokens where either is asked for).

    ``unit``: bf16 tokens, ``DENSE_UNIT_MIN_TOKENS`` to ``DENSE_UNIT_MAX_TOKENS`` of them,
    on the entry's bf16 unit (:func:`dense_unit`), in its arithmetic (mxfp4x.h,
    dense_bf16_unit): the same for every token whatever T in that range or the thread
    count."""
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
    job.unit = unit
    if unit:
        if job.k.dense_bf16_unit == NULL:
            raise ValueError(f"unit: the {job.k.name.decode()} entry has no dense bf16 unit "
                             "product (dense_unit())")
        if not job.x_bf16:
            raise ValueError("unit: expected bfloat16 tokens (uint16 bits)")
        if not DENSE_UNIT_MIN_TOKENS <= x.shape[0] <= DENSE_UNIT_MAX_TOKENS:
            raise ValueError(f"x: expected {DENSE_UNIT_MIN_TOKENS} to "
                             f"{DENSE_UNIT_MAX_TOKENS} tokens on the unit, got {x.shape[0]}")
    cdef uintptr_t xa = _address(x, "x", (n_tok, d_in), 2 if job.x_bf16 else 4,
                                 "bfloat16 bits" if job.x_bf16 else "float32")
    if job.x_bf16 and job.k.dense_bf16x == NULL:  # this ISA widens them first
        x = (x.astype(np.uint32) << 16).view(np.float32)
        job.x_bf16 = False
        xa = _address(x, "x", (n_tok, d_in), 4, "float32")
    cdef uintptr_t wa = _address(w, "w", (d_out, d_in), 2, "bfloat16 bits")
    job.dst_dtype = _act_dtype(out_dtype, "out_dtype")
    cdef uintptr_t oa = _address(out, "out", (n_tok, d_out), _ITEMSIZE[out_dtype], out_dtype)
    if out.dtype != (np.float32 if job.dst_dtype == c.MXFP4X_DTYPE_F32 else np.uint16) \
            or not out.flags.writeable:
        raise ValueError(f"out: expected a writable {out_dtype} array (16-bit floats as "
                         f"their uint16 bits), got {out.dtype}")
    job.bias, job.bias_dtype, job.dst = NULL, c.MXFP4X_DTYPE_F32, NULL
    if bias is not None:
        job.bias_dtype = _act_dtype(bias_dtype, "bias_dtype")
        job.bias = <const void *>_address(bias, "bias", (d_out,), _ITEMSIZE[bias_dtype],
                                          bias_dtype)
    job.w, job.x, job.out = <const uint16_t *>wa, <const void *>xa, <float *>oa
    if bias is not None or job.dst_dtype != c.MXFP4X_DTYPE_F32:
        if n_tok > DENSE_UNIT_MAX_TOKENS_C:
            raise ValueError(f"x: a bias or a {out_dtype} out takes at most "
                             f"{DENSE_UNIT_MAX_TOKENS} tokens, got {n_tok}")
        job.out, job.dst = NULL, <void *>oa
    job.d_out, job.d_in, job.n_tok = d_out, d_in, n_tok
    if n_tok == 0 or d_out == 0:
        return
    with nogil:
        parallel_tasks(nt, _dense_job_tasks(&job, nt), _dense_task, &job)
