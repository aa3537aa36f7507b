# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""The parallel driver of the CPU backend.

One call: prepare the latents (convert to the compute dtype, deinterleave each
group once), route the token-expert pairs by expert (a stable counting sort),
then split the output rows into tiles.  ``prange`` hands whole tiles to
threads; inside a tile every selected expert's rows are decoded once and applied
to every pair routed to that expert, and each output element is accumulated by
that one thread in a fixed order (ascending expert id, then the pair order).
Results are therefore bit-identical for any thread count and for any batch the
token sits in.  No locks, no atomics.

The inputs arrive already validated and laid out by ``mxfp4x._dispatch``;
pointers are passed as integers (torch tensors' ``data_ptr()``), so bf16 needs
no numpy dtype and nothing is copied here.
"""
import os

from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int64_t, uint8_t, uintptr_t
from libc.stdlib cimport free, malloc

cimport mxfp4x._capi as c

ctypedef fused real:
    float
    double

# Rows of W per parallel task, and the bytes of decoded rows held at once in a
# thread's panel (it stays L2-resident).
cdef int64_t TILE_ROWS = 48
cdef int64_t PANEL_BYTES = 384 * 1024

cdef int _kernel = -1  # index into mxfp4x_kernel_table, chosen at import


def compiled_isas():
    """ISA names compiled into this build, in order of preference."""
    return [c.mxfp4x_kernel_at(i).name.decode() for i in range(c.mxfp4x_n_kernels())]


def runnable_isas():
    """ISA names this build can run on this CPU, in order of preference."""
    return [c.mxfp4x_kernel_at(i).name.decode() for i in range(c.mxfp4x_n_kernels())
            if c.mxfp4x_kernel_runnable(i)]


def have_openmp():
    return bool(c.mxfp4x_have_openmp())


def current_isa():
    return c.mxfp4x_kernel_at(_kernel).name.decode()


cdef int _find(str name) except -2:
    for i in range(c.mxfp4x_n_kernels()):
        if c.mxfp4x_kernel_at(i).name.decode() == name:
            return i
    return -1


def set_isa(str name):
    """Force one ISA (used by MXFP4X_ISA at import and by the tests).

    An unknown name, or one this CPU cannot run, raises: never a silent fallback.
    """
    global _kernel
    i = _find(name)
    if i < 0:
        raise ValueError(
            f"MXFP4X_ISA={name!r} is not an ISA of mxfp4x; choose one of "
            f"{runnable_isas()} (compiled: {compiled_isas()})")
    if not c.mxfp4x_kernel_runnable(i):
        raise RuntimeError(
            f"MXFP4X_ISA={name!r}: this CPU (or OS) cannot run {name}; choose one of "
            f"{runnable_isas()}")
    _kernel = i


def _select_at_import():
    global _kernel
    forced = os.environ.get("MXFP4X_ISA", "").strip().lower()
    if forced:
        set_isa(forced)
    else:
        for i in range(c.mxfp4x_n_kernels()):
            if c.mxfp4x_kernel_runnable(i):
                _kernel = i
                break


_select_at_import()


cdef const c.mxfp4x_kernels *_pick(str isa) except NULL:
    cdef int i = _kernel if isa is None else _find(isa)
    if i < 0 or not c.mxfp4x_kernel_runnable(i):
        raise ValueError(f"isa={isa!r} is not runnable here; choose one of {runnable_isas()}")
    return c.mxfp4x_kernel_at(i)


def layout_half(str isa=None):
    """The element order of the ISA's decoded groups (see mxfp4x_prepare_x_f32)."""
    return _pick(isa).layout_half


def decode_rows(uintptr_t blocks, uintptr_t scales, int64_t n_rows, int64_t n_groups,
                uintptr_t out, str isa=None):
    """Decode n_rows contiguous rows into out (float32, in the ISA's layout).

    Testing hook: it runs the chosen ISA's own decode kernel.
    """
    cdef const c.mxfp4x_kernels *k = _pick(isa)
    cdef c.mxfp4x_rows rows
    rows.blocks = <const uint8_t *>blocks
    rows.scales = <const uint8_t *>scales
    rows.row_stride_blocks = n_groups * 16
    rows.row_stride_scales = n_groups
    rows.n_groups = n_groups
    with nogil:
        k.decode_f32(&rows, 0, n_rows, <float *>out)


cdef struct Ctx:
    const c.mxfp4x_kernels *k
    const uint8_t *blocks
    const uint8_t *scales
    int64_t blocks_expert_stride, blocks_row_stride
    int64_t scales_expert_stride, scales_row_stride
    int64_t d_out, n_groups, d_in
    int64_t tile_rows, panel_rows
    const void *x           # prepared latents, one row per token (or per slot), in layout
    void *out               # (n_tokens or n_pairs, d_out); starts as the shared output
    const int64_t *active   # active expert ids, ascending
    int64_t n_active
    const int64_t *offsets  # pairs of expert e: [offsets[e], offsets[e + 1])
    const int64_t *pair_tok  # per sorted pair: its row of x
    const int64_t *pair_row  # per sorted pair: its row of out
    const void *pair_w
    bint assign             # per-slot outputs: out[row] = dot (no weight, no sum)


cdef void _combine(real *out, int64_t d_out, int64_t col, const int64_t *rows,
                   const real *ws, int64_t n, const real *dots, int64_t width,
                   bint assign) noexcept nogil:
    """out[row, col:col+width] += w * dots[i]: one rounding for the product, one for the
    sum (or, for per-slot outputs, out[row, col:col+width] = dots[i])."""
    cdef int64_t i, r
    cdef real wt
    cdef real *y
    cdef const real *d
    for i in range(n):
        y = out + rows[i] * d_out + col
        d = dots + i * width
        if assign:
            for r in range(width):
                y[r] = d[r]
        else:
            wt = ws[i]
            for r in range(width):
                y[r] = y[r] + wt * d[r]


cdef void _tile(const Ctx *ctx, int64_t tile, real *panel, real *dots,
                float *lanes) noexcept nogil:
    cdef int64_t row_start = tile * ctx.tile_rows
    cdef int64_t row_end = min(ctx.d_out, row_start + ctx.tile_rows)
    cdef int64_t a, e, s, n, c0, c1
    cdef c.mxfp4x_rows rows
    cdef const int64_t *toks
    cdef const int64_t *orows
    cdef const real *ws
    rows.row_stride_blocks = ctx.blocks_row_stride
    rows.row_stride_scales = ctx.scales_row_stride
    rows.n_groups = ctx.n_groups
    for a in range(ctx.n_active):
        e = ctx.active[a]
        s = ctx.offsets[e]
        n = ctx.offsets[e + 1] - s
        toks = ctx.pair_tok + s
        orows = ctx.pair_row + s
        ws = (<const real *>ctx.pair_w) + s
        rows.blocks = ctx.blocks + e * ctx.blocks_expert_stride
        rows.scales = ctx.scales + e * ctx.scales_expert_stride
        if real is float:
            if n <= c.MXFP4X_GEMV_MAX_TOKENS:
                # one or a few tokens: fused decode + dot in registers, no panel
                ctx.k.gemv_f32(&rows, row_start, row_end, <const float *>ctx.x, ctx.d_in, toks,
                               n, dots, row_end - row_start)
                _combine(<real *>ctx.out, ctx.d_out, row_start, orows, ws, n, dots,
                         row_end - row_start, ctx.assign)
                continue
        c0 = row_start
        while c0 < row_end:
            c1 = min(row_end, c0 + ctx.panel_rows)
            if real is float:
                ctx.k.decode_f32(&rows, c0, c1, panel)
                ctx.k.panel_dot_f32(panel, c1 - c0, ctx.n_groups, <const float *>ctx.x,
                                    ctx.d_in, toks, n, dots, c1 - c0, lanes)
            else:
                c.mxfp4x_decode_f64(&rows, c0, c1, panel)
                c.mxfp4x_panel_dot_f64(panel, c1 - c0, ctx.n_groups, <const double *>ctx.x,
                                       ctx.d_in, toks, n, dots, c1 - c0)
            _combine(<real *>ctx.out, ctx.d_out, c0, orows, ws, n, dots, c1 - c0, ctx.assign)
            c0 = c1


cdef void _prepare(real *dst, uintptr_t x, int x_dtype, int64_t n_tokens, int64_t n_groups,
                   int half, int n_threads) noexcept nogil:
    cdef int64_t t, d_in = n_groups * 32
    cdef int64_t elem = 8 if x_dtype == c.MXFP4X_DTYPE_F64 else (
        4 if x_dtype == c.MXFP4X_DTYPE_F32 else 2)
    for t in prange(n_tokens, num_threads=n_threads, schedule='static'):
        if real is float:
            c.mxfp4x_prepare_x_f32(<const void *>(x + <uintptr_t>(t * d_in * elem)), x_dtype,
                                   n_groups, half, dst + t * d_in)
        else:
            c.mxfp4x_prepare_x_f64(<const double *>(x + <uintptr_t>(t * d_in * elem)),
                                   n_groups, dst + t * d_in)


cdef void *_xmalloc(int64_t n_bytes) except NULL:
    cdef void *p = malloc(<size_t>max(n_bytes, 64))
    if p == NULL:
        raise MemoryError(f"mxfp4x: cannot allocate {n_bytes} bytes of scratch memory")
    return p


cdef int64_t _route(const int64_t *sel, int64_t n_pairs, int64_t n_experts, int64_t top_k,
                    const real *wts, bint slot_inputs, bint slot_outputs, int64_t *offsets,
                    int64_t *fill, int64_t *active, int64_t *pair_x, int64_t *pair_row,
                    real *pair_w, int64_t *max_count) noexcept nogil:
    """Stable counting sort of the pairs p = t * top_k + k by expert.

    Fills, per sorted pair, its row of x, its row of the output and its weight (1 for
    per-slot outputs); offsets[e]..offsets[e + 1] are expert e's pairs; active lists
    the experts with pairs, ascending.  Returns their number; *max_count is the most
    pairs of one expert."""
    cdef int64_t p, e, n_active = 0
    for e in range(n_experts + 1):
        offsets[e] = 0
    for p in range(n_pairs):
        offsets[sel[p] + 1] += 1
    max_count[0] = 0
    for e in range(n_experts):
        if offsets[e + 1] > 0:
            active[n_active] = e
            n_active += 1
            max_count[0] = max(max_count[0], offsets[e + 1])
        offsets[e + 1] += offsets[e]
        fill[e] = offsets[e]
    for p in range(n_pairs):
        e = sel[p]
        pair_x[fill[e]] = p if slot_inputs else p // top_k
        pair_row[fill[e]] = p if slot_outputs else p // top_k
        pair_w[fill[e]] = 1 if slot_outputs else wts[p]
        fill[e] += 1
    return n_active


cdef _run(real dummy, uintptr_t x, int x_dtype, int64_t n_tokens, int64_t n_groups,
          uintptr_t blocks, int64_t n_experts, int64_t d_out,
          int64_t blocks_expert_stride, int64_t blocks_row_stride,
          uintptr_t scales, int64_t scales_expert_stride, int64_t scales_row_stride,
          uintptr_t selected, int64_t top_k, uintptr_t weights, uintptr_t out,
          int n_threads, str isa, bint slot_inputs, bint slot_outputs):
    cdef Ctx ctx
    cdef int64_t d_in = n_groups * 32, n_pairs = n_tokens * top_k
    cdef int64_t n_tiles, max_count = 0, n_active = 0, scratch_rows
    cdef const int64_t *sel = <const int64_t *>selected
    cdef const real *wts = <const real *>weights
    cdef real *xbuf = NULL
    cdef char *scratch = NULL
    cdef char *mine
    cdef int64_t panel_len, dots_len, lanes_len, per_thread
    cdef unsigned int fpenv
    cdef int half
    cdef int64_t *offsets = NULL
    cdef int64_t *fill = NULL
    cdef int64_t *active = NULL
    cdef int64_t *pair_tok = NULL
    cdef int64_t *pair_row = NULL
    cdef real *pair_w = NULL
    cdef int64_t n_x = n_pairs if slot_inputs else n_tokens
    cdef int tid
    cdef int64_t tile
    if n_pairs == 0 or d_out == 0:
        return
    ctx.k = _pick(isa)
    n_tiles = (d_out + TILE_ROWS - 1) // TILE_ROWS
    n_threads = <int>max(1, min(<int64_t>n_threads, n_tiles))  # more threads than tiles idle
    try:
        offsets = <int64_t *>_xmalloc((n_experts + 1) * 8)
        fill = <int64_t *>_xmalloc((n_experts + 1) * 8)
        active = <int64_t *>_xmalloc((n_experts + 1) * 8)
        pair_tok = <int64_t *>_xmalloc(n_pairs * 8)
        pair_row = <int64_t *>_xmalloc(n_pairs * 8)
        pair_w = <real *>_xmalloc(n_pairs * sizeof(real))
        xbuf = <real *>_xmalloc(n_x * d_in * sizeof(real))
        with nogil:
            n_active = _route(sel, n_pairs, n_experts, top_k, wts, slot_inputs, slot_outputs,
                              offsets, fill, active, pair_tok, pair_row, pair_w, &max_count)
        # per-thread scratch: a panel of decoded rows, the dot products of one
        # expert's pairs against it, and panel_dot's parked lane accumulators
        scratch_rows = min(TILE_ROWS, (PANEL_BYTES // <int64_t>sizeof(real)) // max(d_in, 1))
        scratch_rows = max(12, scratch_rows - scratch_rows % 12)
        panel_len = scratch_rows * d_in
        dots_len = max(max_count * scratch_rows, c.MXFP4X_GEMV_MAX_TOKENS * TILE_ROWS)
        lanes_len = c.MXFP4X_PANEL_SCRATCH_FLOATS(scratch_rows)
        per_thread = panel_len * <int64_t>sizeof(real) + dots_len * <int64_t>sizeof(real) \
            + lanes_len * 4
        per_thread = (per_thread + 63) // 64 * 64  # each thread's scratch on its own lines
        scratch = <char *>_xmalloc(n_threads * per_thread)
        ctx.blocks = <const uint8_t *>blocks
        ctx.scales = <const uint8_t *>scales
        ctx.blocks_expert_stride = blocks_expert_stride
        ctx.blocks_row_stride = blocks_row_stride
        ctx.scales_expert_stride = scales_expert_stride
        ctx.scales_row_stride = scales_row_stride
        ctx.d_out = d_out
        ctx.n_groups = n_groups
        ctx.d_in = d_in
        ctx.tile_rows = TILE_ROWS
        ctx.panel_rows = scratch_rows
        ctx.x = xbuf
        ctx.out = <void *>out
        ctx.active = active
        ctx.n_active = n_active
        ctx.offsets = offsets
        ctx.pair_tok = pair_tok
        ctx.pair_row = pair_row
        ctx.pair_w = pair_w
        ctx.assign = slot_outputs
        half = 16 if real is double else ctx.k.layout_half
        with nogil:
            _prepare(xbuf, x, x_dtype, n_x, n_groups, half, n_threads)
            with parallel(num_threads=n_threads):
                tid = threadid()
                mine = scratch + tid * per_thread
                fpenv = c.mxfp4x_fpenv_enter()
                for tile in prange(n_tiles, schedule='dynamic'):
                    _tile(&ctx, tile, <real *>mine,
                          <real *>(mine + panel_len * <int64_t>sizeof(real)),
                          <float *>(mine + (panel_len + dots_len) * <int64_t>sizeof(real)))
                c.mxfp4x_fpenv_exit(fpenv)
    finally:
        free(offsets)
        free(fill)
        free(active)
        free(pair_tok)
        free(pair_row)
        free(pair_w)
        free(xbuf)
        free(scratch)


def mxfp4_experts(bint f64, uintptr_t x, int x_dtype, int64_t n_tokens, int64_t n_groups,
                  uintptr_t blocks, int64_t n_experts, int64_t d_out,
                  int64_t blocks_expert_stride, int64_t blocks_row_stride,
                  uintptr_t scales, int64_t scales_expert_stride, int64_t scales_row_stride,
                  uintptr_t selected, int64_t top_k, uintptr_t weights, uintptr_t out,
                  int n_threads, str isa=None, bint slot_inputs=False,
                  bint slot_outputs=False):
    """out += sum_k weights[t, k] * W[selected[t, k]] @ x[t], in place.

    out (float32, or float64 when f64) holds the shared output on entry; weights
    have out's dtype; selected is int64 and already checked against [0, n_experts);
    every buffer is C-contiguous except the strided expert/row dimensions of the
    blocks and scales (their last dimensions are contiguous).  Strides in bytes.

    slot_inputs: x has one row per (token, slot), pair p = t * top_k + k uses row p.
    slot_outputs: out has one row per pair and receives W x unweighted, not summed.
    """
    cdef double d0 = 0
    cdef float f0 = 0
    if f64:
        _run(d0, x, x_dtype, n_tokens, n_groups, blocks, n_experts, d_out,
             blocks_expert_stride, blocks_row_stride, scales, scales_expert_stride,
             scales_row_stride, selected, top_k, weights, out, n_threads, isa,
             slot_inputs, slot_outputs)
    else:
        _run(f0, x, x_dtype, n_tokens, n_groups, blocks, n_experts, d_out,
             blocks_expert_stride, blocks_row_stride, scales, scales_expert_stride,
             scales_row_stride, selected, top_k, weights, out, n_threads, isa,
             slot_inputs, slot_outputs)


# ---- the transposed product, for the gradient of the latents ------------------------

# Groups (of 32 input columns) per parallel task of the transposed product, and rows of
# W decoded at once into a thread's panel.
cdef enum:
    T_TILE_GROUPS = 8
    T_PANEL_ROWS = 32   # also the size of _t_tile's coefficient buffer


cdef void _t_tile(const c.mxfp4x_kernels *k, int64_t ct, int64_t n_groups, int64_t d_out,
                  uintptr_t blocks, int64_t blocks_expert_stride, int64_t blocks_row_stride,
                  uintptr_t scales, int64_t scales_expert_stride, int64_t scales_row_stride,
                  const int64_t *active, int64_t n_active, const int64_t *offsets,
                  const int64_t *pair_x, const int64_t *pair_g, const real *pair_w,
                  const real *g, real *out, real *panel) noexcept nogil:
    """Columns [32 g0, 32 g1) of dx: every active expert, its rows in panels, every pair."""
    cdef int64_t d_in = n_groups * 32
    cdef int64_t g0 = ct * T_TILE_GROUPS
    cdef int64_t g1 = min(n_groups, g0 + T_TILE_GROUPS)
    cdef int64_t width = (g1 - g0) * 32
    cdef int64_t a, e, s, n, i, r, j, o0, o1
    cdef real coef
    cdef real *dst
    cdef const real *grow
    cdef const real *pr
    cdef float coefs[T_PANEL_ROWS]
    cdef c.mxfp4x_rows rows
    rows.row_stride_blocks = blocks_row_stride
    rows.row_stride_scales = scales_row_stride
    rows.n_groups = g1 - g0
    for a in range(n_active):
        e = active[a]
        s = offsets[e]
        n = offsets[e + 1] - s
        rows.blocks = (<const uint8_t *>blocks) + e * blocks_expert_stride + g0 * 16
        rows.scales = (<const uint8_t *>scales) + e * scales_expert_stride + g0
        o0 = 0
        while o0 < d_out:
            o1 = min(d_out, o0 + T_PANEL_ROWS)
            if real is float:
                k.decode_f32(&rows, o0, o1, panel)
            else:
                c.mxfp4x_decode_f64(&rows, o0, o1, panel)
            for i in range(n):
                dst = out + pair_x[s + i] * d_in + g0 * 32
                grow = g + pair_g[s + i] * d_out
                if real is float:
                    for r in range(o1 - o0):
                        coefs[r] = pair_w[s + i] * grow[o0 + r]
                    k.axpy_rows_f32(panel, o1 - o0, width, coefs, dst)
                else:
                    for r in range(o1 - o0):
                        coef = pair_w[s + i] * grow[o0 + r]
                        pr = panel + r * width
                        for j in range(width):
                            dst[j] = dst[j] + coef * pr[j]
            o0 = o1


cdef _run_t(real dummy, uintptr_t grad, int64_t n_tokens, int64_t n_groups,
            uintptr_t blocks, int64_t n_experts, int64_t d_out,
            int64_t blocks_expert_stride, int64_t blocks_row_stride,
            uintptr_t scales, int64_t scales_expert_stride, int64_t scales_row_stride,
            uintptr_t selected, int64_t top_k, uintptr_t weights, uintptr_t dx,
            int n_threads, str isa, bint slot_inputs, bint slot_outputs):
    cdef const c.mxfp4x_kernels *k = _pick(isa)
    cdef int64_t n_pairs = n_tokens * top_k
    cdef int64_t ct, n_active = 0, max_count = 0
    cdef int64_t n_ctiles = (n_groups + T_TILE_GROUPS - 1) // T_TILE_GROUPS
    cdef const int64_t *sel = <const int64_t *>selected
    cdef const real *wts = <const real *>weights
    cdef const real *g = <const real *>grad
    cdef real *out = <real *>dx
    cdef int64_t *offsets = NULL
    cdef int64_t *fill = NULL
    cdef int64_t *active = NULL
    cdef int64_t *pair_x = NULL
    cdef int64_t *pair_g = NULL
    cdef real *pair_w = NULL
    cdef char *scratch = NULL
    cdef real *panel
    cdef int64_t per_thread = T_PANEL_ROWS * T_TILE_GROUPS * 32 * <int64_t>sizeof(real) + 64
    cdef unsigned int fpenv
    cdef int tid
    if n_pairs == 0 or d_out == 0 or n_groups == 0:
        return
    n_threads = <int>max(1, min(<int64_t>n_threads, n_ctiles))
    try:
        offsets = <int64_t *>_xmalloc((n_experts + 1) * 8)
        fill = <int64_t *>_xmalloc((n_experts + 1) * 8)
        active = <int64_t *>_xmalloc((n_experts + 1) * 8)
        pair_x = <int64_t *>_xmalloc(n_pairs * 8)
        pair_g = <int64_t *>_xmalloc(n_pairs * 8)
        pair_w = <real *>_xmalloc(n_pairs * sizeof(real))
        scratch = <char *>_xmalloc(n_threads * per_thread)
        with nogil:
            n_active = _route(sel, n_pairs, n_experts, top_k, wts, slot_inputs, slot_outputs,
                              offsets, fill, active, pair_x, pair_g, pair_w, &max_count)
            # each task owns a range of input columns: dx elements have one writer, and
            # each is accumulated in the order (expert, row, pair): thread-count agnostic
            with parallel(num_threads=n_threads):
                tid = threadid()
                panel = <real *>(scratch + tid * per_thread)
                fpenv = c.mxfp4x_fpenv_enter()
                for ct in prange(n_ctiles, schedule='dynamic'):
                    _t_tile(k, ct, n_groups, d_out, blocks, blocks_expert_stride,
                            blocks_row_stride, scales, scales_expert_stride,
                            scales_row_stride, active, n_active, offsets, pair_x, pair_g,
                            pair_w, g, out, panel)
                c.mxfp4x_fpenv_exit(fpenv)
    finally:
        free(offsets)
        free(fill)
        free(active)
        free(pair_x)
        free(pair_g)
        free(pair_w)
        free(scratch)


def mxfp4_experts_t(bint f64, uintptr_t grad, int64_t n_tokens, int64_t n_groups,
                    uintptr_t blocks, int64_t n_experts, int64_t d_out,
                    int64_t blocks_expert_stride, int64_t blocks_row_stride,
                    uintptr_t scales, int64_t scales_expert_stride, int64_t scales_row_stride,
                    uintptr_t selected, int64_t top_k, uintptr_t weights, uintptr_t dx,
                    int n_threads, str isa=None, bint slot_inputs=False,
                    bint slot_outputs=False):
    """dx[x_row(p)] += weights[p] * W[selected[p]]^T grad[out_row(p)], in place.

    The transposed product (gradient of the latents).  dx is (rows of x, d_in) in the
    element layout of the ISA's decode (``layout_half(isa)``; 16 on the float64 path)
    and must start at zero; grad is (rows of out, d_out), contiguous, of dx's dtype.
    Returns the layout used.
    """
    cdef double d0 = 0
    cdef float f0 = 0
    if f64:
        _run_t(d0, grad, n_tokens, n_groups, blocks, n_experts, d_out, blocks_expert_stride,
               blocks_row_stride, scales, scales_expert_stride, scales_row_stride, selected,
               top_k, weights, dx, n_threads, isa, slot_inputs, slot_outputs)
        return 16
    _run_t(f0, grad, n_tokens, n_groups, blocks, n_experts, d_out, blocks_expert_stride,
           blocks_row_stride, scales, scales_expert_stride, scales_row_stride, selected,
           top_k, weights, dx, n_threads, isa, slot_inputs, slot_outputs)
    return _pick(isa).layout_half
