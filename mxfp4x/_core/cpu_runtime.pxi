# mxfp4x/_core/cpu_runtime.pxi -- part of mxfp4x/_core/cpu.pyx, which includes it (one module).
# The driver's runtime: the ISAs this build holds and their choice, the one parallel
# mechanism (parallel_tasks) and the fork rule, the FP environment, the build's facts.

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
    (include/mxfp4x/threads.h).  Asked through mxfp4x._core.threads."""
    return c.mxfp4x_threads_name().decode()


# GNU OpenMP cannot start a team again in a child forked after a team ran, ours or
# torch's (one runtime serves both): the child's first parallel step waits forever for
# threads that stayed in the parent.  So a process forked after one of our teams ran, or
# from a parent with more threads than it had when this module was imported (libgomp's
# pool stays alive between teams; importing torch starts one thread of its own), takes
# every step in the calling thread (the same bits; threads.resolve warns once).
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
