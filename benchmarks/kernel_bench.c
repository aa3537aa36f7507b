/* benchmarks/kernel_bench.c -- one kernel of one ISA timed alone, one thread: the
 * measurements behind the per-ISA tuning constants and the README's "what limits it".
 *
 *   gcc -O3 -std=c11 -ffp-contract=off -Iinclude benchmarks/kernel_bench.c -o kernel_bench
 *   ./kernel_bench panel ISA ROWS TOKENS GROUPS      decoded panel x tokens (panel_dot)
 *   ./kernel_bench gemv  ISA ROWS TOKENS GROUPS [E]  fused decode + dot over E experts'
 *                                                    rows, in 48-row tiles expert after
 *                                                    expert as the driver walks them
 *                                                    (E > 1: weights stream from DRAM)
 *   ./kernel_bench gemv_gguf ISA ROWS TOKENS GROUPS [E]  the same on GGUF block_mxfp4
 *                                                    blocks (17 bytes per group, in place)
 *   ./kernel_bench dense ISA ROWS TOKENS COLS [M]     the dense bf16 product (dense_bf16)
 *                                                    of M matrices of ROWS x COLS bf16
 *                                                    weights, in the driver's 64-row tasks
 *                                                    (KB_XBF16=1: bf16 tokens, dense_bf16x;
 *                                                    KB_UNIT=1: bf16 tokens on the bf16
 *                                                    unit, dense_bf16_unit;
 *                                                    KB_OFFSET=N: the weights N bytes into
 *                                                    a cache line, as a checkpoint maps them)
 *   ./kernel_bench gemv_bf16 ISA ROWS TOKENS GROUPS [E]  bf16 latents on the ISA's bf16
 *                                                    unit (bf16_rows: amx, avx512bf16), in
 *                                                    tasks of its own tile_rows
 *                                                    (KB_TILE=N: of N rows, as the
 *                                                    driver's wide tiles)
 *
 * gemv passes each call the next call's first rows as the driver does (mxfp4x_rows's
 * prefetch hint); KB_NO_HINT=1 in the environment leaves it out.  KB_HUGE=1 asks for
 * transparent huge pages under the weights (as numpy does for its arrays; torch does not;
 * what they give per CPU: docs/performance.md).
 *
 * Prints the best of several runs: time, GFLOP/s and, for gemv, ns and GB/s per
 * row-group (16 packed bytes + 1 scale byte). */
#define _DEFAULT_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

#include "mxfp4x/dispatch.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 64-byte aligned, as the driver's scratch: unaligned 64-byte loads span two lines. */
static void *xmalloc(size_t n) {
    void *p = aligned_alloc(64, (n + 63) / 64 * 64 + 64);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    const mxfp4x_kernels *k = NULL;
    int64_t rows, tokens, groups, experts, d_in, i, t, e, r0;
    float *x, *out;
    int64_t *x_rows;
    double best = 1e30;
    int rep, reps, ki;
    if (argc < 6 ||
        (strcmp(argv[1], "panel") && strcmp(argv[1], "gemv") && strcmp(argv[1], "gemv_gguf") &&
         strcmp(argv[1], "gemv_bf16") && strcmp(argv[1], "dense"))) {
        fprintf(stderr,
                "usage: %s panel|gemv|gemv_gguf|gemv_bf16 ISA ROWS TOKENS GROUPS [EXPERTS]\n"
                "       %s dense ISA ROWS TOKENS COLS [MATRICES]\n",
                argv[0], argv[0]);
        return 2;
    }
    for (ki = 0; ki < mxfp4x_n_kernels(); ki++)
        if (!strcmp(mxfp4x_kernel_at(ki)->name, argv[2]) && mxfp4x_kernel_runnable(ki))
            k = mxfp4x_kernel_at(ki);
    if (!k) {
        fprintf(stderr, "ISA %s is not compiled in or not runnable here\n", argv[2]);
        return 2;
    }
    rows = atoll(argv[3]);
    tokens = atoll(argv[4]);
    groups = atoll(argv[5]);
    experts = argc > 6 ? atoll(argv[6]) : 1;
    if (!strcmp(argv[1], "dense")) { /* GROUPS is COLS here, EXPERTS the matrices */
        const int64_t cols = groups, n_mat = experts,
                      off = getenv("KB_OFFSET") ? atoll(getenv("KB_OFFSET")) & 63 : 0;
        const int unit = getenv("KB_UNIT") && !strcmp(getenv("KB_UNIT"), "1") &&
                         k->dense_bf16_unit;
        const int xbf16 = unit || (getenv("KB_XBF16") && !strcmp(getenv("KB_XBF16"), "1") &&
                                   k->dense_bf16x);
        const size_t mat_bytes = (size_t)(rows * cols) * 2;
        uint8_t *wbuf = (uint8_t *)xmalloc((size_t)n_mat * mat_bytes + 64);
#ifdef MADV_HUGEPAGE
        if (getenv("KB_HUGE")) /* transparent huge pages, as numpy asks for */
            if (madvise((void *)((uintptr_t)wbuf & ~(uintptr_t)4095), (size_t)n_mat * mat_bytes,
                        MADV_HUGEPAGE))
                perror("madvise");
#endif
        uint16_t *xb = (uint16_t *)xmalloc((size_t)(tokens * cols) * 2);
        float *xf = (float *)xmalloc((size_t)(tokens * cols) * sizeof(float));
        float *o = (float *)xmalloc((size_t)(tokens * rows) * sizeof(float));
        for (i = 0; i < (int64_t)(n_mat * mat_bytes / 2); i++) { /* bf16 values near 1 */
            const uint16_t v = (uint16_t)(0x3f00 + (i * 37) % 255);
            memcpy(wbuf + off + 2 * i, &v, 2);
        }
        for (i = 0; i < tokens * cols; i++) {
            uint32_t u;
            xb[i] = (uint16_t)(0x3e00 + (i * 13) % 511);
            u = (uint32_t)xb[i] << 16;
            memcpy(&xf[i], &u, 4);
        }
        for (rep = 0; rep < 9; rep++) {
            const double t0 = now();
            for (e = 0; e < n_mat; e++) {
                const uint16_t *w = (const uint16_t *)(wbuf + off + (size_t)e * mat_bytes);
                for (r0 = 0; r0 < rows; r0 += 64) {
                    const int64_t r1 = r0 + 64 < rows ? r0 + 64 : rows;
                    if (unit)
                        k->dense_bf16_unit(w, cols, r0, r1, cols, xb, cols, tokens, o + r0,
                                           rows);
                    else if (xbf16)
                        k->dense_bf16x(w, cols, r0, r1, cols, xb, cols, tokens, o + r0, rows);
                    else
                        k->dense_bf16(w, cols, r0, r1, cols, xf, cols, tokens, o + r0, rows);
                }
            }
            if (now() - t0 < best) best = now() - t0;
        }
        printf("%s dense rows=%lld tokens=%lld cols=%lld matrices=%lld x=%s%s offset=%lld: "
               "%.3f ms, %.1f GB/s of weights\n", k->name, (long long)rows, (long long)tokens,
               (long long)cols, (long long)n_mat, xbf16 ? "bf16" : "float32",
               unit ? " unit" : "", (long long)off,
               best * 1e3, (double)(n_mat * mat_bytes) / best / 1e9);
        return 0;
    }
    d_in = groups * MXFP4X_GROUP;
    x = (float *)xmalloc((size_t)(tokens * d_in) * sizeof(float));
    /* rows of a task (48, or the bf16 unit's tile_rows) even when fewer are asked for */
    out = (float *)xmalloc((size_t)(tokens * (rows > k->tile_rows ? rows : k->tile_rows) +
                                    tokens * 64) * sizeof(float));
    x_rows = (int64_t *)xmalloc((size_t)tokens * sizeof(int64_t));
    for (i = 0; i < tokens * d_in; i++) x[i] = (float)((i * 104729) % 997) / 997.0f - 0.5f;
    for (t = 0; t < tokens; t++) x_rows[t] = (t * 37) % tokens; /* scattered, as routed */
    if (!strcmp(argv[1], "panel")) {
        float *panel = (float *)xmalloc((size_t)(rows * d_in) * sizeof(float));
        float *scratch =
            (float *)xmalloc((size_t)(k->panel_scratch_floats(rows) + 16) * sizeof(float));
        for (i = 0; i < rows * d_in; i++) panel[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
        for (rep = 0; rep < 30; rep++) {
            const double t0 = now();
            k->panel_dot_f32(panel, rows, groups, x, d_in, x_rows, tokens, out, rows, scratch);
            if (now() - t0 < best) best = now() - t0;
        }
        printf("%s panel_dot rows=%lld tokens=%lld I=%lld: %.1f us, %.1f GFLOP/s\n", k->name,
               (long long)rows, (long long)tokens, (long long)d_in, best * 1e6,
               2.0 * (double)(rows * tokens * d_in) / best / 1e9);
    } else {
        const int gguf = !strcmp(argv[1], "gemv_gguf");
        const int bf16 = !strcmp(argv[1], "gemv_bf16");
        /* KB_TILE=N: N rows per bf16_rows call (the driver's wide tiles), else one tile */
        const int64_t tile = bf16 ? (getenv("KB_TILE") ? atoll(getenv("KB_TILE")) : k->tile_rows)
                                  : 48;
        uint16_t *xb = NULL, *xt = NULL;
        uint8_t *unsafe = NULL;
        void *bscratch = NULL;
        if (bf16) {
            if (!k->bf16_rows) {
                fprintf(stderr, "ISA %s has no bf16 unit\n", argv[2]);
                return 2;
            }
            xb = (uint16_t *)xmalloc((size_t)(tokens * d_in) * 2);
            xt = (uint16_t *)xmalloc((size_t)(tokens * d_in) * 2);
            unsafe = (uint8_t *)xmalloc((size_t)tokens);
            bscratch = xmalloc((size_t)k->bf16_scratch_bytes(groups));
            for (i = 0; i < tokens * d_in; i++) { /* x rounded down to bf16 */
                uint32_t u;
                memcpy(&u, &x[i], 4);
                xb[i] = (uint16_t)(u >> 16);
            }
            k->bf16_gather(xb, d_in, x_rows, tokens, groups, MXFP4X_NIBBLES_PAIRS, xt, unsafe);
        }
        const int64_t row_bytes = groups * (gguf ? MXFP4X_GGUF_BLOCK_BYTES : MXFP4X_GROUP_BYTES);
        uint8_t *blocks = (uint8_t *)xmalloc((size_t)(experts * rows * row_bytes));
#ifdef MADV_HUGEPAGE
        if (getenv("KB_HUGE")) /* transparent huge pages, as numpy asks for */
            if (madvise((void *)((uintptr_t)blocks & ~(uintptr_t)4095),
                        (size_t)(experts * rows * row_bytes), MADV_HUGEPAGE))
                perror("madvise");
#endif
        uint8_t *scales = (uint8_t *)xmalloc((size_t)(experts * rows * groups));
        for (i = 0; i < experts * rows * row_bytes; i++) blocks[i] = (uint8_t)(i * 37 + 11);
        for (i = 0; i < experts * rows * groups; i++) scales[i] = (uint8_t)(120 + i % 5);
        if (gguf) /* every block's first byte is its scale */
            for (i = 0; i < experts * rows * groups; i++)
                blocks[i * MXFP4X_GGUF_BLOCK_BYTES] = scales[i];
        reps = experts > 1 ? 3 : 20;
        for (rep = 0; rep < reps; rep++) {
            const double t0 = now();
            for (r0 = 0; r0 < rows; r0 += tile)
                for (e = 0; e < experts; e++) {
                    mxfp4x_rows w =
                        gguf ? mxfp4x_rows_gguf(blocks + e * rows * row_bytes, row_bytes, groups)
                             : mxfp4x_rows_split(blocks + e * rows * row_bytes,
                                                 scales + e * rows * groups, row_bytes, groups,
                                                 groups);
                    w.pf_far = tokens == 1; /* as the driver sets it: every expert one token */
                    if (e + 1 < experts && !getenv("KB_NO_HINT")) { /* the next call's rows */
                        w.next_blocks = w.blocks + rows * row_bytes + r0 * row_bytes;
                        w.next_scales = gguf ? NULL : w.scales + rows * groups + r0 * groups;
                    }
                    if (bf16)
                        k->bf16_rows(&w, r0, r0 + tile < rows ? r0 + tile : rows, xt, unsafe,
                                     tokens, out, tile, bscratch);
                    else
                        k->gemv_f32(&w, r0, r0 + 48 < rows ? r0 + 48 : rows, x, d_in, x_rows,
                                    tokens, out, 48);
                }
            if (now() - t0 < best) best = now() - t0;
        }
        {
            const double row_groups = (double)(experts * rows * groups);
            printf("%s %s rows=%lld tokens=%lld I=%lld experts=%lld: %.2f ns per row-group, "
                   "%.1f GFLOP/s, %.2f GB/s\n",
                   k->name, argv[1], (long long)rows, (long long)tokens, (long long)d_in,
                   (long long)experts, best / row_groups * 1e9,
                   2.0 * row_groups * MXFP4X_GROUP * (double)tokens / best / 1e9,
                   row_groups * (MXFP4X_GROUP_BYTES + 1) / best / 1e9);
        }
    }
    if (getenv("KB_HUGE")) { /* whether the huge pages were granted */
        char line[256];
        FILE *f = fopen("/proc/self/smaps_rollup", "r");
        while (f && fgets(line, sizeof line, f))
            if (!strncmp(line, "AnonHugePages", 13)) fputs(line, stderr);
        if (f) fclose(f);
    }
    return 0;
}
