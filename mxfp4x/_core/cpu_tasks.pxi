# mxfp4x/_core/cpu_tasks.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# The driver's tasks: the forward and transposed products, the layout steps around them, and
# _drive, which runs a call's steps through parallel_tasks.

cdef inline int64_t _task_row_start(const Work *w, int64_t task) noexcept nogil:
    """The first output row of a forward task: wide tiles first, then the tail's."""
    return task * w.task_size if task < w.n_head else \
        w.head_rows + (task - w.n_head) * w.base_size


cdef void _forward_task(real dummy, const Work *w, int64_t task, char *mine) noexcept nogil:
    """Output rows [row_start, row_end) for every pair: each active expert's rows are
    decoded once (in registers for a few tokens on float32, into panels otherwise)."""
    cdef const c.mxfp4x_call *call = w.call
    cdef const c.mxfp4x_kernels *k = call.kernels
    cdef int64_t d_out = call.experts.d_out, n_groups = call.experts.n_groups
    cdef int64_t d_in = n_groups * c.MXFP4X_GROUP
    cdef int64_t row_start = _task_row_start(w, task)
    cdef int64_t row_end = min(w.head_rows if task < w.n_head else d_out,
                               row_start + (w.task_size if task < w.n_head else w.base_size))
    # the task this thread most likely takes next (tasks go out one at a time, in order)
    cdef int64_t next_task = task + w.threads
    cdef int64_t a, e, nxt, next_row, s, n, c0, c1
    cdef bint assign = call.mix == NULL
    cdef c.mxfp4x_rows rows
    cdef const c.mxfp4x_rows *after
    cdef const int64_t *srcs
    cdef const int64_t *dsts
    cdef real *panel = <real *>mine
    cdef real *dots = panel + w.panel_len
    cdef float *lanes = <float *>(dots + w.dots_len)
    cdef const real *ws
    cdef int64_t b_end
    # where the sums of the task's columns grow: dst itself (row stride d_out), or for a
    # 16-bit dst the task's own float32 rows (stride width), rounded into dst at the end
    cdef int64_t width = row_end - row_start
    cdef real *sums = <real *>w.out
    cdef int64_t stride = d_out, col0 = 0
    # ... which start from init (or dst) just before the first sum: the lines of the task's
    # slices of init and dst, hinted here, arrive during its first dot products (a cold
    # read of them per task shows in a one-token call: docs/performance.md, "Prefetch")
    cdef bint started = assign or call.init == NULL
    if w.sums_len:
        sums = <real *>(lanes + w.lanes_len)
        stride, col0 = width, row_start
    if not started and call.n_tokens * width * 4 <= PREFETCH_SLICE_BYTES:
        c.mxfp4x_prefetch_slices(call.init, d_out * _item_bytes(call.init_dtype),
                                 call.n_tokens, row_start * _item_bytes(call.init_dtype),
                                 width * _item_bytes(call.init_dtype))
        c.mxfp4x_prefetch_slices(call.dst, d_out * _item_bytes(call.dst_dtype),
                                 call.n_tokens, row_start * _item_bytes(call.dst_dtype),
                                 width * _item_bytes(call.dst_dtype))
    for a in range(w.r.n_active):
        e = w.r.active[a]
        rows = call.experts.rows[e]
        # where this task reads next, the next expert's rows of the tile: a prefetch hint
        # for the gemv kernels (mxfp4x.h)
        rows.next_blocks = rows.next_scales = NULL
        # ... and how far ahead the one-token gemv fetches: two row blocks, unless the next
        # expert has several tokens (its blocks' latents then need L1; avx512.h)
        nxt = w.r.active[a + 1] if a + 1 < w.r.n_active else w.r.active[0]
        rows.pf_far = w.r.offsets[nxt + 1] - w.r.offsets[nxt] == 1
        if a + 1 < w.r.n_active:
            after = &call.experts.rows[w.r.active[a + 1]]
            rows.next_blocks = after.blocks + row_start * after.row_stride_blocks
            rows.next_scales = after.scales + row_start * after.row_stride_scales
        elif next_task < w.n_tasks:
            # the last expert: the first expert's rows of that next task.  Without it
            # each task would begin on rows nobody had fetched (docs/performance.md,
            # "Prefetch")
            after = &call.experts.rows[w.r.active[0]]
            next_row = _task_row_start(w, next_task)
            rows.next_blocks = after.blocks + next_row * after.row_stride_blocks
            rows.next_scales = after.scales + next_row * after.row_stride_scales
        b_end = w.r.offsets[e + 1]
        s = w.r.offsets[e]
        while s < b_end:  # the expert's pairs in blocks, in order
            n = min(<int64_t>PAIR_BLOCK, b_end - s)
            srcs = w.r.pair_src + s
            dsts = w.r.pair_dst + s
            ws = (<const real *>w.r.pair_w) + s
            s += n
            if real is float:
                if w.bf16:  # every token, at any batch size: the same path
                    k.bf16_rows(&rows, row_start, row_end, w.xt + (s - n) * d_in,
                                w.unsafe + (s - n), n, dots, width, lanes)
                    started = started or _start_sums(dummy, w, row_start, width, sums +
                                                     (row_start - col0), stride)
                    _combine(sums, stride, row_start - col0, dsts, ws, n, dots, width,
                             assign)
                    continue
                if n <= w.gemv_switch:
                    # one or a few tokens: fused decode + dot in registers, no panel
                    k.gemv_f32(&rows, row_start, row_end, <const float *>w.x, d_in, srcs, n,
                               dots, width)
                    started = started or _start_sums(dummy, w, row_start, width, sums +
                                                     (row_start - col0), stride)
                    _combine(sums, stride, row_start - col0, dsts, ws, n, dots, width,
                             assign)
                    continue
            c0 = row_start
            while c0 < row_end:
                c1 = min(row_end, c0 + w.panel_rows)
                if real is float:
                    k.decode_f32(&rows, c0, c1, panel)
                    k.panel_dot_f32(panel, c1 - c0, n_groups, <const float *>w.x, d_in, srcs,
                                    n, dots, c1 - c0, lanes)
                else:
                    k.decode_f64(&rows, c0, c1, panel)
                    k.panel_dot_f64(panel, c1 - c0, n_groups, <const double *>w.x, d_in, srcs,
                                    n, dots, c1 - c0)
                started = started or _start_sums(dummy, w, row_start, width, sums +
                                                 (row_start - col0), stride)
                _combine(sums, stride, c0 - col0, dsts, ws, n, dots, c1 - c0, assign)
                c0 = c1
    if not started:  # no pairs: the sums are their starts
        _start_sums(dummy, w, row_start, width, sums + (row_start - col0), stride)
    if real is float:
        if w.sums_len:
            for a in range(w.n_dst_rows):
                c.mxfp4x_store_f16s(sums + a * width, width, call.dst_dtype,
                                    (<uint16_t *>w.out) + a * d_out + row_start)


cdef inline int64_t _item_bytes(int dtype) noexcept nogil:
    return 8 if dtype == c.MXFP4X_DTYPE_F64 else (4 if dtype == c.MXFP4X_DTYPE_F32 else 2)


cdef bint _start_sums(real dummy, const Work *w, int64_t col, int64_t width, real *sums,
                      int64_t stride) noexcept nogil:
    """Columns [col, col + width) of every token's sums start from init, converted exactly
    (a call without init starts from dst's own values: there already).  Returns True."""
    cdef const c.mxfp4x_call *call = w.call
    cdef int64_t t, d_out = call.experts.d_out
    cdef int64_t item = _item_bytes(call.init_dtype)
    for t in range(call.n_tokens):
        if real is float:
            c.mxfp4x_widen_f32((<const char *>call.init) + (t * d_out + col) * item,
                               call.init_dtype, width, sums + t * stride)
        else:
            c.mxfp4x_widen_f64((<const char *>call.init) + (t * d_out + col) * item,
                               call.init_dtype, width, sums + t * stride)
    return True


cdef void _transposed_task(real dummy, const Work *w, int64_t task,
                           char *mine) noexcept nogil:
    """Columns [32 g0, 32 g1) of dx (in the kernel layout): every active expert, its rows
    in panels, every pair; each element summed in the order (expert, row, pair)."""
    cdef const c.mxfp4x_call *call = w.call
    cdef int64_t n_groups = call.experts.n_groups, d_out = call.experts.d_out
    cdef int64_t d_in = n_groups * c.MXFP4X_GROUP
    cdef int64_t g0 = task * w.task_size
    cdef int64_t g1 = min(n_groups, g0 + w.task_size)
    cdef int64_t width = (g1 - g0) * c.MXFP4X_GROUP
    cdef int64_t a, e, s, n, i, r, o0, o1
    cdef real coefs[T_PANEL_ROWS]
    cdef real *panel = <real *>mine
    cdef real *dst
    cdef real wt
    cdef const real *grow
    cdef const char *gbytes
    cdef bint same_dtype = call.src_dtype == call.compute
    cdef int64_t item = _item_bytes(call.src_dtype)
    cdef c.mxfp4x_rows rows
    for a in range(w.r.n_active):
        e = w.r.active[a]
        s = w.r.offsets[e]
        n = w.r.offsets[e + 1] - s
        rows = call.experts.rows[e]
        rows.blocks = rows.blocks + g0 * rows.group_stride_blocks
        rows.scales = rows.scales + g0 * rows.group_stride_scales
        rows.n_groups = g1 - g0
        o0 = 0
        while o0 < d_out:
            o1 = min(d_out, o0 + w.panel_rows)
            if real is float:
                call.kernels.decode_f32(&rows, o0, o1, panel)
            else:
                call.kernels.decode_f64(&rows, o0, o1, panel)
            for i in range(n):
                dst = (<real *>w.out) + w.r.pair_dst[s + i] * d_in + g0 * c.MXFP4X_GROUP
                wt = (<const real *>w.r.pair_w)[s + i]
                if same_dtype:
                    grow = (<const real *>w.x) + w.r.pair_src[s + i] * d_out
                    for r in range(o1 - o0):
                        coefs[r] = wt * grow[o0 + r]
                else:  # a 16-bit (or float32 into float64) gradient, converted exactly
                    gbytes = (<const char *>w.x) + w.r.pair_src[s + i] * d_out * item
                    for r in range(o1 - o0):
                        coefs[r] = wt * c.mxfp4x_load_f32(gbytes, call.src_dtype, o0 + r)
                if real is float:
                    call.kernels.axpy_rows_f32(panel, o1 - o0, width, coefs, dst)
                else:
                    call.kernels.axpy_rows_f64(panel, o1 - o0, width, coefs, dst)
            o0 = o1


cdef inline void _run_task(real dummy, const Work *w, int64_t task, int tid) noexcept nogil:
    _log_thread(w.log, tid)
    if w.call.product == c.MXFP4X_FORWARD:
        _forward_task(dummy, w, task, w.scratch + tid * w.per_thread)
    else:
        _transposed_task(dummy, w, task, w.scratch + tid * w.per_thread)


cdef void _task_f32(void *ctx, int64_t task, int tid) noexcept nogil:
    """One task of a float32 call (parallel_tasks hands tasks out through it)."""
    cdef float f0 = 0
    _run_task(f0, <const Work *>ctx, task, tid)


cdef void _task_f64(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef double d0 = 0
    _run_task(d0, <const Work *>ctx, task, tid)


cdef void _prepare_task(void *ctx, int64_t task, int tid) noexcept nogil:
    """Forward latents: the task's rows converted to the compute dtype, in the kernel
    layout."""
    cdef const RowJob *j = <const RowJob *>ctx
    cdef const c.mxfp4x_call *call = j.call
    cdef int64_t r, n_groups = call.experts.n_groups
    cdef int64_t d_in = n_groups * c.MXFP4X_GROUP
    cdef int64_t elem = _item_bytes(call.src_dtype)
    cdef int64_t r0 = task * j.rows_per_task, r1 = min(j.n_rows, r0 + j.rows_per_task)
    _log_thread(j.log, tid)
    for r in range(r0, r1):
        if call.compute == c.MXFP4X_DTYPE_F64:
            c.mxfp4x_prepare_x_f64(<const double *>(j.src + r * d_in * elem), n_groups,
                                   j.nibbles, (<double *>j.dst) + r * d_in)
        else:
            c.mxfp4x_prepare_x_f32(j.src + r * d_in * elem, call.src_dtype, n_groups, j.half,
                                   j.nibbles, (<float *>j.dst) + r * d_in)


cdef void _finish_task(void *ctx, int64_t task, int tid) noexcept nogil:
    """Transposed result: the task's rows of dx from the kernel layout to natural order."""
    cdef const RowJob *j = <const RowJob *>ctx
    cdef int64_t r, n_groups = j.call.experts.n_groups
    cdef int64_t d_in = n_groups * c.MXFP4X_GROUP
    cdef int64_t r0 = task * j.rows_per_task, r1 = min(j.n_rows, r0 + j.rows_per_task)
    _log_thread(j.log, tid)
    for r in range(r0, r1):
        if j.call.compute == c.MXFP4X_DTYPE_F64:
            c.mxfp4x_natural_f64((<const double *>j.src) + r * d_in, n_groups, j.half,
                                 j.nibbles, (<double *>j.dst) + r * d_in)
        elif j.call.dst_dtype != j.call.compute:  # rounded once into the 16-bit dx
            c.mxfp4x_natural_f16s((<const float *>j.src) + r * d_in, n_groups, j.half,
                                  j.nibbles, j.call.dst_dtype, (<uint16_t *>j.dst) + r * d_in)
        else:
            c.mxfp4x_natural_f32((<const float *>j.src) + r * d_in, n_groups, j.half,
                                 j.nibbles, (<float *>j.dst) + r * d_in)


cdef void _row_step(const c.mxfp4x_call *call, const void *src, void *dst, int64_t n_rows,
                    int half, int n_threads, c.mxfp4x_task_fn fn,
                    uint64_t *log) noexcept nogil:
    """One step of whole rows of d_in elements (prepare or finish) through parallel_tasks,
    in the layout of the call's arrangement (every expert of a call has one: Experts)."""
    cdef RowJob j
    j.call, j.src, j.dst, j.n_rows, j.half, j.log = call, <const char *>src, <char *>dst, \
        n_rows, half, log
    j.nibbles = call.experts.rows[0].nibbles if call.experts.n_experts else \
        c.MXFP4X_NIBBLES_PAIRS
    j.rows_per_task = max(1, <int64_t>ROW_TASK_ELEMS //
                          max(1, call.experts.n_groups * c.MXFP4X_GROUP))
    parallel_tasks(n_threads, (n_rows + j.rows_per_task - 1) // j.rows_per_task, fn, &j,
                   call.n_threads)


cdef _drive(real dummy, const c.mxfp4x_call *call, uint64_t *log):
    """The one driver skeleton: route, plan, prepare, run the tasks in parallel, finish."""
    cdef Work w
    cdef int64_t n_groups = call.experts.n_groups
    cdef int64_t d_in = n_groups * c.MXFP4X_GROUP
    cdef int64_t n_pairs = call.n_tokens * call.top_k, bad = -1
    cdef int64_t n_x_rows
    cdef int64_t *fill = NULL
    cdef void *layout_buf = NULL
    cdef void *layout = NULL
    cdef bint forward = call.product == c.MXFP4X_FORWARD
    cdef int half = c.MXFP4X_LAYOUT_16 if real is double else call.kernels.layout_half
    cdef int n_threads
    cdef GatherJob gj
    w.call = call
    w.bf16 = real is float and forward and call.kernels.bf16_rows != NULL and \
        call.src_dtype == c.MXFP4X_DTYPE_BF16
    w.xt = NULL
    w.unsafe = NULL
    w.r.offsets = w.r.active = w.r.pair_src = w.r.pair_dst = NULL
    w.r.pair_w = NULL
    w.scratch = NULL
    w.scratch_raw = NULL
    w.log = NULL if log == NULL else log + STEP_TASKS * c.MXFP4X_MAX_THREADS
    try:
        w.r.offsets = <int64_t *>xmalloc((call.experts.n_experts + 1) * 8)
        w.r.active = <int64_t *>xmalloc((call.experts.n_experts + 1) * 8)
        fill = <int64_t *>xmalloc((call.experts.n_experts + 1) * 8)
        w.r.pair_src = <int64_t *>xmalloc(n_pairs * 8)
        w.r.pair_dst = <int64_t *>xmalloc(n_pairs * 8)
        w.r.pair_w = xmalloc(n_pairs * <int64_t>sizeof(real))
        with nogil:
            bad = _group_by_expert(dummy, call, &w.r, fill)
        if bad >= 0:
            from mxfp4x._core.validation import expert_id_error
            raise expert_id_error(call.selected[bad], call.experts.n_experts)
        n_x_rows = call.n_tokens * (call.top_k if (call.src_rows if forward else call.dst_rows)
                                    == c.MXFP4X_ROWS_PER_SLOT else 1)
        w.n_dst_rows = call.n_tokens * (call.top_k if call.dst_rows == c.MXFP4X_ROWS_PER_SLOT
                                        else 1)
        # (a forward product with d_in = 0 still runs: every dot is 0, the result p * 0;
        # one with no pairs (top_k = 0) too: its sums are their starts)
        if call.n_tokens == 0 or call.experts.d_out == 0 or \
                (not forward and (n_pairs == 0 or d_in == 0)):
            if not forward:  # an empty sum
                memset(call.dst, 0, n_x_rows * d_in * _item_bytes(call.dst_dtype))
            return
        _plan(dummy, &w)
        n_threads = <int>max(1, min(<int64_t>call.n_threads, w.n_tasks))  # more would idle
        w.threads = 1 if _forked_after_teams else n_threads
        # per-thread scratch for every thread of the call's team (parallel_tasks: any of
        # them may take a task; at most n_threads do, so no more of it is touched)
        w.scratch_raw = xmalloc((1 if n_threads == 1 else call.n_threads) * w.per_thread + 63)
        w.scratch = <char *>align64(w.scratch_raw)
        # forward: the latents in the kernel layout (bf16 unit: every pair's latents
        # gathered, 64 bytes of slack for the tile loads); transposed: dx in it (zeroed)
        if w.bf16:  # 64-byte aligned: full tile rows are whole cache lines
            layout_buf = xmalloc(n_pairs * d_in * 2 + n_pairs + 192)
            w.xt = <const uint16_t *>align64(layout_buf)
            w.unsafe = (<const uint8_t *>w.xt) + n_pairs * d_in * 2 + 64
        else:
            layout_buf = xmalloc(n_x_rows * d_in * <int64_t>sizeof(real) + 63, not forward)
        layout = align64(layout_buf)
        if forward:
            w.x = layout
            w.out = call.dst
        else:
            w.x = call.src
            w.out = layout
        with nogil:
            if w.bf16:
                gj.call, gj.r, gj.xt, gj.unsafe = call, &w.r, <uint16_t *>w.xt, \
                    <uint8_t *>w.unsafe
                gj.nibbles = call.experts.rows[0].nibbles
                gj.log = NULL if log == NULL else log + STEP_PREPARE * c.MXFP4X_MAX_THREADS
                parallel_tasks(<int>max(1, min(<int64_t>n_threads,
                                               n_pairs * d_in // ROW_TASK_ELEMS)),
                               w.r.n_active, _gather_task, &gj, call.n_threads)
            elif forward:
                _row_step(call, call.src, layout, n_x_rows, half, n_threads,
                          _prepare_task,
                          NULL if log == NULL else log + STEP_PREPARE * c.MXFP4X_MAX_THREADS)
            parallel_tasks(n_threads, w.n_tasks, _task_f32 if real is float else _task_f64,
                           &w, call.n_threads)
            if not forward:
                _row_step(call, layout, call.dst, n_x_rows, half, n_threads,
                          _finish_task,
                          NULL if log == NULL else log + STEP_FINISH * c.MXFP4X_MAX_THREADS)
    finally:
        free(w.r.offsets)
        free(w.r.active)
        free(fill)
        free(w.r.pair_src)
        free(w.r.pair_dst)
        free(w.r.pair_w)
        free(w.scratch_raw)
        free(layout_buf)
