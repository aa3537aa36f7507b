# mxfp4x/_core/cpu_attention.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# The attention of a few query tokens over a key/value cache (include/mxfp4x/attention.h),
# in tasks of (sequence, key/value head, up to 8 query rows) on the call's threads.

cdef struct AttentionJob:
    c.mxfp4x_attention_args a
    int isa
    float *scratch
    int64_t per_thread


cdef void _attention_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const AttentionJob *j = <const AttentionJob *>ctx
    c.mxfp4x_attention(j.isa, &j.a, task, task + 1, j.scratch + tid * j.per_thread)


cdef tuple _strided_mask(mask, int64_t b, int64_t hq, int64_t tq, int64_t tk, int itemsize):
    """The mask's element strides (batch, head, token): a 4-D array (1 or b, 1 or hq, tq,
    tk) of itemsize-byte items whose last dimension is contiguous (a stride 0 for a
    dimension of 1: it broadcasts)."""
    if not isinstance(mask, np.ndarray) or mask.ndim != 4 or mask.itemsize != itemsize \
            or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hq) \
            or mask.shape[2] != tq or mask.shape[3] != tk \
            or (tk > 1 and mask.strides[3] != itemsize) \
            or any(st < 0 or st % itemsize for st in mask.strides):
        raise ValueError(f"mask: expected a 4-D array (1 or {b}, 1 or {hq}, {tq}, {tk}) of "
                         f"{itemsize}-byte items, its last dimension contiguous, got "
                         f"{getattr(mask, 'shape', type(mask).__name__)}, strides "
                         f"{getattr(mask, 'strides', None)}")
    return tuple(0 if mask.shape[i] == 1 else mask.strides[i] // itemsize for i in range(3))


cdef uintptr_t _strided_cache(arr, str name, tuple shape, int itemsize, str what,
                              int64_t *strides) except? 0:
    """The data address of a 4-D numpy array of this shape and item size whose last
    dimension is contiguous (a key/value cache read through a view: its batch, head and
    token strides, in items, go to ``strides``)."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array ({what}), got {type(arr).__name__}")
    if arr.shape != shape or arr.itemsize != itemsize \
            or (shape[3] > 1 and arr.strides[3] != itemsize) \
            or any(st < 0 or st % itemsize for st in arr.strides):
        raise ValueError(f"{name}: expected a {shape} array of {itemsize}-byte items "
                         f"({what}), its last dimension contiguous, got shape {arr.shape}, "
                         f"dtype {arr.dtype}, strides {arr.strides}")
    for i in range(3):
        strides[i] = arr.strides[i] // itemsize
    return <uintptr_t>arr.__array_interface__["data"][0]


def attention(q, k, v, mask, sinks, out, str dtype, str mask_dtype, str sinks_dtype,
              float scaling, *, isa=None, int n_threads=1):
    """out (B, TQ, HQ, D) = the softmax attention of q (B, HQ, TQ, D) over k and v (B, HKV,
    TK, D), query head h reading key/value head h // (HQ // HKV), with the additive
    ``mask`` (None, or (1 or B, 1 or HQ, TQ, TK), any strides but the last) and one sink
    logit per query head (``sinks`` (HQ,), or None): attention.h's mxfp4x_attention, the
    same bits on every ISA and thread count.  q, out C-contiguous of ``dtype``; k and v
    of ``dtype`` with any strides but the last (views of a longer cache); 16-bit floats
    as their uint16 bits; dtypes named."""
    cdef AttentionJob job
    for name, arr in (("q", q), ("k", k), ("v", v)):
        if not isinstance(arr, np.ndarray) or arr.ndim != 4:
            raise ValueError(f"{name}: expected a 4-D array, got "
                             f"{getattr(arr, 'shape', type(arr).__name__)}")
    cdef int64_t b = q.shape[0], hq = q.shape[1], tq = q.shape[2], d = q.shape[3]
    cdef int64_t hkv = k.shape[1], tk = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"k: {hkv} key/value heads, expected a divisor of q's {hq} heads")
    job.a.q_dtype = job.a.kv_dtype = job.a.out_dtype = _act_dtype(dtype, "dtype")
    cdef int size = _ITEMSIZE[dtype]
    job.a.q = <const void *>_address(q, "q", (b, hq, tq, d), size, dtype)
    cdef int64_t ks[3]
    cdef int64_t vs[3]
    job.a.k = <const void *>_strided_cache(k, "k", (b, hkv, tk, d), size, dtype, ks)
    job.a.v = <const void *>_strided_cache(v, "v", (b, hkv, tk, d), size, dtype, vs)
    job.a.out = <void *>_address(out, "out", (b, tq, hq, d), size, dtype)
    if not out.flags.writeable:
        raise ValueError("out: expected a writable array")
    job.a.q_sb, job.a.q_sh, job.a.q_st = hq * tq * d, tq * d, d
    job.a.k_sb, job.a.k_sh, job.a.k_st = ks[0], ks[1], ks[2]
    job.a.v_sb, job.a.v_sh, job.a.v_st = vs[0], vs[1], vs[2]
    job.a.mask, job.a.mask_dtype = NULL, c.MXFP4X_DTYPE_F32
    job.a.m_sb = job.a.m_sh = job.a.m_st = 0
    if mask is not None:
        job.a.mask_dtype = _act_dtype(mask_dtype, "mask_dtype")
        job.a.m_sb, job.a.m_sh, job.a.m_st = _strided_mask(mask, b, hq, tq, tk,
                                                           _ITEMSIZE[mask_dtype])
        job.a.mask = <const void *><uintptr_t>mask.__array_interface__["data"][0]
    job.a.sinks, job.a.sinks_dtype = NULL, c.MXFP4X_DTYPE_F32
    if sinks is not None:
        job.a.sinks_dtype = _act_dtype(sinks_dtype, "sinks_dtype")
        job.a.sinks = <const void *>_address(sinks, "sinks", (hq,), _ITEMSIZE[sinks_dtype],
                                             sinks_dtype)
    job.a.b, job.a.hq, job.a.hkv, job.a.tq, job.a.tk, job.a.d = b, hq, hkv, tq, tk, d
    job.a.scaling = scaling
    job.isa = kernels_of(isa).isa
    cdef int nt = checked_threads(n_threads)
    cdef int64_t n_tasks = c.mxfp4x_attention_tasks(&job.a)
    if n_tasks == 0 or d == 0:
        return
    job.per_thread = c.mxfp4x_attention_scratch(tk, d)
    scratch = np.empty(nt * job.per_thread, dtype=np.float32)  # tid < nt (parallel_tasks)
    job.scratch = <float *>_data(scratch)
    with nogil:
        parallel_tasks(nt, n_tasks, _attention_task, &job)
