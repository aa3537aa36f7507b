# mxfp4x/_core/cpu_plan.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# The driver's plan of a call: the pairs grouped by expert, the tasks and their tiles, and
# the combine of per-slot products (combine).

# ---- the driver ---------------------------------------------------------------------------

cdef struct ByExpert:
    int64_t *offsets    # pairs of expert e: [offsets[e], offsets[e + 1]) of the sorted pairs
    int64_t *active     # experts with pairs, ascending
    int64_t n_active
    int64_t max_count   # most pairs of one expert
    int64_t *pair_src   # per sorted pair: its row of src
    int64_t *pair_dst   # per sorted pair: its row of dst
    void *pair_w        # per sorted pair: its weight (1 without mix), compute dtype


# What every task of one call reads; per-thread scratch is carved from `scratch`.
cdef struct Work:
    const c.mxfp4x_call *call
    ByExpert r
    const void *x       # forward: latents prepared in the kernel layout; transposed: src
    void *out           # forward: call.dst; transposed: dx in the kernel layout
    int64_t n_tasks
    int64_t threads     # threads taking the tasks (1 when they run in the caller)
    int64_t task_size   # forward: rows of W per task; transposed: groups per task
    int64_t head_rows   # forward: rows [0, head_rows) in tasks of task_size, the rest
    int64_t n_head      # (the tail) in n_tasks - n_head tasks of base_size
    int64_t base_size
    int64_t panel_rows
    int64_t panel_len, dots_len   # elements of the compute dtype per thread
    int64_t lanes_len             # floats of panel_dot scratch per thread
    int64_t sums_len              # forward, 16-bit dst: floats of one task's sums per thread
    int64_t n_dst_rows            # rows of dst
    int64_t per_thread            # bytes per thread, whole cache lines
    char *scratch                 # 64-byte aligned, inside scratch_raw
    void *scratch_raw
    uint64_t *log                 # NULL, or the test hook's row of this step
    int gemv_switch               # forward float32: gemv up to this many tokens per expert
    bint bf16                     # forward, bf16 latents on the ISA's bf16 unit (amx.h):
    const uint16_t *xt            # (bf16) every sorted pair's latents, d_in each
    const uint8_t *unsafe         # (bf16) per sorted pair: its token takes the exact path


# A step of whole rows: the latents into the kernel layout (prepare), dx out of it
# (finish); each task owns rows [task * rows_per_task, ...) of dst.
cdef struct RowJob:
    const c.mxfp4x_call *call
    const char *src
    char *dst
    int64_t n_rows, rows_per_task
    int half, nibbles
    uint64_t *log


# The bf16 unit's gather (amx.h): each task gathers the latents of one active expert's
# pairs into that expert's blocks of the call's buffer.
cdef struct GatherJob:
    const c.mxfp4x_call *call
    const ByExpert *r
    uint16_t *xt
    uint8_t *unsafe
    int nibbles
    uint64_t *log


cdef void _gather_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const GatherJob *j = <const GatherJob *>ctx
    cdef int64_t e = j.r.active[task]
    cdef int64_t s = j.r.offsets[e], n = j.r.offsets[e + 1] - s
    cdef int64_t n_groups = j.call.experts.n_groups
    _log_thread(j.log, tid)
    j.call.kernels.bf16_gather(<const uint16_t *>j.call.src, n_groups * c.MXFP4X_GROUP,
                               j.r.pair_src + s, n, n_groups, j.nibbles,
                               j.xt + s * n_groups * c.MXFP4X_GROUP, j.unsafe + s)


cdef inline void *align64(void *p) noexcept nogil:
    """The first 64-byte boundary at or after p (allocate 63 bytes more).  Scratch that
    the kernels load whole 64-byte vectors from starts on a cache line: glibc's large
    blocks start 16 bytes past a page, and then every such load spans two lines
    (docs/performance.md, "Tiles, tasks and panels")."""
    return <void *>((<uintptr_t>p + 63) & ~(<uintptr_t>63))


cdef void *xmalloc(int64_t n_bytes, bint zero=False) except NULL:
    cdef void *p = calloc(<size_t>max(n_bytes, 64), 1) if zero else \
        malloc(<size_t>max(n_bytes, 64))
    if p == NULL:
        raise MemoryError(f"mxfp4x: cannot allocate {n_bytes} bytes of scratch memory")
    return p


cdef int64_t _group_by_expert(real dummy, const c.mxfp4x_call *call, ByExpert *r,
                              int64_t *fill) noexcept nogil:
    """Stable counting sort of the pairs p = t * top_k + k by expert.  Returns -1, or
    the pair index of the first expert id outside [0, n_experts)."""
    cdef int64_t p, e, n_experts = call.experts.n_experts, top_k = call.top_k
    cdef int64_t n_pairs = call.n_tokens * top_k
    cdef const real *mix = <const real *>call.mix
    cdef real *w = <real *>r.pair_w
    cdef bint src_slot = call.src_rows == c.MXFP4X_ROWS_PER_SLOT
    cdef bint dst_slot = call.dst_rows == c.MXFP4X_ROWS_PER_SLOT
    for e in range(n_experts + 1):
        r.offsets[e] = 0
    for p in range(n_pairs):
        e = call.selected[p]
        if e < 0 or e >= n_experts:
            return p
        r.offsets[e + 1] += 1
    r.n_active = 0
    r.max_count = 0
    for e in range(n_experts):
        if r.offsets[e + 1] > 0:
            r.active[r.n_active] = e
            r.n_active += 1
            r.max_count = max(r.max_count, r.offsets[e + 1])
        r.offsets[e + 1] += r.offsets[e]
        fill[e] = r.offsets[e]
    for p in range(n_pairs):
        e = call.selected[p]
        r.pair_src[fill[e]] = p if src_slot else p // top_k
        r.pair_dst[fill[e]] = p if dst_slot else p // top_k
        w[fill[e]] = 1 if mix == NULL else mix[p]
        fill[e] += 1
    return -1


cdef inline int64_t _wide_tile(int64_t tile, int64_t wide, int64_t d_out,
                               int64_t n_threads) noexcept nogil:
    """A forward task's rows when its call widens them (WIDE_TILES above): up to `wide`
    tiles, while every thread keeps TASKS_PER_THREAD tasks."""
    return tile * max(1, min(wide, d_out // max(
        1, tile * <int64_t>TASKS_PER_THREAD * max(1, n_threads))))


def forward_sums_columns(int64_t d_out, int n_threads, isa=None, bint bf16=False):
    """The most float32 sums per result row that a forward call with a 16-bit result keeps
    over all its threads (_plan: each running thread one task's columns for every row, of
    its widest task; no more threads run than there are tasks).  ``bf16``: bfloat16
    latents (on a bf16 unit where ``isa`` has one).  The facade sizes a long call's chunks
    by it."""
    cdef const c.mxfp4x_kernels *k = kernels_of(isa)
    cdef int64_t wide = WIDE_TILES_BF16 if bf16 and k.bf16_rows != NULL else WIDE_TILES
    cdef int64_t tile = _wide_tile(k.tile_rows, wide, d_out, n_threads)
    cdef int64_t most_tasks = max(1, (d_out + k.tile_rows - 1) // k.tile_rows)
    return min(<int64_t>max(1, n_threads), most_tasks) * tile


cdef void _plan(real dummy, Work *w) noexcept nogil:
    """Task split and per-thread scratch of the call's product."""
    cdef const c.mxfp4x_call *call = w.call
    cdef int64_t d_in = call.experts.n_groups * c.MXFP4X_GROUP, block, n_chunks, rows
    cdef int64_t tile, panel_bytes, tail
    cdef const c.mxfp4x_kernels *k = call.kernels
    w.lanes_len = 0
    w.dots_len = 0
    w.sums_len = 0
    if call.product == c.MXFP4X_FORWARD:
        tile = c.MXFP4X_SCALAR_TILE_ROWS if real is double else k.tile_rows
        w.base_size = tile
        w.gemv_switch = c.mxfp4x_gemv_switch(k)
        # wide tiles at any token count (a tile's width changes no bit)
        if real is float:
            tile = _wide_tile(tile, WIDE_TILES_BF16 if w.bf16 else WIDE_TILES,
                              call.experts.d_out, call.n_threads)
        panel_bytes = c.MXFP4X_SCALAR_PANEL_BYTES if real is double else k.panel_bytes
        w.task_size = tile
        # wide tiles first, then TAIL_TASKS per thread of the ISA's own tiles (above); the
        # tasks' rows start at multiples of the ISA's tile, so the split changes no bit
        tail = 0
        if tile > w.base_size and call.n_threads > 1:
            tail = min(call.experts.d_out, TAIL_TASKS * call.n_threads * w.base_size)
        w.head_rows = (call.experts.d_out - tail) // w.base_size * w.base_size
        w.n_head = (w.head_rows + tile - 1) // tile
        w.n_tasks = w.n_head + (call.experts.d_out - w.head_rows + w.base_size - 1) // \
            w.base_size
        # a tile's rows in equal panels of at most panel_bytes, whole register blocks
        block = 1 if real is double else k.panel_row_block
        rows = max(1, (panel_bytes // <int64_t>sizeof(real)) // max(d_in, 1))
        n_chunks = (tile + rows - 1) // rows
        rows = (tile + n_chunks - 1) // n_chunks
        w.panel_rows = min(tile, (rows + block - 1) // block * block)
        w.panel_len = w.panel_rows * d_in
        # the dot products of one block of an expert's pairs: against a panel, or (gemv)
        # a whole tile
        w.dots_len = min(w.r.max_count, <int64_t>PAIR_BLOCK) * max(w.panel_rows, tile)
        if real is float:
            w.lanes_len = k.panel_scratch_floats(w.panel_rows)
            if w.bf16:  # no float32 panel; the bf16 unit's own scratch
                w.panel_len = 0
                w.lanes_len = (k.bf16_scratch_bytes(call.experts.n_groups) + 3) // 4
            if call.dst_dtype != call.compute:  # the task's float32 sums, then rounded
                w.sums_len = (w.n_dst_rows * tile + 15) // 16 * 16
    else:
        w.task_size = T_TILE_GROUPS
        w.n_tasks = (call.experts.n_groups + T_TILE_GROUPS - 1) // T_TILE_GROUPS
        w.panel_rows = T_PANEL_ROWS
        w.panel_len = T_PANEL_ROWS * T_TILE_GROUPS * c.MXFP4X_GROUP
    w.per_thread = ((w.panel_len + w.dots_len) * <int64_t>sizeof(real) +
                    (w.lanes_len + w.sums_len) * 4 + 63) // 64 * 64


cdef inline void _accumulate(real *y, real w, const real *d, int64_t width) noexcept nogil:
    """y += w * d: one rounding for the product, one for the sum.  The one combine
    arithmetic of mxfp4x: the driver and :func:`combine` (expert parallelism) both use it,
    so a result combined from remote products has the driver's bits."""
    cdef int64_t r
    for r in range(width):
        y[r] = y[r] + w * d[r]


cdef void _combine(real *out, int64_t d_out, int64_t col, const int64_t *rows,
                   const real *ws, int64_t n, const real *dots, int64_t width,
                   bint assign) noexcept nogil:
    """out[row, col:col+width] += w * dots[i] (or, for per-slot outputs,
    out[row, col:col+width] = dots[i])."""
    cdef int64_t i, r
    cdef real *y
    cdef const real *d
    for i in range(n):
        y = out + rows[i] * d_out + col
        d = dots + i * width
        if assign:
            for r in range(width):
                y[r] = d[r]
        else:
            _accumulate(y, ws[i], d, width)


# combine(): each task owns the out rows of tokens [task * tokens_per_task, ...)
cdef struct CombineJob:
    char *out
    const char *dots
    const char *mix
    const int64_t *order
    int64_t n_tokens, top_k, d_out, tokens_per_task
    bint f64
    uint64_t *log


cdef void _combine_task(void *ctx, int64_t task, int tid) noexcept nogil:
    """Each token of the task: its slots in the driver's order, with its arithmetic."""
    cdef const CombineJob *j = <const CombineJob *>ctx
    cdef int64_t t, k, p
    cdef int64_t t0 = task * j.tokens_per_task
    cdef int64_t t1 = min(j.n_tokens, t0 + j.tokens_per_task)
    _log_thread(j.log, tid)
    for t in range(t0, t1):
        for k in range(j.top_k):
            p = t * j.top_k + j.order[t * j.top_k + k]
            if j.f64:
                _accumulate((<double *>j.out) + t * j.d_out, (<const double *>j.mix)[p],
                            (<const double *>j.dots) + p * j.d_out, j.d_out)
            else:
                _accumulate((<float *>j.out) + t * j.d_out, (<const float *>j.mix)[p],
                            (<const float *>j.dots) + p * j.d_out, j.d_out)


def combine(out, dots, selected, mix, *, int n_threads=1, thread_log=None):
    """out[t] += sum_k mix[t, k] * dots[t * K + k], the slots of each token taken in the
    CPU driver's order (ascending expert id, then slot) with its arithmetic: given the
    same products (W x per slot, e.g. computed on other processes), the result has the
    bits of the driver's own combine.  out (T, O), dots (T*K, O) and mix (T, K): float32
    or float64 numpy arrays of one dtype; selected (T, K) int64; all C-contiguous.
    ``thread_log``: a test hook, as a row of Call.run's (MAX_THREADS,) uint64."""
    cdef CombineJob job
    cdef int64_t n_tokens, top_k, d_out
    if not isinstance(selected, np.ndarray) or selected.ndim != 2:
        raise ValueError("selected: expected a 2-D int64 numpy array (n_tokens, top_k)")
    n_tokens, top_k = selected.shape
    d_out = out.shape[1] if isinstance(out, np.ndarray) and out.ndim == 2 else -1
    order = np.argsort(selected, axis=1, kind="stable").astype(np.int64)
    itemsize = out.itemsize if isinstance(out, np.ndarray) else 0
    if itemsize not in (4, 8) or out.dtype.kind != "f":
        raise ValueError(f"out: expected a float32 or float64 array, got {out!r:.60}")
    what = "float64" if itemsize == 8 else "float32"
    cdef uintptr_t o = _address(out, "out", (n_tokens, d_out), itemsize, what)
    cdef uintptr_t d = _address(dots, "dots", (n_tokens * top_k, d_out), itemsize, what)
    cdef uintptr_t m = _address(mix, "mix", (n_tokens, top_k), itemsize, what)
    cdef uintptr_t r = _address(order, "order", (n_tokens, top_k), 8, "int64")
    if not out.flags.writeable or out.dtype != dots.dtype or out.dtype != mix.dtype:
        raise ValueError("out, dots, mix: expected one float dtype and a writable out")
    cdef int nt = checked_threads(n_threads)
    job.log = _thread_log(thread_log, (c.MXFP4X_MAX_THREADS,))
    job.out, job.dots, job.mix = <char *>o, <const char *>d, <const char *>m
    job.order = <const int64_t *>r
    job.n_tokens, job.top_k, job.d_out, job.f64 = n_tokens, top_k, d_out, itemsize == 8
    job.tokens_per_task = max(1, <int64_t>ROW_TASK_ELEMS // max(1, top_k * d_out))
    with nogil:
        parallel_tasks(nt, (n_tokens + job.tokens_per_task - 1) // job.tokens_per_task,
                       _combine_task, &job)
