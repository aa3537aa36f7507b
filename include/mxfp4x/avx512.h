/* mxfp4x/avx512.h -- AVX-512F variant.  Everything here is inside the
 * "avx512f" target region; nothing is reachable before dispatch.h has
 * checked the CPU and the OS (ZMM state enabled in XCR0, cpu.h).
 *
 * Order of operations: one 16-lane accumulator per (row, token); per group,
 * fma with deinterleaved elements [0,16) (low nibbles) then [16,32) (high
 * nibbles); lanes reduced by the tree (j, j+8), (j, j+4), (j, j+2), (0, 1).
 *
 * Decode of 16 bytes -> 32 weights: vpmovzxbd to 16 x int32, then one vpermps
 * each for the low nibbles and (after >> 4) the high nibbles: vpermps on zmm
 * reads only index bits 3..0, so no mask is needed.  The 16-entry table is the
 * E2M1 table times the group scale, loaded from mxfp4x_e2m1_scaled (one 64-byte
 * line per scale byte; the same bits as multiplying the two): on AMD Zen 4 the
 * multiply competed with the FMAs for the FP pipes (docs/performance.md, "Decode and
 * the one-token gemv").
 */
#ifndef MXFP4X_AVX512_H
#define MXFP4X_AVX512_H

#include "mxfp4x.h"

#if MXFP4X_HAVE_X86_SIMD
#ifdef MXFP4X_EMULATE_AVX512
#include "emulate_avx512.h" /* SIMDe + exact shims: this source on any x86-64 */
#else
#include <immintrin.h>
#endif

#define MXFP4X_AVX512_FN static MXFP4X_TARGET_AVX512
#define MXFP4X_AVX512_INLINE static inline MXFP4X_TARGET_AVX512
#define MXFP4X_AVX512_INLINE_ALWAYS static inline MXFP4X_TARGET_AVX512 MXFP4X_ALWAYS_INLINE
/* Hot blocks compiled on their own: inlined into a switch over edge cases, GCC spilled
 * their registers (see the full blocks of gemv and panel_dot). */
#if MXFP4X_GNUC
#define MXFP4X_AVX512_NOINLINE static MXFP4X_TARGET_AVX512 __attribute__((noinline))
#else
#define MXFP4X_AVX512_NOINLINE MXFP4X_AVX512_FN
#endif

MXFP4X_AVX512_INLINE float mxfp4x_hsum16_avx512(__m512 v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

MXFP4X_AVX512_INLINE void mxfp4x_decode_group_avx512(const uint8_t *b, uint8_t s, __m512 *lo,
                                                     __m512 *hi) {
    const __m512 t = _mm512_load_ps(mxfp4x_e2m1_scaled.f[s]);
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    *lo = _mm512_permutexvar_ps(idx, t);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), t);
}

/* One group decoded into the panel at p (generic/decode.h). */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_decode_store_avx512(const uint8_t *b, uint8_t s,
                                                            const mxfp4x_no_tables *t,
                                                            float *p) {
    __m512 lo, hi;
    (void)t;
    mxfp4x_decode_group_avx512(b, s, &lo, &hi);
    _mm512_storeu_ps(p, lo);
    _mm512_storeu_ps(p + 16, hi);
}

/* The microkernel the drivers of generic/ are compiled over (generic/interface.h). */
#define MXFP4X_MK_NAME(name) name##_avx512
#define MXFP4X_MK_FN MXFP4X_AVX512_FN
#define MXFP4X_MK_INLINE MXFP4X_AVX512_INLINE_ALWAYS
#define MXFP4X_MK_VEC __m512
#define MXFP4X_MK_LANES 16
#define MXFP4X_MK_LOAD(p) _mm512_loadu_ps(p)
#define MXFP4X_MK_STORE(p, v) _mm512_storeu_ps((p), (v))
#define MXFP4X_MK_SET1(f) _mm512_set1_ps(f)
#define MXFP4X_MK_ADD(a, b) _mm512_add_ps((a), (b))
#define MXFP4X_MK_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define MXFP4X_MK_FMA1(a, b, c) \
    _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
#define MXFP4X_MK_TABLES mxfp4x_no_tables
#define MXFP4X_MK_LOAD_TABLES mxfp4x_no_tables_load
#define MXFP4X_MK_DECODE_STORE mxfp4x_decode_store_avx512
#include "generic/interface.h"

/* One group of 4 rows (bytes from b, row stride sb, sb3 = 3 sb; scale bytes from s, ss,
 * ss3) against one token's latents xe, xo: a[i] = fma(hi, xo, fma(lo, xe, a[i])). */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_group4_avx512(const uint8_t *b, const uint8_t *s,
                                                     int64_t sb, int64_t sb3, int64_t ss,
                                                     int64_t ss3, __m512 xe, __m512 xo,
                                                     __m512 *a) {
    __m512 lo, hi;
    mxfp4x_decode_group_avx512(b, s[0], &lo, &hi);
    a[0] = _mm512_fmadd_ps(hi, xo, _mm512_fmadd_ps(lo, xe, a[0]));
    mxfp4x_decode_group_avx512(b + sb, s[ss], &lo, &hi);
    a[1] = _mm512_fmadd_ps(hi, xo, _mm512_fmadd_ps(lo, xe, a[1]));
    mxfp4x_decode_group_avx512(b + 2 * sb, s[2 * ss], &lo, &hi);
    a[2] = _mm512_fmadd_ps(hi, xo, _mm512_fmadd_ps(lo, xe, a[2]));
    mxfp4x_decode_group_avx512(b + sb3, s[ss3], &lo, &hi);
    a[3] = _mm512_fmadd_ps(hi, xo, _mm512_fmadd_ps(lo, xe, a[3]));
}

/* One token; `l1`: where the next rows are prefetched (a constant: compiled twice below).
 *
 * Rows 8 at a time, then 4, then one.  Each row's chain is two dependent FMAs per group
 * (8 cycles at 4 cycles of latency), so 4 rows at once cannot go under 2 cycles per
 * row-group, whatever the decode.  8 rows at once, addressed from two pointers (rows 0-3
 * and 4-7, strides 1-3 x the row stride) so that GCC keeps every pointer in a register
 * (indexed from the block's start, they spilled), and the next block prefetched two lines
 * per group (an AMD Zen 5: docs/performance.md, "Decode and the one-token gemv").  The
 * same chains, so the same bits. */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_gemv1_f32_avx512_to(const mxfp4x_rows *w,
                                                            int64_t row_start, int64_t row_end,
                                                            const float *x, float *out,
                                                            const int l1) {
    const int64_t G = w->n_groups, sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t r = row_start, g;
    __m512 lo, hi;
    for (; r + 8 <= row_end; r += 8) {
        const uint8_t *p = w->blocks + r * sb, *s = w->scales + r * ss;
        const int64_t sb3 = 3 * sb, ss3 = 3 * ss;
        const float *xg = x;
        /* the next 8-row block, or with pf_far the one after (or where they fall in the
         * next call's rows), two lines per group.  Two ahead is faster, except where it
         * pushes out what the next expert's several-token blocks still use, so the driver
         * asks for two only before a one-token expert (docs/performance.md, "Prefetch"). */
        mxfp4x_pf_cursor pf = mxfp4x_pf_block_ahead(w, r, 8, row_end, w->pf_far ? 2 : 1);
        pf.l1 = l1;
        __m512 a[8];
        int i;
        for (i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
        for (g = 0; g < G; g++) {
            const __m512 xe = _mm512_loadu_ps(xg), xo = _mm512_loadu_ps(xg + 16);
            MXFP4X_PF_STEP(pf, g);
            MXFP4X_PF_STEP(pf, g);
            mxfp4x_group4_avx512(p, s, sb, sb3, ss, ss3, xe, xo, a);
            mxfp4x_group4_avx512(p + 4 * sb, s + 4 * ss, sb, sb3, ss, ss3, xe, xo, a + 4);
            p += gb;
            s += gs;
            xg += MXFP4X_GROUP;
        }
        for (i = 0; i < 8; i++) out[r - row_start + i] = mxfp4x_hsum16_avx512(a[i]);
    }
    for (; r + 4 <= row_end; r += 4) {
        const uint8_t *b0 = w->blocks + r * sb;
        const uint8_t *s0 = w->scales + r * ss;
        /* a 4-row block ahead (or the next call's) into L2 or L1: prefetch.h */
        mxfp4x_pf_cursor pf = mxfp4x_pf_next_block_to(w, r, 4, row_end, l1);
        __m512 a[4];
        int i;
        for (i = 0; i < 4; i++) a[i] = _mm512_setzero_ps();
        for (g = 0; g < G; g++) {
            const __m512 xe = _mm512_loadu_ps(x + g * MXFP4X_GROUP);
            const __m512 xo = _mm512_loadu_ps(x + g * MXFP4X_GROUP + 16);
            MXFP4X_PF_STEP(pf, g);
            mxfp4x_group4_avx512(b0 + g * gb, s0 + g * gs, sb, 3 * sb, ss, 3 * ss, xe, xo, a);
        }
        for (i = 0; i < 4; i++) out[r - row_start + i] = mxfp4x_hsum16_avx512(a[i]);
    }
    for (; r < row_end; r++) {
        const uint8_t *b = w->blocks + r * sb;
        const uint8_t *s = w->scales + r * ss;
        __m512 a = _mm512_setzero_ps();
        for (g = 0; g < G; g++) {
            mxfp4x_decode_group_avx512(b + g * gb, s[g * gs], &lo, &hi);
            a = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + g * MXFP4X_GROUP), a);
            a = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + g * MXFP4X_GROUP + 16), a);
        }
        out[r - row_start] = mxfp4x_hsum16_avx512(a);
    }
}

MXFP4X_AVX512_FN void mxfp4x_gemv1_f32_avx512(const mxfp4x_rows *w, int64_t row_start,
                                              int64_t row_end, const float *x, float *out) {
    if (mxfp4x_pf_into_l1())
        mxfp4x_gemv1_f32_avx512_to(w, row_start, row_end, x, out, 1);
    else
        mxfp4x_gemv1_f32_avx512_to(w, row_start, row_end, x, out, 0);
}

/* 2..5 tokens at once: each row's group is decoded once into registers and applied to
 * every token (4 rows x NT tokens of accumulators), instead of one re-decode per token.
 * Per (row, token) the operations are gemv1's: a = fma(hi, xo, fma(lo, xe, a)) per
 * group, then the same reduction tree, so the bits do not depend on the batch. */
#define MXFP4X_AVX512_NT 4
/* ... and a last 4 + 1 as one block of 5 (the fifth token would take gemv1 alone: its
 * rows decoded again) */
#define MXFP4X_AVX512_NT_MAX 5
/* The gemv/panel crossover.  With 4 tokens per decode the gemv's rate does not depend on
 * the token count; decode + panel_dot starts slower (the decode writes 128 bytes of panel
 * per 17 read) and passes it near 32 tokens on a Xeon (docs/performance.md, "Few tokens
 * and the path switches"). */
#define MXFP4X_AVX512_GEMV_MAX_TOKENS 32
/* Output rows per forward task: 48 = 12 gemv row blocks, 12 panel_dot row blocks; every
 * model shape still has >= 60 tasks for 2..N threads to balance (d_out >= 2880).  The
 * driver widens tasks up to 4x when an expert takes the panel path and every thread still
 * gets 8 (_core/cpu.pyx, WIDE_TILES). */
#define MXFP4X_AVX512_TILE_ROWS 48
/* The panel's height hardly matters within L2 (a Xeon: docs/performance.md, "Tiles, tasks
 * and panels"); 384 KiB keeps it in any L2 of 1 MiB or more. */
#define MXFP4X_AVX512_PANEL_BYTES (384 * 1024)
/* One block of mr <= 4 rows (from row r) x nt <= 5 tokens over every group, the next
 * block of the call's rows (up to row_end) or the next call's prefetched meanwhile. */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_gemv_block_avx512(const mxfp4x_rows *w, int64_t r,
                                                          const float *const *xs, int mr,
                                                          int nt, float *out,
                                                          int64_t out_stride,
                                                          int64_t row_end, const int l1) {
    const int64_t G = w->n_groups, sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    const uint8_t *b[4], *sc[4];
    __m512 a[4][MXFP4X_AVX512_NT_MAX], lo, hi;
    int64_t g;
    int i, c;
    for (i = 0; i < mr; i++) {
        b[i] = w->blocks + (r + i) * sb;
        sc[i] = w->scales + (r + i) * ss;
        for (c = 0; c < nt; c++) a[i][c] = _mm512_setzero_ps();
    }
    mxfp4x_pf_cursor pf = mxfp4x_pf_next_block_to(w, r, 4, row_end, l1);
    /* groups two at a time for 2 or 3 tokens (the same operations, so the same bits;
     * faster on a Zen 5: docs/performance.md, "Few tokens and the path switches"); 4
     * tokens' doubled latents would leave the registers, so they take a group at a time */
    for (g = 0; nt <= 3 && g + 2 <= G; g += 2) {
        const int64_t ob = g * gb, os = g * gs;
        __m512 lo2, hi2;
        MXFP4X_PF_STEP(pf, g);
        MXFP4X_PF_STEP(pf, g + 1);
        for (i = 0; i < mr; i++) {
            mxfp4x_decode_group_avx512(b[i] + ob, sc[i][os], &lo, &hi);
            mxfp4x_decode_group_avx512(b[i] + ob + gb, sc[i][os + gs], &lo2, &hi2);
            for (c = 0; c < nt; c++) {
                const float *xg = xs[c] + g * MXFP4X_GROUP;
                a[i][c] = _mm512_fmadd_ps(
                    hi2, _mm512_loadu_ps(xg + 48),
                    _mm512_fmadd_ps(lo2, _mm512_loadu_ps(xg + 32),
                                    _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16),
                                                    _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg),
                                                                    a[i][c]))));
            }
        }
    }
    for (; g < G; g++) {
        const int64_t ob = g * gb, os = g * gs;
        __m512 xe[MXFP4X_AVX512_NT_MAX], xo[MXFP4X_AVX512_NT_MAX];
        MXFP4X_PF_STEP(pf, g);
        for (c = 0; c < nt; c++) {
            xe[c] = _mm512_loadu_ps(xs[c] + g * MXFP4X_GROUP);
            xo[c] = _mm512_loadu_ps(xs[c] + g * MXFP4X_GROUP + 16);
        }
        for (i = 0; i < mr; i++) {
            mxfp4x_decode_group_avx512(b[i] + ob, sc[i][os], &lo, &hi);
            for (c = 0; c < nt; c++)
                a[i][c] = _mm512_fmadd_ps(hi, xo[c], _mm512_fmadd_ps(lo, xe[c], a[i][c]));
        }
    }
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) out[c * out_stride + i] = mxfp4x_hsum16_avx512(a[i][c]);
}

/* Full blocks (4 rows) on their own, one per token count: with the row count a constant
 * the loop has far fewer instructions than the inlined form with a variable row count
 * (docs/performance.md, "Few tokens and the path switches"). */
#define MXFP4X_AVX512_GEMV_FULL(N)                                                         \
    MXFP4X_AVX512_NOINLINE void mxfp4x_gemv_full##N##_avx512(                             \
        const mxfp4x_rows *w, int64_t r, const float *const *xs, float *out,              \
        int64_t out_stride, int64_t row_end) {                                            \
        if (mxfp4x_pf_into_l1())                                                          \
            mxfp4x_gemv_block_avx512(w, r, xs, 4, N, out, out_stride, row_end, 1);        \
        else                                                                              \
            mxfp4x_gemv_block_avx512(w, r, xs, 4, N, out, out_stride, row_end, 0);        \
    }
MXFP4X_AVX512_GEMV_FULL(2)
MXFP4X_AVX512_GEMV_FULL(3)
MXFP4X_AVX512_GEMV_FULL(4)
MXFP4X_AVX512_GEMV_FULL(5)

#define MXFP4X_AVX512_GEMV_EDGE(M, N)                                                      \
    case (M) * 8 + (N):                                                                    \
        mxfp4x_gemv_block_avx512(w, r, xs, M, N, o, out_stride, row_end, 0);               \
        break;

/* One token: gemv1 (8 rows interleaved, then 4, then 1; the next rows prefetched); more:
 * blocks of up to 4 tokens (a last 5 as one), each over the rows in blocks of 4 (full
 * blocks compiled apart, see above). */
MXFP4X_AVX512_FN void mxfp4x_gemv_f32_avx512(const mxfp4x_rows *w, int64_t row_start,
                                             int64_t row_end, const float *x, int64_t x_stride,
                                             const int64_t *x_rows, int64_t n_tok, float *out,
                                             int64_t out_stride) {
    int64_t t, r;
    int c, nt;
    if (n_tok == 1) {
        mxfp4x_gemv1_f32_avx512(w, row_start, row_end, x + x_rows[0] * x_stride, out);
        return;
    }
    for (t = 0; t < n_tok; t += nt) {
        const float *xs[MXFP4X_AVX512_NT_MAX];
        nt = n_tok - t < MXFP4X_AVX512_NT ? (int)(n_tok - t) : MXFP4X_AVX512_NT;
        if (n_tok - t == MXFP4X_AVX512_NT_MAX) nt = MXFP4X_AVX512_NT_MAX;
        for (c = 0; c < nt; c++) xs[c] = x + x_rows[t + c] * x_stride;
        if (nt == 1) {
            mxfp4x_gemv1_f32_avx512(w, row_start, row_end, xs[0], out + t * out_stride);
            continue;
        }
        for (r = row_start; r < row_end; r += 4) {
            float *o = out + t * out_stride + (r - row_start);
            const int mr = row_end - r < 4 ? (int)(row_end - r) : 4;
            if (mr == 4) {
                if (nt == 5) mxfp4x_gemv_full5_avx512(w, r, xs, o, out_stride, row_end);
                else if (nt == 4) mxfp4x_gemv_full4_avx512(w, r, xs, o, out_stride, row_end);
                else if (nt == 3) mxfp4x_gemv_full3_avx512(w, r, xs, o, out_stride, row_end);
                else mxfp4x_gemv_full2_avx512(w, r, xs, o, out_stride, row_end);
                continue;
            }
            switch (mr * 8 + nt) { /* the last rows of the range */
                MXFP4X_AVX512_GEMV_EDGE(3, 2) MXFP4X_AVX512_GEMV_EDGE(3, 3)
                MXFP4X_AVX512_GEMV_EDGE(3, 4) MXFP4X_AVX512_GEMV_EDGE(2, 2)
                MXFP4X_AVX512_GEMV_EDGE(2, 3) MXFP4X_AVX512_GEMV_EDGE(2, 4)
                MXFP4X_AVX512_GEMV_EDGE(1, 2) MXFP4X_AVX512_GEMV_EDGE(1, 3)
                MXFP4X_AVX512_GEMV_EDGE(1, 4) MXFP4X_AVX512_GEMV_EDGE(3, 5)
                MXFP4X_AVX512_GEMV_EDGE(2, 5) MXFP4X_AVX512_GEMV_EDGE(1, 5)
            default: break;
            }
        }
    }
}

#include "generic/decode.h"

/* ---- panel x tokens: a register block of MR = 4 rows x NT = 6 tokens ----
 *
 * 24 accumulators + 4 row vectors + 1 token vector of the 32 zmm registers; per 16
 * elements, 10 loads feed 24 FMAs.  The fastest shape on a Xeon; k-blocking it gained
 * nothing, as rows and tokens stream from L2 fast enough (docs/performance.md, "Tiles,
 * tasks and panels").  The loads want 64-byte aligned rows and latents (the driver's
 * scratch is): from glibc's large blocks, 16 bytes past a page, every load spans two
 * lines.  Edges (fewer rows or tokens) run the same loop with smaller constant blocks.
 * Per (row, token) the operations are gemv's: one 16-lane accumulator, elements
 * ascending, then the same reduction tree. */
#define MXFP4X_AVX512_MR 4
#define MXFP4X_AVX512_PNT 6
static int64_t mxfp4x_panel_scratch_f32_avx512(int64_t n_rows) {
    (void)n_rows;
    return 0;
}

MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_panel_block_avx512(const float *p0, int64_t d_in,
                                                           const float *const *xs, int mr,
                                                           int nt, float *out,
                                                           int64_t out_stride) {
    __m512 acc[MXFP4X_AVX512_MR][MXFP4X_AVX512_PNT];
    int64_t i;
    int a, c;
    for (a = 0; a < mr; a++)
        for (c = 0; c < nt; c++) acc[a][c] = _mm512_setzero_ps();
    for (i = 0; i < d_in; i += 16) {
        __m512 wv[MXFP4X_AVX512_MR];
        for (a = 0; a < mr; a++) wv[a] = _mm512_loadu_ps(p0 + a * d_in + i);
        for (c = 0; c < nt; c++) {
            const __m512 xv = _mm512_loadu_ps(xs[c] + i);
            for (a = 0; a < mr; a++) acc[a][c] = _mm512_fmadd_ps(wv[a], xv, acc[a][c]);
        }
    }
    for (a = 0; a < mr; a++)
        for (c = 0; c < nt; c++) out[c * out_stride + a] = mxfp4x_hsum16_avx512(acc[a][c]);
}

/* The full block on its own (not inlined into the edges' switch: there GCC spilled the
 * row vectors to the stack). */
MXFP4X_AVX512_NOINLINE void mxfp4x_panel_full_avx512(const float *p0, int64_t d_in,
                                                     const float *const *xs, float *out,
                                                     int64_t out_stride) {
    mxfp4x_panel_block_avx512(p0, d_in, xs, MXFP4X_AVX512_MR, MXFP4X_AVX512_PNT, out,
                              out_stride);
}

/* The edges with constant sizes, so their accumulators stay in registers. */
#define MXFP4X_AVX512_PANEL_CASE(M, N)                                                     \
    case (M) * 8 + (N):                                                                    \
        mxfp4x_panel_block_avx512(p0, d_in, xs, M, N, o, out_stride);                       \
        break;
#define MXFP4X_AVX512_PANEL_ROW(M)                                                         \
    MXFP4X_AVX512_PANEL_CASE(M, 1) MXFP4X_AVX512_PANEL_CASE(M, 2)                          \
    MXFP4X_AVX512_PANEL_CASE(M, 3) MXFP4X_AVX512_PANEL_CASE(M, 4)                          \
    MXFP4X_AVX512_PANEL_CASE(M, 5) MXFP4X_AVX512_PANEL_CASE(M, 6)

MXFP4X_AVX512_FN void mxfp4x_panel_dot_f32_avx512(const float *panel, int64_t n_rows,
                                                  int64_t n_groups, const float *x,
                                                  int64_t x_stride, const int64_t *x_rows,
                                                  int64_t n_tok, float *out, int64_t out_stride,
                                                  float *scratch) {
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    int64_t t, r;
    int c;
    (void)scratch;
    for (t = 0; t < n_tok; t += MXFP4X_AVX512_PNT) {
        const int nt = n_tok - t < MXFP4X_AVX512_PNT ? (int)(n_tok - t) : MXFP4X_AVX512_PNT;
        const float *xs[MXFP4X_AVX512_PNT];
        for (c = 0; c < nt; c++) xs[c] = x + x_rows[t + c] * x_stride;
        for (r = 0; r < n_rows; r += MXFP4X_AVX512_MR) {
            const int mr = n_rows - r < MXFP4X_AVX512_MR ? (int)(n_rows - r) : MXFP4X_AVX512_MR;
            const float *p0 = panel + r * d_in;
            float *o = out + t * out_stride + r;
            if (mr == MXFP4X_AVX512_MR && nt == MXFP4X_AVX512_PNT) {
                mxfp4x_panel_full_avx512(p0, d_in, xs, o, out_stride);
                continue;
            }
            switch (mr * 8 + nt) {
                MXFP4X_AVX512_PANEL_ROW(4)
                MXFP4X_AVX512_PANEL_ROW(3)
                MXFP4X_AVX512_PANEL_ROW(2)
                MXFP4X_AVX512_PANEL_ROW(1)
            default: break;
            }
        }
    }
}

/* The float64 path's decode (scalar.h states it; the same bits): per group the 16 E2M1
 * values times the scale in two zmm of doubles, then vpermt2pd on the zero-extended bytes
 * (it reads index bits 3..0: bit 3 picks the negative half) for the low nibbles and, shifted
 * by 4, the high ones.  The negative half is the positive one with its sign bits flipped,
 * as GCC compiles (-v) * sc anyway: the same bits, but for a NaN scale (byte 255), where
 * scalar.h's product is the scale's own NaN for every code, so there both halves are it.
 * Faster than scalar.h's decode (a Zen 4: docs/performance.md, "The bf16 units, AMX and
 * float64"). */
typedef struct {
    __m512d pos;  /* the 8 E2M1 magnitudes, codes 0..7 */
    __m512i sign; /* the sign bit of a double */
} mxfp4x_avx512_f64_tables;

MXFP4X_AVX512_INLINE_ALWAYS mxfp4x_avx512_f64_tables mxfp4x_avx512_f64_load_tables(void) {
    mxfp4x_avx512_f64_tables t;
    t.pos = _mm512_set_pd(6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0);
    t.sign = _mm512_set1_epi64((int64_t)0x8000000000000000ull);
    return t;
}

/* One group (16 bytes at bg, scale byte sb) -> 32 doubles at pg (generic/decode_f64.h). */
MXFP4X_AVX512_INLINE_ALWAYS void
mxfp4x_decode_group_f64_avx512(const uint8_t *bg, uint8_t sb, const mxfp4x_avx512_f64_tables *t,
                               double *pg) {
    const __m512d tp = _mm512_mul_pd(t->pos, _mm512_set1_pd(mxfp4x_e8m0_f64(sb)));
    const __m512d tn = sb == MXFP4X_E8M0_NAN ? tp
        : _mm512_castsi512_pd(_mm512_xor_si512(_mm512_castpd_si512(tp), t->sign));
    const __m512i i0 = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)bg));
    const __m512i i1 = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(bg + 8)));
    _mm512_storeu_pd(pg, _mm512_permutex2var_pd(tp, i0, tn));
    _mm512_storeu_pd(pg + 8, _mm512_permutex2var_pd(tp, i1, tn));
    _mm512_storeu_pd(pg + 16, _mm512_permutex2var_pd(tp, _mm512_srli_epi64(i0, 4), tn));
    _mm512_storeu_pd(pg + 24, _mm512_permutex2var_pd(tp, _mm512_srli_epi64(i1, 4), tn));
}

#define MXFP4X_MK_F64_TABLES mxfp4x_avx512_f64_tables
#define MXFP4X_MK_F64_LOAD_TABLES mxfp4x_avx512_f64_load_tables
#define MXFP4X_MK_DECODE_F64 mxfp4x_decode_group_f64_avx512
#include "generic/decode_f64.h"

/* The float64 path's panel_dot and axpy_rows (float64.h), as mxfp4x_*_f64_avx512. */
#define MXFP4X_F64_NAME(name) name##_avx512
#define MXFP4X_F64_FN MXFP4X_AVX512_FN
#define MXFP4X_F64_INLINE MXFP4X_AVX512_INLINE_ALWAYS
#define MXFP4X_F64_NOINLINE MXFP4X_AVX512_NOINLINE
#include "float64.h"

/* axpy_rows, dst[j] += sum_r coef[r] * panel[r][j]: 128 columns in 8 accumulators; tails of
 * 16 then 1 column (scalar FMAs). */
#define MXFP4X_MK_AXPY_VECS 8
#include "generic/axpy_rows.h"

/* Roofline: 12 independent zmm FMA chains. */
#define MXFP4X_MK_FMA_CHAINS 12
#include "generic/fma_probe.h"
#include "generic/end.h"

#include "dense/avx512.h"

#endif /* MXFP4X_HAVE_X86_SIMD */
#endif /* MXFP4X_AVX512_H */
