# mxfp4x/_core/cpu_call.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# The call description: Experts and Call, the one typed boundary a call crosses (mxfp4x_call
# of include/mxfp4x/mxfp4x.h), built and checked in one place.

# ---- the call description -------------------------------------------------------------

cdef uintptr_t _address(arr, str name, tuple shape, int itemsize, str what) except? 0:
    """The data address of a C-contiguous numpy array of this shape and item size."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array ({what}), got {type(arr).__name__}")
    if arr.shape != shape or arr.itemsize != itemsize or not arr.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous {shape} array of {itemsize}-byte "
                         f"items ({what}), got shape {arr.shape}, dtype {arr.dtype}, "
                         f"c_contiguous={arr.flags.c_contiguous}")
    return _data(arr)


cdef uintptr_t _data(arr) except? 0:
    """A C-contiguous numpy array's data address, through the buffer protocol: numpy's
    ``arr.ctypes.data`` builds a ctypes object, 27 us of a small call when the caches are
    cold (as the kernels leave them), this about 3."""
    cdef Py_buffer view
    PyObject_GetBuffer(arr, &view, PyBUF_SIMPLE)
    cdef uintptr_t p = <uintptr_t>view.buf
    PyBuffer_Release(&view)
    return p


cdef uint64_t *_thread_log(arr, tuple shape) except? NULL:
    """The test hook's log (Call.run, combine): NULL for None, else a writable array."""
    if arr is None:
        return NULL
    cdef uintptr_t p = _address(arr, "thread_log", shape, 8, "uint64 thread tokens")
    if not arr.flags.writeable:
        raise ValueError("thread_log: the array is read-only")
    return <uint64_t *>p


cdef class Experts:
    """E experts' MXFP4 bytes as the kernels read them: one ``mxfp4x_rows`` per expert,
    so the experts may be slices of one stacked tensor or separate tensors.

    ``table`` is (n_experts, 4) int64, one row per expert: the addresses of its packed
    bytes and of its scale bytes, then their row strides in bytes.  ``form`` says how a
    row is arranged, one form for every expert (the latents of a call are prepared for
    it): "split" (gpt-oss safetensors: each row's ``n_groups * 16`` packed bytes and
    ``n_groups`` scale bytes contiguous, in two arrays; byte j of a group holds elements
    2j and 2j+1) or "gguf" (llama.cpp's block_mxfp4: each row ``n_groups`` 17-byte blocks,
    the scale byte first, read in place; the scale address is the row's first byte, the
    packed address one past it, both row strides equal; byte j holds elements j and
    j+16).  ``owner`` keeps the memory alive as long as this object.
    """
    cdef c.mxfp4x_rows *rows
    cdef readonly int64_t n_experts, d_out, n_groups
    cdef readonly object owner
    cdef readonly str form

    def __cinit__(self, const int64_t[:, ::1] table, *, int64_t d_out, int64_t n_groups,
                  owner, str form="split"):
        cdef int64_t e
        cdef bint gguf = form == "gguf"
        if table.shape[1] != 4 or d_out < 0 or n_groups < 0:
            raise ValueError(f"Experts: expected an (n_experts, 4) table and d_out, n_groups "
                             f">= 0, got {(table.shape[0], table.shape[1])}, {d_out}, "
                             f"{n_groups}")
        if form not in ("split", "gguf"):
            raise ValueError(f"Experts: form: expected 'split' or 'gguf', got {form!r}")
        self.n_experts, self.d_out, self.n_groups = table.shape[0], d_out, n_groups
        self.owner = owner
        self.form = form
        self.rows = <c.mxfp4x_rows *>malloc(max(self.n_experts, 1) * sizeof(c.mxfp4x_rows))
        if self.rows == NULL:
            raise MemoryError("mxfp4x: cannot allocate the expert table")
        for e in range(self.n_experts):
            # rows may overlap or repeat (a stride-0 view of one row is a legal tensor): the
            # kernels only read them
            if table[e, 2] < 0 or table[e, 3] < 0:
                raise ValueError(f"Experts: expert {e}: negative row strides {table[e, 2]}, "
                                 f"{table[e, 3]}")
            if d_out and n_groups and (table[e, 0] == 0 or table[e, 1] == 0):
                raise ValueError(f"Experts: expert {e}: null address")
            if gguf and (table[e, 0] != table[e, 1] + 1 or table[e, 2] != table[e, 3]):
                raise ValueError(f"Experts: expert {e}: GGUF blocks hold their scale bytes: "
                                 f"expected the packed address one past the scale address "
                                 f"and equal row strides, got {list(table[e])}")
            if gguf:
                self.rows[e] = c.mxfp4x_rows_gguf(<const uint8_t *><uintptr_t>table[e, 1],
                                                  table[e, 2], n_groups)
            else:
                self.rows[e] = c.mxfp4x_rows_split(<const uint8_t *><uintptr_t>table[e, 0],
                                                   <const uint8_t *><uintptr_t>table[e, 1],
                                                   table[e, 2], table[e, 3], n_groups)

    def __dealloc__(self):
        free(self.rows)


cdef class Call:
    """One call of the CPU driver (see ``mxfp4x_call`` in mxfp4x.h for the semantics).

    Keywords name every mode: ``product`` "forward" or "transposed"; ``compute``
    "float32" or "float64" (accumulation and ``dst``); ``src_dtype`` one of
    float32, float64, bfloat16, float16 (16-bit latents come as 2-byte integer views);
    ``src_rows`` / ``dst_rows`` "token" or "slot".  Arrays are C-contiguous numpy
    arrays: ``selected`` (n_tokens, top_k) int64; ``mix`` (n_tokens, top_k) of
    ``mix_dtype`` (None: ``compute``; or bfloat16 / float16, converted exactly here), or
    None where the d_out side is per slot; ``src`` and ``dst`` 2-D, one row per token or
    per slot.  ``isa`` None runs the default ISA.

    ``dst_dtype`` (None: ``compute``) may be "bfloat16" or "float16" with float32
    compute: every sum is then taken in float32 and rounded once into ``dst``.  ``init``
    (forward, per-token sums only; None: dst's own values, which a 16-bit dst cannot be)
    is the start of each sum, (n_tokens, d_out) of ``init_dtype``; it and a transposed
    product's gradient (``src_dtype``) have a dtype that converts exactly into
    ``compute``.  The driver does these conversions in its own tasks, on the call's
    threads.
    """
    cdef c.mxfp4x_call desc
    cdef readonly Experts experts
    cdef readonly str isa
    cdef object _keep
    cdef void *_mix  # 16-bit mixture weights converted into compute, or NULL

    def __cinit__(self, Experts experts not None, *, str product, str compute, selected, mix,
                  src, str src_dtype, str src_rows, dst, str dst_rows, isa=None,
                  int n_threads=1, str dst_dtype=None, init=None, str init_dtype=None,
                  str mix_dtype=None):
        self._mix = NULL
        self.experts = experts
        self._keep = (selected, mix, src, dst, init)
        self.desc.kernels = kernels_of(isa)
        self.isa = self.desc.kernels.name.decode()
        self.desc.experts.n_experts = experts.n_experts
        self.desc.experts.d_out = experts.d_out
        self.desc.experts.n_groups = experts.n_groups
        self.desc.experts.rows = experts.rows
        self.desc.n_threads = checked_threads(n_threads)
        self.desc.product = _named(_PRODUCTS, product, "product")
        self.desc.compute = _named(_DTYPES, compute, "compute")
        self.desc.src_dtype = _named(_DTYPES, src_dtype, "src_dtype")
        self.desc.src_rows = _named(_ROWS, src_rows, "src_rows")
        self.desc.dst_rows = _named(_ROWS, dst_rows, "dst_rows")
        dst_dtype = compute if dst_dtype is None else dst_dtype
        self.desc.dst_dtype = _named(_DTYPES, dst_dtype, "dst_dtype")
        self.desc.init = NULL
        self.desc.init_dtype = self.desc.compute
        self._check(compute, selected, mix, src, src_dtype, src_rows, dst, dst_rows,
                    dst_dtype, compute if mix_dtype is None else mix_dtype)
        self._check_init(compute, mix, dst_dtype, init, init_dtype)

    def __dealloc__(self):
        free(self._mix)

    cdef _convert_mix(self, str compute, str mix_dtype, uintptr_t src):
        """16-bit mixture weights (bit patterns at src) into compute, exactly: a torch
        conversion before the call cost a small call ~25 us with the caches cold."""
        cdef int64_t p, n = self.desc.n_tokens * self.desc.top_k
        cdef const uint16_t *h = <const uint16_t *>src
        cdef bint bf16 = mix_dtype == "bfloat16", f64 = compute == "float64"
        cdef float v
        self._mix = malloc(max(n, 1) * _ITEMSIZE[compute])
        if self._mix == NULL:
            raise MemoryError("mxfp4x: cannot allocate the mixture weights")
        for p in range(n):
            v = c.mxfp4x_bf16_to_f32(h[p]) if bf16 else c.mxfp4x_f16_to_f32(h[p])
            if f64:
                (<double *>self._mix)[p] = v
            else:
                (<float *>self._mix)[p] = v
        self.desc.mix = <const void *>self._mix

    cdef _check_init(self, str compute, mix, str dst_dtype, init, init_dtype):
        """The start of the forward sums: init's mode, shape and dtype."""
        if init is None:
            if self.desc.product == c.MXFP4X_FORWARD and dst_dtype != compute and \
                    mix is not None:
                raise ValueError(f"init: expected the start of the sums (a {dst_dtype} dst "
                                 f"is rounded from {compute} sums, not read)")
            return
        if self.desc.product != c.MXFP4X_FORWARD or mix is None:
            raise ValueError("init: only a forward product's per-token sums (mix given) "
                             "have a start")
        exact = _DTYPES if compute == "float64" else ("float32", "bfloat16", "float16")
        if init_dtype not in exact:
            raise ValueError(f"init_dtype: expected one of {tuple(exact)} (converting "
                             f"exactly into {compute}), got {init_dtype!r}")
        self.desc.init_dtype = _DTYPES[init_dtype]
        self.desc.init = <const void *>_address(
            init, "init", (self.desc.n_tokens, self.desc.experts.d_out),
            _ITEMSIZE[init_dtype], f"{init_dtype} start of each token's sums")

    cdef _check(self, str compute, selected, mix, src, str src_dtype, str src_rows, dst,
                str dst_rows, str dst_dtype, str mix_dtype):
        """Every array's shape, item size and contiguity, and the rules between modes."""
        cdef int64_t n_tokens, top_k
        cdef bint forward = self.desc.product == c.MXFP4X_FORWARD
        cdef int64_t d_in = self.desc.experts.n_groups * c.MXFP4X_GROUP
        cdef int64_t d_out = self.desc.experts.d_out
        if compute not in ("float32", "float64"):
            raise ValueError(f"compute: expected 'float32' or 'float64', got {compute!r}")
        if dst_dtype != compute and not (compute == "float32" and
                                         dst_dtype in ("bfloat16", "float16")):
            raise ValueError(f"dst_dtype: expected {compute!r}, or 'bfloat16' / 'float16' "
                             f"with float32 compute, got {dst_dtype!r}")
        exact = tuple(_DTYPES) if compute == "float64" else ("float32", "bfloat16", "float16")
        if not forward and src_dtype not in exact:
            raise ValueError(f"src_dtype: the transposed product reads a gradient that "
                             f"converts exactly into {compute!r} (one of {exact}), got "
                             f"{src_dtype!r}")
        if not isinstance(selected, np.ndarray) or selected.ndim != 2:
            raise ValueError("selected: expected a 2-D int64 numpy array (n_tokens, top_k)")
        n_tokens, top_k = selected.shape
        self.desc.n_tokens, self.desc.top_k = n_tokens, top_k
        self.desc.selected = <const int64_t *>_address(
            selected, "selected", (n_tokens, top_k), 8, "int64 expert ids")
        if selected.dtype != np.int64:
            raise ValueError(f"selected: expected int64, got {selected.dtype}")
        # the d_out side: dst of the forward product, src of the transposed one
        y_rows = dst_rows if forward else src_rows
        if (mix is None) != (y_rows == "slot"):
            raise ValueError(f"mix: {'not ' if y_rows == 'slot' else ''}expected where the "
                             f"d_out side is per {y_rows} (per-token sums are weighted)")
        if mix_dtype not in (compute, "bfloat16", "float16"):
            raise ValueError(f"mix_dtype: expected {compute!r}, 'bfloat16' or 'float16', got "
                             f"{mix_dtype!r}")
        self.desc.mix = NULL if mix is None else <const void *>_address(
            mix, "mix", (n_tokens, top_k), _ITEMSIZE[mix_dtype], f"{mix_dtype} mixture weights")
        if mix is not None and mix_dtype != compute:
            self._convert_mix(compute, mix_dtype, <uintptr_t>self.desc.mix)
        rows = {"token": n_tokens, "slot": n_tokens * top_k}
        self.desc.src = <const void *>_address(
            src, "src", (rows[src_rows], d_in if forward else d_out), _ITEMSIZE[src_dtype],
            f"{src_dtype} {'latents' if forward else 'gradient'} per {src_rows}")
        self.desc.dst = <void *>_address(
            dst, "dst", (rows[dst_rows], d_out if forward else d_in), _ITEMSIZE[dst_dtype],
            f"{dst_dtype} {'outputs' if forward else 'latent gradient'} per {dst_rows}")
        if not dst.flags.writeable:
            raise ValueError("dst: the array is read-only")

    @property
    def n_threads(self):
        return self.desc.n_threads

    def run(self, thread_log=None):
        """Run the call (GIL released); ``dst`` receives the result.

        ``thread_log`` (a test hook; mxfp4x._core.probes.step_threads reads it): None, or a
        zeroed (3, MAX_THREADS) uint64 array in which each step of the call (0: the
        latents into the kernel layout, 1: the product's tasks, 2: the result out of it)
        records, at [step, tid], the OS thread that ran one of its tasks as thread tid."""
        cdef double d0 = 0
        cdef float f0 = 0
        cdef uint64_t *log = _thread_log(thread_log, (N_STEPS, c.MXFP4X_MAX_THREADS))
        if self.desc.compute == c.MXFP4X_DTYPE_F64:
            _drive(d0, &self.desc, log)
        else:
            _drive(f0, &self.desc, log)


cdef int _named(dict names, str value, str arg) except -1:
    if value not in names:
        raise ValueError(f"{arg}: expected one of {tuple(names)}, got {value!r}")
    return names[value]


cdef int checked_threads(int n_threads) except -1:
    """n_threads itself, if mxfp4x._core.threads.resolve could have returned it (the policy is
    decided there; this boundary only refuses what threads.h could not hold)."""
    if n_threads < 1 or n_threads > c.MXFP4X_MAX_THREADS:
        raise ValueError(f"n_threads: expected 1 to {c.MXFP4X_MAX_THREADS} (resolve a "
                         f"request with mxfp4x._core.threads.resolve), got {n_threads}")
    return n_threads
