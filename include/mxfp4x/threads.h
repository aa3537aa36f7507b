/* mxfp4x/threads.h -- the driver's worker threads, by build:
 *
 *   openmp    Linux: Cython's prange over gcc's libgomp, the runtime torch's wheels load
 *             (same soname: one OpenMP runtime in the process).
 *   pthreads  macOS (and any build made with MXFP4X_THREADS=pthreads, which is how CI
 *             tests this path on Linux): torch's macOS wheels bring their own libomp, and
 *             a second OpenMP runtime beside it is a known crash, so the driver's tasks
 *             run on plain POSIX threads started per call.  No runtime, no dependency.
 *   serial    Windows, and MXFP4X_THREADS=serial / MXFP4X_DISABLE_OPENMP=1.
 *
 * Every parallel step of the extensions goes through one function,
 * mxfp4x._core.cpu.parallel_tasks (prange where MXFP4X_OPENMP, mxfp4x_run_tasks otherwise),
 * and the Python side asks mxfp4x._core.threads how many threads to pass it.
 *
 * mxfp4x_run_tasks(n, n_tasks, fn, ctx) calls fn(ctx, task, tid) once for every task in
 * [0, n_tasks), on up to n threads (the caller is thread 0; tid < n indexes per-thread
 * scratch), tasks handed out one at a time from a shared counter (the dynamic schedule
 * of the OpenMP path), each thread with flush-to-zero off (config.h).  Which thread runs
 * a task never changes a result: a task owns its outputs (the driver's invariant).
 *
 * MXFP4X_MAX_THREADS bounds the workers' arrays; it is the one cap of the thread count
 * (mxfp4x._core.threads reads it through the extension). */
#ifndef MXFP4X_THREADS_H
#define MXFP4X_THREADS_H

#include "mxfp4x.h"

typedef void (*mxfp4x_task_fn)(void *ctx, int64_t task, int tid);

#if defined(_OPENMP)
#include <omp.h>
#define MXFP4X_THREADS_NAME "openmp"
#define MXFP4X_OPENMP 1
#elif defined(MXFP4X_PTHREADS) && MXFP4X_GNUC && !defined(_WIN32)
#define MXFP4X_THREADS_NAME "pthreads"
#define MXFP4X_HAVE_PTHREADS 1
#else
#define MXFP4X_THREADS_NAME "serial"
#endif
#ifndef MXFP4X_HAVE_PTHREADS
#define MXFP4X_HAVE_PTHREADS 0
#endif
#ifndef MXFP4X_OPENMP
#define MXFP4X_OPENMP 0
#endif

#define MXFP4X_MAX_THREADS 256

#if MXFP4X_HAVE_PTHREADS
#include <pthread.h>

typedef struct {
    mxfp4x_task_fn fn;
    void *ctx;
    int64_t n_tasks;
    int64_t next; /* the next task to hand out (atomic) */
} mxfp4x_job;

typedef struct {
    mxfp4x_job *job;
    int tid;
} mxfp4x_worker;

static void mxfp4x_work(mxfp4x_job *job, int tid) {
    const mxfp4x_fpenv env = mxfp4x_fpenv_enter();
    int64_t t;
    while ((t = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED)) < job->n_tasks)
        job->fn(job->ctx, t, tid);
    mxfp4x_fpenv_exit(env);
}

static void *mxfp4x_worker_main(void *arg) {
    const mxfp4x_worker *w = (const mxfp4x_worker *)arg;
    mxfp4x_work(w->job, w->tid);
    return NULL;
}

/* Returns the number of threads that ran (fewer than asked if the OS refused one). */
static int mxfp4x_run_tasks(int n_threads, int64_t n_tasks, mxfp4x_task_fn fn, void *ctx) {
    pthread_t threads[MXFP4X_MAX_THREADS];
    mxfp4x_worker workers[MXFP4X_MAX_THREADS];
    pthread_attr_t attr;
    mxfp4x_job job;
    int i, started = 1;
    if (n_threads > MXFP4X_MAX_THREADS) n_threads = MXFP4X_MAX_THREADS;
    if (n_threads > n_tasks) n_threads = (int)n_tasks;
    job.fn = fn;
    job.ctx = ctx;
    job.n_tasks = n_tasks;
    job.next = 0;
    /* macOS gives secondary threads 512 KiB of stack: ask for what Linux gives */
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, (size_t)8 << 20);
    for (i = 1; i < n_threads; i++) {
        workers[i].job = &job;
        workers[i].tid = i;
        if (pthread_create(&threads[i], &attr, mxfp4x_worker_main, &workers[i]) != 0) break;
        started++;
    }
    pthread_attr_destroy(&attr);
    mxfp4x_work(&job, 0);
    for (i = 1; i < started; i++) pthread_join(threads[i], NULL);
    return started;
}
#else
/* Without pthreads: every task on the calling thread (the serial build). */
static int mxfp4x_run_tasks(int n_threads, int64_t n_tasks, mxfp4x_task_fn fn, void *ctx) {
    const mxfp4x_fpenv env = mxfp4x_fpenv_enter();
    int64_t t;
    (void)n_threads;
    for (t = 0; t < n_tasks; t++) fn(ctx, t, 0);
    mxfp4x_fpenv_exit(env);
    return 1;
}
#endif

static const char *mxfp4x_threads_name(void) { return MXFP4X_THREADS_NAME; }

/* An identity of the calling OS thread (tests count the threads a call really used). */
#if defined(_WIN32)
static uint64_t mxfp4x_thread_token(void) { return 0; } /* serial there */
#else
#include <pthread.h>
static uint64_t mxfp4x_thread_token(void) { return (uint64_t)(uintptr_t)pthread_self(); }
#endif

#endif /* MXFP4X_THREADS_H */
