# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""The CPU backend's boundary, its parallel driver, and the driver's one parallel
mechanism (``parallel_tasks``, shared with mxfp4x/_probes.pyx through _cpu.pxd).

The boundary: a call is described by one C struct (``mxfp4x_call`` in
include/mxfp4x/mxfp4x.h, mirrored in _capi.pxd) held by a :class:`Call`.  Python
builds a Call from numpy views of its tensors in one place
(``mxfp4x._cpu_impl``); the Call checks it in one place (``_check``).  Modes are
named keywords; nothing that a mode does not use is passed.

The driver (``Call.run``): one skeleton for both products.  Route the token-expert
pairs by expert (a stable counting sort, which also checks every expert id), then
split the work into tasks that each own disjoint output elements: row tiles of the
output for the forward product, column tiles of the latents for the transposed
one.  ``parallel_tasks`` hands whole tasks to threads; each output element is
accumulated by one thread in a fixed order (ascending expert id, then the pair order),
so results are bit-identical for any thread count and for any batch a token sits in.
No locks, no atomics.  The steps around it (the latents into the kernel layout, the
transposed result out of it, :func:`combine`) are tasks of whole rows through the same
mechanism.

How many threads a call gets is decided in mxfp4x/_threads.py; the roofline probes and
the test hooks live in mxfp4x/_probes.pyx, outside this module.
"""
import os

import numpy as np

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memset

cimport mxfp4x._capi as c

ctypedef fused real:
    float
    double

GROUP = c.MXFP4X_GROUP
GROUP_BYTES = c.MXFP4X_GROUP_BYTES
GGUF_BLOCK_BYTES = c.MXFP4X_GGUF_BLOCK_BYTES

# Rows of W per forward task and the bytes of decoded rows a thread holds at once come
# from the ISA's kernel table (tile_rows, panel_bytes: each ISA's header says why); the
# float64 path uses the scalar entry's.  Groups (of input columns) per transposed task
# and rows per transposed panel:
cdef enum:
    T_TILE_GROUPS = 8
    T_PANEL_ROWS = 32
# A forward task takes an expert's pairs in blocks of at most PAIR_BLOCK, so a thread's
# dot-product scratch is bounded (PAIR_BLOCK x its task's rows) however many pairs one expert
# gets: 100000 tokens all routed to one expert need the same scratch as 512.  A token's
# dots do not depend on the pairs beside it (the gemv and panel paths give the same bits),
# and the blocks are combined in the pair order, so the bits do not change.
cdef enum:
    PAIR_BLOCK = 512
# Forward tiles grow (up to WIDE_TILES x the ISA's tile rows) when some expert takes the
# panel path, while every thread keeps >= TASKS_PER_THREAD tasks to balance: an expert's
# latents (64 tokens of gpt-oss-20b: 737 KB) are then read from L3 once per wide tile
# instead of once per tile.  A tile's size changes no bit: each dot is the kernels', each
# element combined in the pairs' order.
# bfloat16 latents on a bf16 unit (48-row tiles, tokens 2 bytes wide) go up to 16x: an
# expert's 64 gpt-oss-20b tokens (368 KB) are otherwise read from L3 for every 69 KB of
# weights; float32 latents gain nothing from more than 4x.
# A bf16 unit's calls widen from WIDE_BF16_FROM tokens per expert on, fused gemv or not:
# there every pair has its own gathered latents, and an expert with more than one
# block of tokens (4, or a last 5) would read them from L3 again for every 48-row tile
# (float32 latents, whose token rows the experts share, gain nothing there).
# With wide tiles and more than one thread, the last TAIL_TASKS tasks per thread are of the
# ISA's own tile rows: tasks are handed out in order, and a thread that took the last wide
# tile would keep the others waiting in libgomp's spin.
# The measurements behind each: docs/performance.md, "Tiles, tasks and panels".
cdef enum:
    WIDE_TILES = 4
    WIDE_TILES_BF16 = 16
    WIDE_BF16_FROM = 5
    TASKS_PER_THREAD = 8
    TAIL_TASKS = 2

# The layout copies of a call and :func:`combine` run in tasks of whole rows of at least
# ROW_TASK_ELEMS elements: a pthreads build starts its threads per parallel step, and
# below about this much work per task (a few tens of microseconds) a started thread
# costs more than it saves.  A row is converted or combined alone, so the split never
# changes a bit.  The bf16 unit's gather (one task per active expert) runs in the calling
# thread below 2 x ROW_TASK_ELEMS latents (on pthreads builds: one thread per
# ROW_TASK_ELEMS), else on the call's team.
cdef enum:
    ROW_TASK_ELEMS = 1 << 16

# A forward task hints its slices of the shared output and the result into L2 before its
# first dot products when they are this small (a few tokens; more tokens amortise the
# misses over more work, and would crowd the panel out of L2).
cdef enum:
    PREFETCH_SLICE_BYTES = 64 << 10

# The most threads this boundary takes (threads.h's MXFP4X_MAX_THREADS).  mxfp4x._threads reads it
# from here and owns the policy: how a request becomes a count in [1, MAX_THREADS].
MAX_THREADS = c.MXFP4X_MAX_THREADS

# names <-> C enums: the modes of a call are named, never inferred
_DTYPES = {"float32": c.MXFP4X_DTYPE_F32, "float64": c.MXFP4X_DTYPE_F64,
           "bfloat16": c.MXFP4X_DTYPE_BF16, "float16": c.MXFP4X_DTYPE_F16}
_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
_PRODUCTS = {"forward": c.MXFP4X_FORWARD, "transposed": c.MXFP4X_TRANSPOSED}
_ROWS = {"token": c.MXFP4X_ROWS_PER_TOKEN, "slot": c.MXFP4X_ROWS_PER_SLOT}
DTYPES = tuple(_DTYPES)


# ---- ISAs ---------------------------------------------------------------------------

def compiled_isas():
    """ISA names compiled into this build, in order of preference (dispatch.h: the entries
    with bf16 units first, each the default only where cpu.h's rule allows)."""
    return [c.mxfp4x_kernel_at(i).name.decode() for i in range(c.mxfp4x_n_kernels())]


def runnable_isas():
    """ISA names this build can run on this CPU, in the order of compiled_isas()."""
    return [c.mxfp4x_kernel_at(i).name.decode() for i in range(c.mxfp4x_n_kernels())
            if c.mxfp4x_kernel_runnable(i)]


def threads_backend():
    """How the driver's tasks run in parallel, as built: "openmp", "pthreads" or "serial"
    (include/mxfp4x/threads.h).  Asked through mxfp4x._threads."""
    return c.mxfp4x_threads_name().decode()


# GNU OpenMP cannot start a team again in a child forked after a team ran, ours or
# torch's (one runtime serves both): the child's first parallel step waits forever for
# threads that stayed in the parent.  So a process forked after one of our teams ran, or
# from a parent with more threads than it had when this module was imported (libgomp's
# pool stays alive between teams; importing torch starts one thread of its own), takes
# every step in the calling thread (the same bits; _threads.resolve warns once).
cdef int _teams_ran = 0
cdef int _forked_after_teams = 0


def _thread_count():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not known: as if threads were started
        return 1 << 30


_threads_at_import = _thread_count()
_threads_at_fork = _threads_at_import


def _before_fork():
    global _threads_at_fork
    _threads_at_fork = _thread_count()


def _after_fork_in_child():
    global _forked_after_teams
    if _teams_ran or _threads_at_fork > _threads_at_import:
        _forked_after_teams = 1


def forked_after_teams():
    """Whether this process was forked after OpenMP threads may have run (a team of ours,
    or threads started in the parent since this module was imported): every parallel step
    then runs in the calling thread."""
    return bool(_forked_after_teams)


if c.MXFP4X_OPENMP and hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


cdef void parallel_tasks(int n_threads, int64_t n_tasks, c.mxfp4x_task_fn fn,
                         void *ctx, int team=0) noexcept nogil:
    """fn(ctx, task, tid) once for every task in [0, n_tasks), handed out one at a time to
    the threads of the build's kind: OpenMP's prange over the team below, or up to
    n_threads of threads.h's workers (builds without OpenMP); each thread with
    flush-to-zero off (config.h).  Every parallel step of mxfp4x runs here.
    ``team`` (0: n_threads as asked, before it is limited to n_tasks): an OpenMP build's
    team for the step, the call's thread count for every step of a call, so that no step
    shrinks the team: libgomp ends the pool's threads a smaller team leaves out and
    starts them again for the next larger one, which slows one-token calls on many cores
    (docs/performance.md, "Threads and the facade").  Any thread of the team may take a task,
    so tid < max(team, n_threads) indexes per-thread scratch; at most n_tasks threads
    take one.  A step that one thread would run (n_threads or n_tasks 1) runs in the
    calling thread, with no team; so does every step in a process forked after a team
    ran (above)."""
    global _teams_ran
    cdef int64_t task
    cdef int tid = 0
    cdef c.mxfp4x_fpenv fpenv = 0  # (both set in each thread: zero for the compiler's sake)
    if n_tasks <= 0:
        return
    if team <= 0:
        team = n_threads
    n_threads = <int>max(1, min(<int64_t>n_threads, n_tasks))  # more would only idle
    if n_threads == 1 or _forked_after_teams:  # in the calling thread: no team
        fpenv = c.mxfp4x_fpenv_enter()
        for task in range(n_tasks):
            fn(ctx, task, 0)
        c.mxfp4x_fpenv_exit(fpenv)
    elif c.MXFP4X_OPENMP:
        _teams_ran = 1
        with parallel(num_threads=max(team, n_threads)):
            tid = threadid()
            fpenv = c.mxfp4x_fpenv_enter()
            for task in prange(n_tasks, schedule='dynamic'):
                fn(ctx, task, tid)
            c.mxfp4x_fpenv_exit(fpenv)
    else:
        c.mxfp4x_run_tasks(n_threads, n_tasks, fn, ctx)


cdef inline void _log_thread(uint64_t *log, int tid) noexcept nogil:
    """Test hook (see Call.run): the OS thread that ran a task of a step as thread tid."""
    if log != NULL:
        log[tid] = c.mxfp4x_thread_token()


def fpenv_enter():
    """Clear flush-to-zero, denormals-are-zero and the rounding mode of the calling thread
    (MXCSR on x86-64, FPCR on AArch64), as the kernels do around their work; returns the
    previous state for ``fpenv_exit``.  The PyTorch path runs its CPU arithmetic between
    the two, so a caller's ``torch.set_flush_denormal(True)`` or rounding mode changes
    none of its bits there either."""
    return c.mxfp4x_fpenv_enter()


def fpenv_exit(saved):
    """Restore the calling thread's state saved by ``fpenv_enter``."""
    c.mxfp4x_fpenv_exit(<c.mxfp4x_fpenv>saved)


def cpu_features():
    """Optional CPU features no kernel uses yet, for future variants (cpu.h): on
    AArch64 "asimddp", "bf16", "i8mm", "sve" as the OS reports them; [] elsewhere."""
    mask = c.mxfp4x_cpu_features()
    return [c.mxfp4x_feature_name(i).decode() for i in range(c.MXFP4X_N_FEATURES)
            if (mask >> i) & 1]


cdef int _find(str name) except -2:
    for i in range(c.mxfp4x_n_kernels()):
        if c.mxfp4x_kernel_at(i).name.decode() == name:
            return i
    return -1


def _resolve(name, str source):
    """Index of a runnable ISA by name; ValueError naming the choices otherwise."""
    i = _find(name) if isinstance(name, str) else -1
    if i < 0:
        raise ValueError(f"{source}={name!r} is not an ISA of mxfp4x; choose one of "
                         f"{runnable_isas()} (compiled: {compiled_isas()})")
    if not c.mxfp4x_kernel_runnable(i):
        raise ValueError(f"{source}={name!r}: this CPU (or OS) cannot run {name}; choose one "
                         f"of {runnable_isas()}")
    return i


def _default_kernel():
    forced = os.environ.get("MXFP4X_ISA", "").strip().lower()
    if forced:
        return _resolve(forced, "MXFP4X_ISA")
    return c.mxfp4x_kernel_default()


# The process default, fixed at import (MXFP4X_ISA, or the first runnable ISA that cpu.h's
# rule on CPUID facts allows by default: never amx, avx512bf16 on AMD only); a
# call chooses its own ISA through its description, never by changing this.
cdef int _default = _default_kernel()


def default_isa():
    """The ISA a call runs when it names none."""
    return c.mxfp4x_kernel_at(_default).name.decode()


cdef const c.mxfp4x_kernels *kernels_of(isa) except NULL:
    """The kernel table entry of a call (or probe) naming ``isa``, None for the default."""
    return c.mxfp4x_kernel_at(_default if isa is None else _resolve(isa, "isa"))


def gemv_max_tokens(isa=None, bint bf16=False):
    """The most tokens per expert that the float32 gemv path takes on ``isa`` (None: the
    default); an expert with more takes the panel path (tests of the switch point).  With
    ``bf16``: the same switch of bf16 latents on the ISA's bf16 unit, where it has one."""
    cdef const c.mxfp4x_kernels *k = kernels_of(isa)
    if bf16 and k.bf16_rows != NULL:
        return k.bf16_gemv_max_tokens()
    return c.mxfp4x_gemv_switch(k)


def float32_isa(isa=None):
    """The ISA whose kernels a float32 call on ``isa`` (None: the default; any compiled
    name) runs: ``isa`` itself, or for an entry that only adds a bf16 unit (amx,
    avx512bf16), the entry whose float32 kernels it shares (avx512)."""
    cdef int j = _default if isa is None else (_find(isa) if isinstance(isa, str) else -1)
    cdef const c.mxfp4x_kernels *k
    cdef const c.mxfp4x_kernels *o
    if j < 0:  # a compiled entry's name (this CPU need not run it: the gate's --against)
        raise ValueError(f"isa={isa!r} is not an ISA of mxfp4x; choose one of "
                         f"{compiled_isas()}")
    k = c.mxfp4x_kernel_at(j)
    for i in range(c.mxfp4x_n_kernels()):
        o = c.mxfp4x_kernel_at(i)
        if o.bf16_rows == NULL and o.gemv_f32 == k.gemv_f32:
            return o.name.decode()
    return k.name.decode()


def has_bf16_unit(isa=None):
    """Whether a float32 call with bf16 latents on ``isa`` (None: the default) runs them
    on a bf16 dot-product unit, which gathers every pair's latents (amx.h)."""
    return kernels_of(isa).bf16_rows != NULL


def build_info():
    """How this extension was compiled: the flags and what the compiler's own
    predefined macros say about fast-math and global ISA flags.  ``emulated`` names the
    ISA a test build emulates (exact, slow, never to be benchmarked): "avx512", its
    kernels through SIMDe (MXFP4X_EMULATE_AVX512=1), or "amx", its tile instructions in
    C (MXFP4X_EMULATE_AMX=1); else None."""
    return {"cflags": (<bytes>c.MXFP4X_BUILD_CFLAGS).decode(),
            "fast_math": bool(c.MXFP4X_BUILT_FAST_MATH),
            "global_isa_flags": bool(c.MXFP4X_BUILT_GLOBAL_ISA),
            "emulated": "avx512" if c.MXFP4X_EMULATED_AVX512 else
                        "amx" if c.MXFP4X_EMULATED_AMX else None}


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

        ``thread_log`` (a test hook; mxfp4x._probes.step_threads reads it): None, or a
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
    """n_threads itself, if mxfp4x._threads.resolve could have returned it (the policy is
    decided there; this boundary only refuses what threads.h could not hold)."""
    if n_threads < 1 or n_threads > c.MXFP4X_MAX_THREADS:
        raise ValueError(f"n_threads: expected 1 to {c.MXFP4X_MAX_THREADS} (resolve a "
                         f"request with mxfp4x._threads.resolve), got {n_threads}")
    return n_threads


# ---- the driver ---------------------------------------------------------------------------

cdef struct Routing:
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
    Routing r
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
    const Routing *r
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


cdef int64_t _route(real dummy, const c.mxfp4x_call *call, Routing *r,
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
    cdef int64_t tile, panel_bytes, wide_from, tail
    cdef const c.mxfp4x_kernels *k = call.kernels
    w.lanes_len = 0
    w.dots_len = 0
    w.sums_len = 0
    if call.product == c.MXFP4X_FORWARD:
        tile = c.MXFP4X_SCALAR_TILE_ROWS if real is double else k.tile_rows
        w.base_size = tile
        w.gemv_switch = c.mxfp4x_gemv_switch(k)
        # the most tokens of an expert in the call decides (a tile's width changes no bit)
        wide_from = WIDE_BF16_FROM if w.bf16 else k.gemv_max_tokens + 1
        if real is float and w.r.max_count >= wide_from:
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
            bad = _route(dummy, call, &w.r, fill)
        if bad >= 0:
            from mxfp4x._validation import expert_id_error
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
