# mxfp4x/_core/cpu_act.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# What runs between an MoE layer's two products (include/mxfp4x/activation.h): gpt-oss's
# clamped SwiGLU, the routing-weighted sum of bias rows and Kimi K3's SiTU times its
# clipped up branch; and gpt-oss's RMS norm; in tasks of whole rows.

cdef struct SwigluJob:
    c.mxfp4x_swiglu_args a
    int isa
    int64_t rows_per_task, n_rows

cdef struct MixJob:
    c.mxfp4x_mix_args a
    int isa
    int64_t rows_per_task, n_rows


cdef struct SituJob:
    c.mxfp4x_situ_args a
    int isa
    int64_t rows_per_task, n_rows


cdef struct RmsNormJob:
    c.mxfp4x_rms_norm_args a
    int isa
    int64_t rows_per_task, n_rows


cdef void _rms_norm_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const RmsNormJob *j = <const RmsNormJob *>ctx
    cdef int64_t r0 = task * j.rows_per_task
    c.mxfp4x_rms_norm(j.isa, &j.a, r0, min(j.n_rows, r0 + j.rows_per_task))


cdef void _situ_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const SituJob *j = <const SituJob *>ctx
    cdef int64_t r0 = task * j.rows_per_task
    c.mxfp4x_situ_glu(j.isa, &j.a, r0, min(j.n_rows, r0 + j.rows_per_task))


cdef void _swiglu_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const SwigluJob *j = <const SwigluJob *>ctx
    cdef int64_t r0 = task * j.rows_per_task
    c.mxfp4x_gpt_oss_swiglu(j.isa, &j.a, r0, min(j.n_rows, r0 + j.rows_per_task))


cdef void _mix_task(void *ctx, int64_t task, int tid) noexcept nogil:
    cdef const MixJob *j = <const MixJob *>ctx
    cdef int64_t t0 = task * j.rows_per_task
    c.mxfp4x_mix_rows(j.isa, &j.a, t0, min(j.n_rows, t0 + j.rows_per_task))


cdef int _act_dtype(str dtype, str arg) except -1:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{arg}: expected 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return _DTYPES[dtype]


cdef int _check_ids(ids, int64_t n, int64_t n_rows, str arg) except -1:
    """ids: a C-contiguous int64 array of n entries, each in [0, n_rows)."""
    cdef uintptr_t a = _address(ids, arg, (n,), 8, "int64 row ids")
    cdef const int64_t *p = <const int64_t *>a
    cdef int64_t i, bad = -1
    if ids.dtype != np.int64:
        raise ValueError(f"{arg}: expected int64, got {ids.dtype}")
    with nogil:
        for i in range(n):
            if p[i] < 0 or p[i] >= n_rows:
                bad = i
                break
    if bad >= 0:
        raise IndexError(f"{arg}: entry {bad} is {p[bad]}, outside [0, {n_rows})")
    return 0


def gpt_oss_swiglu(gate_up, str in_dtype, bias, str bias_dtype, ids, out, str out_dtype,
                   float limit, float alpha, *, isa=None, int n_threads=1):
    """out = gpt-oss's clamped SwiGLU of gate_up (N, 2F; the gate in the even columns, the
    up in the odd ones) plus its bias rows bias[ids] (bias (E, 2F), or None), rounded once
    into out (N, F): activation.h's mxfp4x_gpt_oss_swiglu, the same bits on every ISA and
    thread count.  Arrays C-contiguous, 16-bit floats as their uint16 bits; dtypes named
    ('float32', 'bfloat16', 'float16'); ``isa`` (None: the default) only picks the vector
    width."""
    cdef SwigluJob job
    cdef int64_t n = gate_up.shape[0] if isinstance(gate_up, np.ndarray) and gate_up.ndim == 2 \
        else -1
    if n < 0 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected a 2-D array (N, 2F), got "
                         f"{getattr(gate_up, 'shape', type(gate_up).__name__)}")
    cdef int64_t d_ff = gate_up.shape[1] // 2
    job.a.in_dtype = _act_dtype(in_dtype, "in_dtype")
    job.a.out_dtype = _act_dtype(out_dtype, "out_dtype")
    job.a.gate_up = <const void *>_address(gate_up, "gate_up", (n, 2 * d_ff),
                                           _ITEMSIZE[in_dtype], in_dtype)
    job.a.out = <void *>_address(out, "out", (n, d_ff), _ITEMSIZE[out_dtype], out_dtype)
    if not out.flags.writeable:
        raise ValueError("out: expected a writable array")
    job.a.bias, job.a.bias_dtype, job.a.ids = NULL, c.MXFP4X_DTYPE_F32, NULL
    if bias is not None:
        if not isinstance(bias, np.ndarray) or bias.ndim != 2:
            raise ValueError("bias: expected a 2-D array (E, 2F) or None")
        job.a.bias_dtype = _act_dtype(bias_dtype, "bias_dtype")
        job.a.bias = <const void *>_address(bias, "bias", (bias.shape[0], 2 * d_ff),
                                            _ITEMSIZE[bias_dtype], bias_dtype)
        _check_ids(ids, n, bias.shape[0], "ids")
        job.a.ids = <const int64_t *>_data(ids)
    job.a.d_ff, job.a.limit, job.a.alpha = d_ff, limit, alpha
    job.isa = kernels_of(isa).isa
    job.n_rows = n
    job.rows_per_task = max(1, ROW_TASK_ELEMS // max(1, d_ff))
    cdef int nt = checked_threads(n_threads)
    if n == 0 or d_ff == 0:
        return
    with nogil:
        parallel_tasks(nt, (n + job.rows_per_task - 1) // job.rows_per_task, _swiglu_task, &job)


def mix_rows(weights, rows, str rows_dtype, ids, out, *, isa=None, int n_threads=1):
    """out[t] = sum over k, in order, of weights[t, k] * rows[ids[t, k]], in float32
    (activation.h's mxfp4x_mix_rows): weights (T, K) float32, rows (R, D) of rows_dtype
    (16-bit floats as their uint16 bits), ids (T, K) int64 in [0, R), out (T, D) float32;
    all C-contiguous."""
    cdef MixJob job
    if not isinstance(weights, np.ndarray) or weights.ndim != 2 or weights.dtype != np.float32:
        raise ValueError("weights: expected a 2-D float32 array (T, K)")
    if not isinstance(rows, np.ndarray) or rows.ndim != 2:
        raise ValueError("rows: expected a 2-D array (R, D)")
    cdef int64_t t = weights.shape[0], k = weights.shape[1], d = rows.shape[1]
    job.a.weights = <const float *>_address(weights, "weights", (t, k), 4, "float32")
    job.a.rows_dtype = _act_dtype(rows_dtype, "rows_dtype")
    job.a.rows = <const void *>_address(rows, "rows", (rows.shape[0], d),
                                        _ITEMSIZE[rows_dtype], rows_dtype)
    _check_ids(ids.reshape(-1) if isinstance(ids, np.ndarray) else ids, t * k, rows.shape[0],
               "ids")
    job.a.ids = <const int64_t *>_data(ids)
    job.a.out = <float *>_address(out, "out", (t, d), 4, "float32")
    if out.dtype != np.float32 or not out.flags.writeable:
        raise ValueError("out: expected a writable float32 array")
    job.a.top_k, job.a.d = k, d
    job.isa = kernels_of(isa).isa
    job.n_rows = t
    job.rows_per_task = max(1, ROW_TASK_ELEMS // max(1, d * max(1, k)))
    cdef int nt = checked_threads(n_threads)
    if t == 0 or d == 0:
        return
    with nogil:
        parallel_tasks(nt, (t + job.rows_per_task - 1) // job.rows_per_task, _mix_task, &job)


def situ_glu(gate, up, str in_dtype, out, str out_dtype, float beta, float beta_lin, *,
             isa=None, int n_threads=1):
    """out = (beta tanh(g / beta)) sigmoid(g) clip(u) for gate and up rows (activation.h's
    mxfp4x_situ_glu; clip(u) = beta_lin tanh(u / beta_lin), or u for beta_lin 0): gate and
    up numpy arrays (A, B, d) of one dtype, shape and strides, each row contiguous (views
    of one tensor's gate and up slots, say), out (A * B, d) C-contiguous; 16-bit floats as
    their uint16 bits, dtypes named."""
    cdef SituJob job
    if not isinstance(gate, np.ndarray) or not isinstance(up, np.ndarray) or gate.ndim != 3 \
            or gate.shape != up.shape or gate.strides != up.strides:
        raise ValueError("gate, up: expected numpy arrays (A, B, d) of one shape and strides")
    job.a.in_dtype = _act_dtype(in_dtype, "in_dtype")
    job.a.out_dtype = _act_dtype(out_dtype, "out_dtype")
    cdef int size = _ITEMSIZE[in_dtype]
    if gate.itemsize != size or up.itemsize != size or gate.strides[2] != size or \
            gate.strides[0] < 0 or gate.strides[1] < 0 or gate.strides[0] % size or \
            gate.strides[1] % size:
        raise ValueError(f"gate, up: expected {in_dtype} rows, each contiguous (strides "
                         f"{gate.strides}, item size {gate.itemsize})")
    cdef int64_t a_n = gate.shape[0], b_n = gate.shape[1], d = gate.shape[2]
    job.a.gate = <const void *><uintptr_t>gate.__array_interface__["data"][0]
    job.a.up = <const void *><uintptr_t>up.__array_interface__["data"][0]
    job.a.out = <void *>_address(out, "out", (a_n * b_n, d), _ITEMSIZE[out_dtype], out_dtype)
    if not out.flags.writeable:
        raise ValueError("out: expected a writable array")
    if beta <= 0 or beta_lin < 0:
        raise ValueError(f"beta, beta_lin: expected beta > 0 and beta_lin >= 0 (0: no clip), "
                         f"got {beta}, {beta_lin}")
    job.a.n_inner, job.a.d = max(1, b_n), d
    job.a.outer, job.a.inner = gate.strides[0] // size, gate.strides[1] // size
    job.a.beta, job.a.beta_lin = beta, beta_lin
    job.isa = kernels_of(isa).isa
    job.n_rows = a_n * b_n
    job.rows_per_task = max(1, ROW_TASK_ELEMS // max(1, d))
    cdef int nt = checked_threads(n_threads)
    if job.n_rows == 0 or d == 0:
        return
    with nogil:
        parallel_tasks(nt, (job.n_rows + job.rows_per_task - 1) // job.rows_per_task,
                       _situ_task, &job)


def rms_norm(x, str in_dtype, weight, str weight_dtype, out, str out_dtype, float eps, *,
             isa=None, int n_threads=1):
    """out = weight * (x / sqrt(mean(x^2) + eps)) row by row, rounded once into out_dtype
    (activation.h's mxfp4x_rms_norm: gpt-oss's RMS norm in float32, the mean of the
    squares summed in double; the same bits on every ISA and thread count): x and out
    (N, D), weight (D,), C-contiguous, 16-bit floats as their uint16 bits, dtypes named."""
    cdef RmsNormJob job
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError(f"x: expected a 2-D array (N, D), got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    cdef int64_t n = x.shape[0], d = x.shape[1]
    job.a.in_dtype = _act_dtype(in_dtype, "in_dtype")
    job.a.weight_dtype = _act_dtype(weight_dtype, "weight_dtype")
    job.a.out_dtype = _act_dtype(out_dtype, "out_dtype")
    job.a.x = <const void *>_address(x, "x", (n, d), _ITEMSIZE[in_dtype], in_dtype)
    job.a.weight = <const void *>_address(weight, "weight", (d,), _ITEMSIZE[weight_dtype],
                                          weight_dtype)
    job.a.out = <void *>_address(out, "out", (n, d), _ITEMSIZE[out_dtype], out_dtype)
    if not out.flags.writeable:
        raise ValueError("out: expected a writable array")
    if not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps}")
    job.a.d, job.a.eps = d, eps
    job.isa = kernels_of(isa).isa
    job.n_rows = n
    job.rows_per_task = max(1, ROW_TASK_ELEMS // max(1, d))
    cdef int nt = checked_threads(n_threads)
    if n == 0 or d == 0:
        return
    with nogil:
        parallel_tasks(nt, (n + job.rows_per_task - 1) // job.rows_per_task, _rms_norm_task,
                       &job)
