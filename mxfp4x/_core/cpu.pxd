# cython: language_level=3
"""What the driver (mxfp4x/_core/cpu.pyx) lends the probes (mxfp4x/_core/probes.pyx): its one
parallel mechanism, its choice of a kernel table entry, its allocator and its check of
a thread count.  The probes measure and test the driver's own code through these, never
a copy of it."""
from libc.stdint cimport int64_t

cimport mxfp4x._core.capi as c


cdef void parallel_tasks(int n_threads, int64_t n_tasks, c.mxfp4x_task_fn fn,
                         void *ctx, int team=*) noexcept nogil
cdef const c.mxfp4x_kernels *kernels_of(isa) except NULL
cdef void *xmalloc(int64_t n_bytes, bint zero=*) except NULL
cdef int checked_threads(int n_threads) except -1

# The parallel steps of a call, as Call.run's thread_log (a test hook) numbers them
cdef enum:
    STEP_PREPARE = 0    # the latents into the kernel layout (forward)
    STEP_TASKS = 1      # the product's tasks
    STEP_FINISH = 2     # dx out of the kernel layout (transposed)
    N_STEPS = 3
