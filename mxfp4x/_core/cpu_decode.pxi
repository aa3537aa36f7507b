# mxfp4x/_core/cpu_decode.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# A decoding step's attention layer as one call (AttentionStep): the query, key and value
# projections, the rotary embedding, the new tokens into the key/value cache, the
# attention over the cache and the output projection, each a parallel step of the call's
# threads, with no Python between them.

cdef struct DenseSegs:
    DenseJob job[3]   # one dense product per matrix, the same tokens
    int64_t first[4]  # matrix i's tasks: [first[i], first[i + 1])


cdef void _dense_segs_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef DenseSegs *s = <DenseSegs *>ctx
    cdef int i = 0
    while task >= s.first[i + 1]:
        i += 1
    _dense_task(<void *>&s.job[i], task - s.first[i], tid)


cdef void _dense_into(DenseJob *j, const c.mxfp4x_kernels *k, const uint16_t *w,
                      int64_t d_out, int64_t d_in, const void *x, bint x_bf16, bint unit,
                      int64_t n_tok, const void *bias, void *dst) noexcept nogil:
    """j: x (n_tok, d_in) times the bf16 rows w (d_out, d_in), the bf16 bias added in
    float32 and the sums rounded once into dst (n_tok, d_out) bf16, in the task's own
    sums (the epilogue of dense_bf16)."""
    j.k, j.w, j.x, j.x_bf16, j.unit, j.out = k, w, x, x_bf16, unit, NULL
    j.d_out, j.d_in, j.n_tok = d_out, d_in, n_tok
    j.bias, j.bias_dtype = bias, c.MXFP4X_DTYPE_BF16
    j.dst, j.dst_dtype = dst, c.MXFP4X_DTYPE_BF16


cdef inline void _widen_bf16(const uint16_t *src, int64_t n, float *dst) noexcept nogil:
    c.mxfp4x_act_load(src, c.MXFP4X_DTYPE_BF16, 0, 1, n, dst)


cdef int _check_unit(const c.mxfp4x_kernels *k, bint unit, int64_t n) except -1:
    """unit: the entry has a bf16 unit and n tokens are its range (dense_bf16's)."""
    if unit and (k.dense_bf16_unit == NULL or n < DENSE_UNIT_MIN_TOKENS):
        raise ValueError(f"unit: the {k.name.decode()} entry's bf16 unit takes "
                         f"{DENSE_UNIT_MIN_TOKENS} to {DENSE_UNIT_MAX_TOKENS} tokens "
                         f"(dense_unit()), got {n}")
    return 0


cdef inline uintptr_t _aligned(uintptr_t p) noexcept nogil:
    return (p + 63) & ~(<uintptr_t>63)


cdef void _add_bf16(const uint16_t *a, uint16_t *b, int64_t n) noexcept nogil:
    """b = a + b elementwise: each sum a float32 one rounded to bf16 (torch's bf16 add)."""
    cdef float fa[256]
    cdef float fb[256]
    cdef int64_t i0, m, i
    for i0 in range(0, n, 256):
        m = min(<int64_t>256, n - i0)
        c.mxfp4x_act_load(a + i0, c.MXFP4X_DTYPE_BF16, 0, 1, m, fa)
        c.mxfp4x_act_load(b + i0, c.MXFP4X_DTYPE_BF16, 0, 1, m, fb)
        for i in range(m):
            fb[i] = fa[i] + fb[i]
        c.mxfp4x_act_store(fb, m, c.MXFP4X_DTYPE_BF16, b + i0)


cdef class _Norm:
    """An RMS norm's weight (h,) for a step's input: activation.h's mxfp4x_rms_norm, the
    bits of :func:`rms_norm` (CompiledRMSNorm's)."""
    cdef const void *w
    cdef int dtype
    cdef float eps

    @staticmethod
    cdef _Norm of(weight, str dtype, float eps, int64_t h):
        cdef _Norm nm = _Norm.__new__(_Norm)
        nm.dtype = _act_dtype(dtype, "norm_dtype")
        nm.w = <const void *>_address(weight, "norm", (h,), _ITEMSIZE[dtype], dtype)
        if not eps >= 0:
            raise ValueError(f"eps: expected a number >= 0, got {eps}")
        nm.eps = eps
        return nm


cdef void _norm_rows(const void *w, int dtype, float eps, int isa, const uint16_t *x,
                     int64_t n, int64_t h, uint16_t *out) noexcept nogil:
    """out (n, h) bf16 = the RMS norm of the bf16 rows x (n, h) with weight w."""
    cdef c.mxfp4x_rms_norm_args a
    a.x, a.in_dtype, a.weight, a.weight_dtype = x, c.MXFP4X_DTYPE_BF16, w, dtype
    a.d, a.eps, a.out, a.out_dtype = h, eps, out, c.MXFP4X_DTYPE_BF16
    cdef c.mxfp4x_fpenv fpenv = c.mxfp4x_fpenv_enter()
    c.mxfp4x_rms_norm(isa, &a, 0, n)
    c.mxfp4x_fpenv_exit(fpenv)


cdef class AttentionStep:
    """One attention layer's weights, for its decoding steps in one call (:meth:`run`):
    gpt-oss's attention (bfloat16 throughout) as transformers computes it, the same bits
    as its pieces run one by one through mxfp4x's kernels (dense_bf16 with a bias and a
    bf16 result, the rotary embedding in transformers' bf16 operations, the cache's
    copy, attention).

    ``weights``: the query, key, value and output projections' (rows, inputs) bfloat16
    bits (uint16, C-contiguous): (hq * d, hidden), (hkv * d, hidden) twice, (hidden, hq *
    d); ``biases``: their (rows,) bfloat16 bits, or None each; ``sinks``: (hq,) of
    ``sinks_dtype`` (16-bit floats as their bits) or None.  The arrays are kept (the
    weights are read where they are)."""
    cdef readonly int64_t hidden, hq, hkv, d
    cdef float scaling
    cdef const uint16_t *w[4]
    cdef const void *b[4]
    cdef const void *sinks
    cdef int sinks_dtype
    cdef object keep

    def __init__(self, weights, biases, sinks, str sinks_dtype, int64_t hq, int64_t hkv,
                 int64_t d, float scaling):
        if len(weights) != 4 or len(biases) != 4:
            raise ValueError("weights, biases: expected the query, key, value and output "
                             "projections' (4 each)")
        if hq <= 0 or hkv <= 0 or hq % hkv or d <= 0 or d % 2:
            raise ValueError(f"hq, hkv, d: expected hq a multiple of hkv and an even d, got "
                             f"{hq}, {hkv}, {d}")
        wq = weights[0]
        if not isinstance(wq, np.ndarray) or wq.ndim != 2:
            raise ValueError("weights[0]: expected a 2-D array (hq * d, hidden) of bfloat16 "
                             "bits")
        self.hidden, self.hq, self.hkv, self.d = wq.shape[1], hq, hkv, d
        self.scaling = scaling
        shapes = ((hq * d, self.hidden), (hkv * d, self.hidden), (hkv * d, self.hidden),
                  (self.hidden, hq * d))
        cdef int i
        for i in range(4):
            self.w[i] = <const uint16_t *>_address(weights[i], f"weights[{i}]", shapes[i], 2,
                                                   "bfloat16 bits")
            self.b[i] = NULL if biases[i] is None else <const void *>_address(
                biases[i], f"biases[{i}]", (shapes[i][0],), 2, "bfloat16 bits")
        self.sinks, self.sinks_dtype = NULL, c.MXFP4X_DTYPE_F32
        if sinks is not None:
            self.sinks_dtype = _act_dtype(sinks_dtype, "sinks_dtype")
            self.sinks = <const void *>_address(sinks, "sinks", (hq,), _ITEMSIZE[sinks_dtype],
                                                sinks_dtype)
        self.keep = (tuple(weights), tuple(biases), sinks)

    def run(self, x, cos, sin, k_cache, v_cache, int64_t pos, int64_t start, mask,
            str mask_dtype, out, *, isa=None, int n_threads=1, bint unit=False, norm=None,
            str norm_dtype="float32", float eps=0, bint residual=False):
        """out (b, t, hidden) = the layer's attention output for the hidden states x (b, t,
        hidden), at most DENSE_UNIT_MAX_TOKENS tokens in all; all bfloat16 bits (uint16),
        C-contiguous.

        * q, k, v = x's projections (dense_bf16, the bias added, rounded to bf16);
        * q and k turned by ``cos`` and ``sin`` ((1 or b, t, d / 2) bf16 bits, C-contiguous:
          token (s, i)'s row), transformers' rotary embedding in its bf16 operations;
        * k and v written to the caches ``k_cache``, ``v_cache`` ((b, hkv, capacity, d)
          bf16 bits, C-contiguous) at tokens [pos, pos + t);
        * the attention (attention.h) of q over the caches' tokens [start, pos + t), with
          ``mask`` (None, or (1 or b, 1 or hq, t, pos + t - start) of ``mask_dtype``, any
          strides but the last) and the sinks, rounded to bf16;
        * its (b, t, hq * d) rows' output projection, the bias added, into ``out``.

        ``unit``: the projections on the bf16 unit (dense_bf16's ``unit``: 5 to
        DENSE_UNIT_MAX_TOKENS tokens).  ``norm`` ((hidden,) of ``norm_dtype``, 16-bit
        floats as their bits) and ``eps``: x is the layer's input, and the layer's RMS
        norm of it (:func:`rms_norm`'s bits, rounded to bf16) is what the projections
        take.  ``residual``: ``out`` = x + the attention output (each sum a float32 one
        rounded to bf16, torch's bf16 add)."""
        cdef const c.mxfp4x_kernels *k = kernels_of(isa)
        cdef int nt = checked_threads(n_threads)
        if not isinstance(x, np.ndarray) or x.ndim != 3:
            raise ValueError(f"x: expected a 3-D array (b, t, {self.hidden}) of bfloat16 bits")
        cdef int64_t nb = x.shape[0], t = x.shape[1], n = nb * t
        cdef int64_t h = self.hidden, hq = self.hq, hkv = self.hkv, d = self.d
        cdef int64_t half = d // 2, qw = hq * d, kw = hkv * d
        cdef const uint16_t *xp = <const uint16_t *>_address(x, "x", (nb, t, h), 2,
                                                             "bfloat16 bits")
        if n == 0 or n > DENSE_UNIT_MAX_TOKENS_C:
            raise ValueError(f"x: expected 1 to {DENSE_UNIT_MAX_TOKENS} tokens, got {n}")
        _check_unit(k, unit, n)
        cdef int64_t cb = cos.shape[0] if isinstance(cos, np.ndarray) and cos.ndim == 3 else 0
        if cb != 1 and cb != nb:
            raise ValueError(f"cos: expected a (1 or {nb}, {t}, {half}) array of bfloat16 bits")
        cdef const uint16_t *cp = <const uint16_t *>_address(cos, "cos", (cb, t, half), 2,
                                                             "bfloat16 bits")
        cdef const uint16_t *sp = <const uint16_t *>_address(sin, "sin", (cb, t, half), 2,
                                                             "bfloat16 bits")
        cdef int64_t cs = 0 if cb == 1 else t * half
        if not isinstance(k_cache, np.ndarray) or k_cache.ndim != 4:
            raise ValueError(f"k_cache: expected a 4-D array ({nb}, {hkv}, capacity, {d})")
        cdef int64_t cap = k_cache.shape[2]
        cdef uint16_t *kc = <uint16_t *>_address(k_cache, "k_cache", (nb, hkv, cap, d), 2,
                                                 "bfloat16 bits")
        cdef uint16_t *vc = <uint16_t *>_address(v_cache, "v_cache", (nb, hkv, cap, d), 2,
                                                 "bfloat16 bits")
        if not (k_cache.flags.writeable and v_cache.flags.writeable):
            raise ValueError("k_cache, v_cache: expected writable arrays")
        if not 0 <= start <= pos or pos + t > cap:
            raise ValueError(f"pos, start: expected 0 <= start <= pos and pos + {t} <= the "
                             f"caches' {cap} tokens, got pos {pos}, start {start}")
        cdef int64_t tk = pos + t - start
        cdef uint16_t *op = <uint16_t *>_address(out, "out", (nb, t, h), 2, "bfloat16 bits")
        if not out.flags.writeable:
            raise ValueError("out: expected a writable array")
        cdef _Norm nm = None if norm is None else _Norm.of(norm, norm_dtype, eps, h)
        cdef AttentionJob aj
        aj.a.mask, aj.a.mask_dtype = NULL, c.MXFP4X_DTYPE_F32
        aj.a.m_sb = aj.a.m_sh = aj.a.m_st = 0
        if mask is not None:
            aj.a.mask_dtype = _act_dtype(mask_dtype, "mask_dtype")
            aj.a.m_sb, aj.a.m_sh, aj.a.m_st = _strided_mask(mask, nb, hq, t, tk,
                                                            _ITEMSIZE[mask_dtype])
            aj.a.mask = <const void *><uintptr_t>mask.__array_interface__["data"][0]
        # the call's scratch: q, the new keys and values, the attention's rows (bf16), the
        # tokens widened where the entry's dense product takes float32 ones, the
        # attention's per-thread floats
        cdef bint x_bf16 = unit or k.dense_bf16x != NULL
        aj.per_thread = c.mxfp4x_attention_scratch(tk, d)
        cdef int64_t sizes[8]
        sizes[0], sizes[1], sizes[2], sizes[3] = 2 * n * qw, 2 * n * kw, 2 * n * kw, 2 * n * qw
        sizes[4] = 0 if x_bf16 else 4 * n * h
        sizes[5] = 0 if x_bf16 else 4 * n * qw
        sizes[6] = 4 * nt * aj.per_thread
        sizes[7] = 0 if nm is None else 2 * n * h  # the normed input
        cdef int64_t total = 0
        cdef int i
        for i in range(8):
            total += (sizes[i] + 63) // 64 * 64
        scratch = np.empty(total + 64, dtype=np.uint8)
        cdef uintptr_t p = _aligned(_data(scratch))
        cdef uintptr_t parts[8]
        for i in range(8):
            parts[i] = p
            p += (sizes[i] + 63) // 64 * 64
        cdef uint16_t *qp = <uint16_t *>parts[0]
        cdef uint16_t *knp = <uint16_t *>parts[1]
        cdef uint16_t *vnp = <uint16_t *>parts[2]
        cdef uint16_t *ap = <uint16_t *>parts[3]
        cdef float *xw = <float *>parts[4]
        cdef float *aw = <float *>parts[5]
        aj.scratch = <float *>parts[6]
        cdef const uint16_t *xl = xp if nm is None else <const uint16_t *>parts[7]
        cdef const void *xin = <const void *>xl if x_bf16 else <const void *>xw
        cdef const void *ain = <const void *>ap if x_bf16 else <const void *>aw
        cdef DenseSegs qkv
        _dense_into(&qkv.job[0], k, self.w[0], qw, h, xin, x_bf16, unit, n, self.b[0], qp)
        _dense_into(&qkv.job[1], k, self.w[1], kw, h, xin, x_bf16, unit, n, self.b[1], knp)
        _dense_into(&qkv.job[2], k, self.w[2], kw, h, xin, x_bf16, unit, n, self.b[2], vnp)
        qkv.first[0] = 0
        for i in range(3):
            qkv.first[i + 1] = qkv.first[i] + _dense_job_tasks(&qkv.job[i], nt)
        cdef DenseJob oj
        _dense_into(&oj, k, self.w[3], h, qw, ain, x_bf16, unit, n, self.b[3], op)
        # q read as (b, t, hq, d): token (s, i)'s heads one after another
        aj.a.q, aj.a.k, aj.a.v, aj.a.out = qp, kc + start * d, vc + start * d, ap
        aj.a.q_dtype = aj.a.kv_dtype = aj.a.out_dtype = c.MXFP4X_DTYPE_BF16
        aj.a.q_sb, aj.a.q_sh, aj.a.q_st = t * qw, d, qw
        aj.a.k_sb, aj.a.k_sh, aj.a.k_st = hkv * cap * d, cap * d, d
        aj.a.v_sb, aj.a.v_sh, aj.a.v_st = hkv * cap * d, cap * d, d
        aj.a.sinks, aj.a.sinks_dtype = self.sinks, self.sinks_dtype
        aj.a.b, aj.a.hq, aj.a.hkv, aj.a.tq, aj.a.tk, aj.a.d = nb, hq, hkv, t, tk, d
        aj.a.scaling = self.scaling
        aj.isa = k.isa
        cdef int64_t r, s, j, hh
        cdef c.mxfp4x_fpenv fpenv
        cdef const void *nw = NULL if nm is None else nm.w
        cdef int ndt = 0 if nm is None else nm.dtype
        cdef float neps = 0 if nm is None else nm.eps
        with nogil:
            if nw != NULL:
                _norm_rows(nw, ndt, neps, k.isa, xp, n, h, <uint16_t *>xl)
            if not x_bf16:
                _widen_bf16(xl, n * h, xw)
            parallel_tasks(nt, qkv.first[3], _dense_segs_task, &qkv)
            fpenv = c.mxfp4x_fpenv_enter()
            for r in range(n):
                s, j = r // t, r % t
                c.mxfp4x_rope_bf16(qp + r * qw, hq, d, cp + s * cs + j * half,
                                   sp + s * cs + j * half)
                c.mxfp4x_rope_bf16(knp + r * kw, hkv, d, cp + s * cs + j * half,
                                   sp + s * cs + j * half)
                for hh in range(hkv):
                    memcpy(kc + ((s * hkv + hh) * cap + pos + j) * d, knp + r * kw + hh * d,
                           2 * d)
                    memcpy(vc + ((s * hkv + hh) * cap + pos + j) * d, vnp + r * kw + hh * d,
                           2 * d)
            c.mxfp4x_fpenv_exit(fpenv)
            parallel_tasks(nt, c.mxfp4x_attention_tasks(&aj.a), _attention_task, &aj)
            if not x_bf16:
                _widen_bf16(ap, n * qw, aw)
            parallel_tasks(nt, _dense_job_tasks(&oj, nt), _dense_task, &oj)
            if residual:
                _add_bf16(xp, op, n * h)


cdef void _call_desc(c.mxfp4x_call *d, Experts ex, const c.mxfp4x_kernels *k, int nt,
                     int64_t n, int64_t top_k, const int64_t *selected, const void *src,
                     int src_rows, void *dst, int dst_rows, const float *mix,
                     const float *init):
    """A forward call of float32 sums on bf16 latents rounded once into a bf16 dst: the
    call the facade makes for these rows (cpu_impl.experts), its arrays already checked."""
    d.product, d.compute, d.kernels, d.n_threads = c.MXFP4X_FORWARD, c.MXFP4X_DTYPE_F32, k, nt
    d.experts.n_experts, d.experts.d_out = ex.n_experts, ex.d_out
    d.experts.n_groups, d.experts.rows = ex.n_groups, ex.rows
    d.n_tokens, d.top_k, d.selected = n, top_k, selected
    d.mix, d.src, d.src_dtype, d.src_rows = <const void *>mix, src, c.MXFP4X_DTYPE_BF16, src_rows
    d.dst, d.dst_rows, d.dst_dtype = dst, dst_rows, c.MXFP4X_DTYPE_BF16
    d.init, d.init_dtype = <const void *>init, c.MXFP4X_DTYPE_F32


cdef class ExpertsStep:
    """One gpt-oss experts layer (MXFP4 gate/up and down, bf16 biases), for its decoding
    steps in two calls: :meth:`route` (the router's logits) and :meth:`run` (the experts
    of the routed tokens), the same bits as the pieces mxfp4x runs one by one for them
    (dense_bf16 with a bias and a bf16 result; the per-slot gate/up product, gpt-oss's
    SwiGLU with its biases rounded to bf16, the routing-weighted down biases in float32,
    the down product from them, rounded once to bf16).

    ``gate_up``, ``down``: the two products' :class:`Experts` (E experts of (2F, H) and
    (H, F)); ``gate_up_bias`` (E, 2F) and ``down_bias`` (E, H) of their dtypes (16-bit
    floats as their bits); ``router`` (E, H) bf16 bits and ``router_bias`` (E,) bf16 bits
    or None; ``limit``, ``alpha``: the SwiGLU's.  The arrays and tables are kept."""
    cdef readonly Experts gate_up, down
    cdef const void *gu_bias
    cdef const void *dn_bias
    cdef int gu_bias_dtype, dn_bias_dtype
    cdef const uint16_t *router
    cdef const void *router_bias
    cdef readonly int64_t n_experts, hidden, d_ff
    cdef float limit, alpha
    cdef object keep

    def __init__(self, Experts gate_up not None, Experts down not None, gate_up_bias,
                 str gate_up_bias_dtype, down_bias, str down_bias_dtype, router, router_bias,
                 float limit, float alpha):
        cdef int64_t e = gate_up.n_experts, h = gate_up.n_groups * c.MXFP4X_GROUP
        cdef int64_t f = gate_up.d_out // 2
        if gate_up.form != "split" or down.form != "split" or down.n_experts != e \
                or gate_up.d_out != 2 * f or down.d_out != h \
                or down.n_groups * c.MXFP4X_GROUP != f:
            raise ValueError(f"gate_up, down: expected E experts of (2F, H) and (H, F) in the "
                             f"split form, got {e} of ({gate_up.d_out}, {h}), "
                             f"{down.n_experts} of ({down.d_out}, "
                             f"{down.n_groups * c.MXFP4X_GROUP})")
        self.gate_up, self.down, self.n_experts, self.hidden, self.d_ff = gate_up, down, e, h, f
        self.gu_bias_dtype = _act_dtype(gate_up_bias_dtype, "gate_up_bias_dtype")
        self.gu_bias = <const void *>_address(gate_up_bias, "gate_up_bias", (e, 2 * f),
                                              _ITEMSIZE[gate_up_bias_dtype],
                                              gate_up_bias_dtype)
        self.dn_bias_dtype = _act_dtype(down_bias_dtype, "down_bias_dtype")
        self.dn_bias = <const void *>_address(down_bias, "down_bias", (e, h),
                                              _ITEMSIZE[down_bias_dtype], down_bias_dtype)
        self.router = <const uint16_t *>_address(router, "router", (e, h), 2, "bfloat16 bits")
        self.router_bias = NULL if router_bias is None else <const void *>_address(
            router_bias, "router_bias", (e,), 2, "bfloat16 bits")
        self.limit, self.alpha = limit, alpha
        self.keep = (gate_up_bias, down_bias, router, router_bias)

    def route(self, x, out, *, isa=None, int n_threads=1, bint unit=False, norm=None,
              str norm_dtype="float32", float eps=0, normed=None):
        """out (n, E) = the router's logits for the tokens x (n, H): their product with the
        router's rows, the bias added in float32, rounded once to bf16; bf16 bits (uint16),
        C-contiguous, at most DENSE_UNIT_MAX_TOKENS tokens (``unit``: on the bf16 unit,
        dense_bf16's).  ``norm`` ((H,) of ``norm_dtype``) and ``eps``: the tokens are
        the layer's RMS norm of x (:func:`rms_norm`'s bits, rounded to bf16), written to
        ``normed`` (n, H) bf16 bits, the tokens :meth:`run` then takes."""
        cdef const c.mxfp4x_kernels *k = kernels_of(isa)
        cdef int nt = checked_threads(n_threads)
        cdef int64_t n = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else -1
        if n < 1 or n > DENSE_UNIT_MAX_TOKENS_C:
            raise ValueError(f"x: expected a 2-D array of 1 to {DENSE_UNIT_MAX_TOKENS} tokens "
                             f"(n, {self.hidden}) of bfloat16 bits")
        cdef const uint16_t *xp = <const uint16_t *>_address(x, "x", (n, self.hidden), 2,
                                                             "bfloat16 bits")
        cdef void *op = <void *>_address(out, "out", (n, self.n_experts), 2, "bfloat16 bits")
        if not out.flags.writeable:
            raise ValueError("out: expected a writable array")
        _check_unit(k, unit, n)
        cdef _Norm nm = None
        cdef uint16_t *np_ = NULL
        if norm is not None:
            nm = _Norm.of(norm, norm_dtype, eps, self.hidden)
            if normed is None:
                raise ValueError(f"normed: expected an ({n}, {self.hidden}) array of "
                                 f"bfloat16 bits for the normed tokens (norm is given)")
            np_ = <uint16_t *>_address(normed, "normed", (n, self.hidden), 2, "bfloat16 bits")
            if not normed.flags.writeable:
                raise ValueError("normed: expected a writable array")
            with nogil:
                _norm_rows(nm.w, nm.dtype, nm.eps, k.isa, xp, n, self.hidden, np_)
            xp = np_
        cdef bint x_bf16 = unit or k.dense_bf16x != NULL
        xw = None if x_bf16 else np.empty(n * self.hidden, dtype=np.float32)
        cdef float *wp = NULL if x_bf16 else <float *>_data(xw)
        cdef DenseJob j
        _dense_into(&j, k, self.router, self.n_experts, self.hidden,
                    <const void *>xp if x_bf16 else <const void *>wp, x_bf16, unit, n,
                    self.router_bias, op)
        with nogil:
            if not x_bf16:
                _widen_bf16(xp, n * self.hidden, wp)
            parallel_tasks(nt, _dense_job_tasks(&j, nt), _dense_task, &j)

    def run(self, x, selected, weights, out, *, isa=None, int n_threads=1, residual=None):
        """out (n, H) = sum over the n tokens' top_k slots of weights[t, s] (down_e(
        swiglu(gate_up_e x + gate_up_bias_e)) + down_bias_e), e = selected[t, s]: x (n,
        H) and out bf16 bits, ``selected`` (n, top_k) int64 in [0, E), ``weights`` (n,
        top_k) bf16 bits (taken exactly as float32); C-contiguous.  The gate/up outputs
        and the activation rounded to bf16 per slot, the down sums in float32 from the
        weighted biases, rounded once.  ``residual`` ((n, H) bf16 bits, or None): ``out``
        = residual + that (each sum a float32 one rounded to bf16, torch's bf16 add)."""
        cdef const c.mxfp4x_kernels *k = kernels_of(isa)
        cdef int nt = checked_threads(n_threads)
        if not isinstance(selected, np.ndarray) or selected.ndim != 2 \
                or selected.dtype != np.int64:
            raise ValueError("selected: expected a 2-D int64 array (n, top_k)")
        cdef int64_t n = selected.shape[0], top_k = selected.shape[1]
        cdef int64_t h = self.hidden, f = self.d_ff, e = self.n_experts, i
        cdef const int64_t *sp = <const int64_t *>_address(selected, "selected", (n, top_k),
                                                           8, "int64 expert ids")
        for i in range(n * top_k):
            if sp[i] < 0 or sp[i] >= e:
                raise IndexError(f"selected: entry {i} is {sp[i]}, outside [0, {e})")
        cdef const uint16_t *wp = <const uint16_t *>_address(weights, "weights", (n, top_k),
                                                             2, "bfloat16 bits")
        cdef const void *xp = <const void *>_address(x, "x", (n, h), 2, "bfloat16 bits")
        cdef void *op = <void *>_address(out, "out", (n, h), 2, "bfloat16 bits")
        if not out.flags.writeable:
            raise ValueError("out: expected a writable array")
        if n == 0 or top_k == 0:
            raise ValueError("selected: expected at least one token and one slot")
        cdef const uint16_t *rp = NULL if residual is None else <const uint16_t *>_address(
            residual, "residual", (n, h), 2, "bfloat16 bits")
        # scratch: the per-slot gate/up outputs and activations (bf16), the weights and
        # the mixed biases (float32)
        gu = np.empty(n * top_k * 2 * f, dtype=np.uint16)
        act = np.empty(n * top_k * f, dtype=np.uint16)
        mix = np.empty(n * top_k, dtype=np.float32)
        start = np.empty(n * h, dtype=np.float32)
        cdef uint16_t *gup = <uint16_t *>_data(gu)
        cdef uint16_t *ap = <uint16_t *>_data(act)
        cdef float *mp = <float *>_data(mix)
        cdef float *stp = <float *>_data(start)
        for i in range(n * top_k):
            mp[i] = c.mxfp4x_bf16_to_f32(wp[i])
        cdef c.mxfp4x_call first, second
        _call_desc(&first, self.gate_up, k, nt, n, top_k, sp, xp, c.MXFP4X_ROWS_PER_TOKEN,
                   gup, c.MXFP4X_ROWS_PER_SLOT, NULL, NULL)
        _call_desc(&second, self.down, k, nt, n, top_k, sp, ap, c.MXFP4X_ROWS_PER_SLOT,
                   op, c.MXFP4X_ROWS_PER_TOKEN, mp, stp)
        cdef SwigluJob sj
        sj.a.gate_up, sj.a.in_dtype = gup, c.MXFP4X_DTYPE_BF16
        sj.a.bias, sj.a.bias_dtype, sj.a.ids = self.gu_bias, self.gu_bias_dtype, sp
        sj.a.d_ff, sj.a.limit, sj.a.alpha = f, self.limit, self.alpha
        sj.a.out, sj.a.out_dtype = ap, c.MXFP4X_DTYPE_BF16
        sj.isa, sj.n_rows = k.isa, n * top_k
        sj.rows_per_task = max(1, ROW_TASK_ELEMS // max(1, f))
        cdef MixJob mj
        mj.a.weights, mj.a.rows, mj.a.rows_dtype = mp, self.dn_bias, self.dn_bias_dtype
        mj.a.ids, mj.a.top_k, mj.a.d, mj.a.out = sp, top_k, h, stp
        mj.isa, mj.n_rows = k.isa, n
        mj.rows_per_task = max(1, ROW_TASK_ELEMS // max(1, h * top_k))
        cdef float f0 = 0
        _drive(f0, &first, NULL)
        with nogil:
            parallel_tasks(nt, (sj.n_rows + sj.rows_per_task - 1) // sj.rows_per_task,
                           _swiglu_task, &sj)
            parallel_tasks(nt, (n + mj.rows_per_task - 1) // mj.rows_per_task, _mix_task, &mj)
        _drive(f0, &second, NULL)
        if rp != NULL:
            with nogil:
                _add_bf16(rp, <uint16_t *>op, n * h)
