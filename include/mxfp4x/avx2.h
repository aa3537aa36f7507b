/* mxfp4x/avx2.h -- AVX2 + FMA variant.  Everything here is inside the
 * "avx2,fma" target region; nothing is reachable before dispatch.h has checked
 * the CPU and the OS (cpu.h).
 *
 * Element order ("layout 4"): inside every block of 8 elements, the 4 even
 * elements (low nibbles) then the 4 odd ones (high nibbles).  The latents are
 * permuted into this order once per call, so the decode below needs no
 * cross-lane shuffle.
 *
 * Decode of one group (16 bytes -> 32 floats), 11 integer ops and no multiply:
 *   broadcast the 16 bytes to both 128-bit lanes; lane 0 keeps the low
 *   nibbles, lane 1 the high ones (>> 4, blend, & 0xF);
 *   two vpshufb look up byte 3 and byte 2 of the float32 value of every code
 *   times the group's scale, in that scale byte's two 16-byte tables
 *   (mxfp4x_e2m1_scaled_b3/_b2: every such value has zero low 16 bits, s = 255
 *   gives the NaN 0x7FC00000; the same bits as the float32 multiply by the scale
 *   that this replaced);
 *   unpack bytes to 16-bit words, then words to the high half of dwords:
 *     f0 = [lo0..lo3 | hi0..hi3] = elements 0,2,4,6,1,3,5,7  ... f3 = elements 24..31
 *
 * Order of operations: one 8-lane accumulator per (row, token); lane l sums
 * w*x over the layout positions p = l (mod 8) in increasing p with FMA; lanes
 * reduced by the tree (j, j+4), (j, j+2), (0, 1).  gemv and decode + panel_dot
 * follow it exactly, so they agree bit for bit (batch invariance).
 */
#ifndef MXFP4X_AVX2_H
#define MXFP4X_AVX2_H

#include "mxfp4x.h"

#if MXFP4X_HAVE_X86_SIMD
#include <immintrin.h>

#define MXFP4X_AVX2_FN static MXFP4X_TARGET_AVX2
#define MXFP4X_AVX2_INLINE static inline MXFP4X_TARGET_AVX2 MXFP4X_ALWAYS_INLINE
#if MXFP4X_GNUC
#define MXFP4X_AVX2_NOINLINE static MXFP4X_TARGET_AVX2 __attribute__((noinline))
#else
#define MXFP4X_AVX2_NOINLINE MXFP4X_AVX2_FN
#endif

typedef struct {
    __m256i low_nibble;
} mxfp4x_avx2_tables;

MXFP4X_AVX2_INLINE mxfp4x_avx2_tables mxfp4x_avx2_load_tables(void) {
    mxfp4x_avx2_tables t;
    t.low_nibble = _mm256_set1_epi8(0x0F);
    return t;
}

MXFP4X_AVX2_INLINE float mxfp4x_hsum8_avx2(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

/* One group (16 bytes at b, scale byte s) -> w[0..3], layout-4 positions [8k, 8k+8). */
MXFP4X_AVX2_INLINE void mxfp4x_decode_group_avx2(const uint8_t *b, uint8_t s,
                                                 const mxfp4x_avx2_tables *t, __m256 *w) {
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b));
    const __m256i codes = _mm256_and_si256(
        _mm256_blend_epi32(raw, _mm256_srli_epi16(raw, 4), 0xF0), t->low_nibble);
    /* this scale's tables: the scaled values' bytes 3 and 2 (mxfp4x_e2m1_scaled) */
    const __m256i b3 = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mxfp4x_e2m1_scaled_b3[s])),
        codes);
    const __m256i b2 = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mxfp4x_e2m1_scaled_b2[s])),
        codes);
    const __m256i w16a = _mm256_unpacklo_epi8(b2, b3), w16b = _mm256_unpackhi_epi8(b2, b3);
    const __m256i zero = _mm256_setzero_si256();
    w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w16a));
    w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w16a));
    w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w16b));
    w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w16b));
}

MXFP4X_AVX2_INLINE __m256 mxfp4x_fma_group_avx2(const __m256 *w, const float *xg, __m256 acc) {
    acc = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), acc);
    acc = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), acc);
    acc = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), acc);
    acc = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), acc);
    return acc;
}

/* One group decoded into the panel at p (generic/decode.h). */
MXFP4X_AVX2_INLINE void mxfp4x_decode_store_avx2(const uint8_t *b, uint8_t s,
                                                 const mxfp4x_avx2_tables *t, float *p) {
    __m256 wv[4];
    mxfp4x_decode_group_avx2(b, s, t, wv);
    _mm256_storeu_ps(p, wv[0]);
    _mm256_storeu_ps(p + 8, wv[1]);
    _mm256_storeu_ps(p + 16, wv[2]);
    _mm256_storeu_ps(p + 24, wv[3]);
}

/* The microkernel the drivers of generic/ are compiled over (generic/interface.h). */
#define MXFP4X_MK_NAME(name) name##_avx2
#define MXFP4X_MK_FN MXFP4X_AVX2_FN
#define MXFP4X_MK_INLINE MXFP4X_AVX2_INLINE
#define MXFP4X_MK_VEC __m256
#define MXFP4X_MK_LANES 8
#define MXFP4X_MK_LOAD(p) _mm256_loadu_ps(p)
#define MXFP4X_MK_STORE(p, v) _mm256_storeu_ps((p), (v))
#define MXFP4X_MK_SET1(f) _mm256_set1_ps(f)
#define MXFP4X_MK_ADD(a, b) _mm256_add_ps((a), (b))
#define MXFP4X_MK_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define MXFP4X_MK_FMA1(a, b, c) \
    _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)))
#define MXFP4X_MK_TABLES mxfp4x_avx2_tables
#define MXFP4X_MK_LOAD_TABLES mxfp4x_avx2_load_tables
#define MXFP4X_MK_DECODE_STORE mxfp4x_decode_store_avx2
#include "generic/interface.h"

/* The one-token gemv: generic/gemv1.h, four rows at a time (four independent FMA
 * chains), the next 4-row block (or the next call's first) prefetched into L2: the
 * hardware prefetcher loses track of 4 interleaved short streams. */
#define MXFP4X_MK_GEMV1_MR 4
#define MXFP4X_MK_GEMV1_PREFETCH 1
#define MXFP4X_MK_ROW_ACCS 1
#define MXFP4X_MK_DECODE_GROUP mxfp4x_decode_group_avx2
#define MXFP4X_MK_FMA_GROUP(wv, xg, acc) ((acc)[0] = mxfp4x_fma_group_avx2((wv), (xg), (acc)[0]))
#define MXFP4X_MK_HSUM_ACCS(acc) mxfp4x_hsum8_avx2((acc)[0])
#include "generic/gemv1.h"

/* Two rows at a time, each decoded once per group into registers and applied
 * to NT <= 4 tokens: 2*NT independent FMA chains hide the FMA latency.  A last
 * odd row runs alone with the same per-(row, token) sequence. */
MXFP4X_AVX2_INLINE void mxfp4x_gemv_tokens_avx2(const mxfp4x_rows *w, int64_t row_start,
                                                int64_t row_end, const float *const *xs, int nt,
                                                float *out, int64_t out_stride) {
    const mxfp4x_avx2_tables t = mxfp4x_avx2_load_tables();
    const int64_t G = w->n_groups, sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t r, g;
    int c, i;
    __m256 wv[4];
    for (r = row_start; r < row_end; r += 2) {
        const int mr = r + 1 < row_end ? 2 : 1;
        const uint8_t *b = w->blocks + r * sb;
        const uint8_t *s = w->scales + r * ss;
        mxfp4x_pf_cursor pf = mxfp4x_pf_next_block(w, r, 2, row_end);
        __m256 a[2][4];
        for (i = 0; i < 2; i++)
            for (c = 0; c < 4; c++) a[i][c] = _mm256_setzero_ps();
        for (g = 0; g < G; g++) {
            const int64_t ob = g * gb;
            MXFP4X_PF_STEP(pf, g);
            for (i = 0; i < mr; i++) {
                mxfp4x_decode_group_avx2(b + i * sb + ob, s[i * ss + g * gs], &t, wv);
                for (c = 0; c < 4; c++)
                    if (c < nt)
                        a[i][c] = mxfp4x_fma_group_avx2(wv, xs[c] + g * MXFP4X_GROUP, a[i][c]);
            }
        }
        for (i = 0; i < mr; i++)
            for (c = 0; c < nt; c++)
                out[c * out_stride + r + i - row_start] = mxfp4x_hsum8_avx2(a[i][c]);
    }
}

/* Not generic/gemv_tokens.h: here a lone token of several runs gemv_tokens, and the
 * one-token call gemv1 outside the switch; the generic switch compiled to more
 * instructions per token at 2 to 5 tokens (docs/performance.md, "Generic drivers"). */
MXFP4X_AVX2_FN void mxfp4x_gemv_f32_avx2(const mxfp4x_rows *w, int64_t row_start,
                                         int64_t row_end, const float *x, int64_t x_stride,
                                         const int64_t *x_rows, int64_t n_tok, float *out,
                                         int64_t out_stride) {
    int64_t t;
    int c;
    if (n_tok == 1) {
        mxfp4x_gemv1_f32_avx2(w, row_start, row_end, x + x_rows[0] * x_stride, out);
        return;
    }
    for (t = 0; t < n_tok; t += 4) {
        const int nt = n_tok - t < 4 ? (int)(n_tok - t) : 4;
        const float *xs[4];
        float *o = out + t * out_stride;
        for (c = 0; c < nt; c++) xs[c] = x + x_rows[t + c] * x_stride;
        switch (nt) { /* constant token counts: accumulators stay in registers */
        case 4: mxfp4x_gemv_tokens_avx2(w, row_start, row_end, xs, 4, o, out_stride); break;
        case 3: mxfp4x_gemv_tokens_avx2(w, row_start, row_end, xs, 3, o, out_stride); break;
        case 2: mxfp4x_gemv_tokens_avx2(w, row_start, row_end, xs, 2, o, out_stride); break;
        default: mxfp4x_gemv_tokens_avx2(w, row_start, row_end, xs, 1, o, out_stride); break;
        }
    }
}

#include "generic/decode.h"

/* ---- panel x tokens: register-blocked micro-kernel over k-chunks ----
 *
 * A block of MR = 3 panel rows x NT <= 4 tokens keeps 12 accumulators, the 3
 * rows' vectors and one latent vector in the 16 ymm registers (7 loads per 12
 * FMAs).  k runs in chunks of MXFP4X_AVX2_KC floats so the 3 rows' chunk stays
 * in L1 while the tokens stream past; between chunks the 8-lane accumulators
 * are parked in `lanes` unreduced, so the per-lane sequence is exactly the
 * unchunked one. */
#define MXFP4X_AVX2_KC 512
/* The gemv/panel crossover (tuned on AMD Zen 3): panels from 9 tokens per expert on. */
#define MXFP4X_AVX2_GEMV_MAX_TOKENS 8
/* Tuned on Zen 3 with the driver: 48-row tasks (the driver widens them with panel work,
 * _core/cpu.pyx's WIDE_TILES); panels of at most 384 KiB (Zen 3 L2: 512 KiB), the panel's
 * height hardly matters (docs/performance.md, "Tiles, tasks and panels"). */
#define MXFP4X_AVX2_TILE_ROWS 48
#define MXFP4X_AVX2_PANEL_BYTES (384 * 1024)
#define MXFP4X_AVX2_MR 3          /* panel rows per register block */
#define MXFP4X_AVX2_NT 4          /* tokens per register block */
#define MXFP4X_AVX2_TOKENS 64     /* tokens per super-block (bounds the scratch) */

/* The register block of generic/panel_chunked.h: lanes[(r * NT + c) * 8 + l] is lane l
 * of (row r, token c)'s accumulator. */
MXFP4X_AVX2_INLINE void mxfp4x_block_avx2(const float *const *ps, int mr,
                                          const float *const *xs, int nt, int64_t k0,
                                          int64_t k1, float *lanes) {
    const float *p0 = ps[0], *p1 = ps[1], *p2 = ps[2];
    __m256 a[3][4];
    int r, c;
    int64_t i;
    for (r = 0; r < 3; r++)
        for (c = 0; c < 4; c++)
            a[r][c] = (r < mr && c < nt) ? _mm256_loadu_ps(lanes + (r * 4 + c) * 8)
                                         : _mm256_setzero_ps();
    for (i = k0; i < k1; i += 8) {
        const __m256 w0 = _mm256_loadu_ps(p0 + i);
        const __m256 w1 = mr > 1 ? _mm256_loadu_ps(p1 + i) : w0;
        const __m256 w2 = mr > 2 ? _mm256_loadu_ps(p2 + i) : w0;
        for (c = 0; c < 4; c++) {
            if (c < nt) {
                const __m256 xv = _mm256_loadu_ps(xs[c] + i);
                a[0][c] = _mm256_fmadd_ps(w0, xv, a[0][c]);
                if (mr > 1) a[1][c] = _mm256_fmadd_ps(w1, xv, a[1][c]);
                if (mr > 2) a[2][c] = _mm256_fmadd_ps(w2, xv, a[2][c]);
            }
        }
    }
    for (r = 0; r < mr; r++)
        for (c = 0; c < nt; c++) _mm256_storeu_ps(lanes + (r * 4 + c) * 8, a[r][c]);
}

#define MXFP4X_MK_PANEL_MR MXFP4X_AVX2_MR
#define MXFP4X_MK_PANEL_NT MXFP4X_AVX2_NT
#define MXFP4X_MK_PANEL_TOKENS MXFP4X_AVX2_TOKENS
#define MXFP4X_MK_PANEL_KC MXFP4X_AVX2_KC
#define MXFP4X_MK_PANEL_PARK 8 /* one 8-lane accumulator per (row, token) */
#define MXFP4X_MK_HSUM_PARKED(l) mxfp4x_hsum8_avx2(_mm256_loadu_ps(l))
#include "generic/panel_chunked.h"

/* axpy_rows: 64 columns held in 8 accumulators while the rows stream past. */
#define MXFP4X_MK_AXPY_VECS 8
#include "generic/axpy_rows.h"

/* The float64 path's decode (scalar.h states it; the same bits).  Every E2M1 value times
 * a power of two has zero low 32 bits as a double, so per group the high halves of the
 * eight magnitudes times the scale (two multiplies, one shuffle) form a vpermd table; four
 * bytes at a time, zero-extended to 64 bits, index it for their low nibbles (shifted up by
 * 32) and high nibbles (by 28), and the code's bit 3 becomes the sign -- but under a NaN
 * scale (byte 255), where scalar.h's product is the scale's own NaN for every code.  Faster
 * than scalar.h's decode (a Zen 4: docs/performance.md, "The bf16 units, AMX and
 * float64"). */
MXFP4X_AVX2_INLINE __m256i mxfp4x_f64_quad_avx2(__m256i table, __m256i idx, __m256i sign) {
    const __m256i high = _mm256_set1_epi64x((int64_t)0xFFFFFFFF00000000ull);
    return _mm256_or_si256(_mm256_and_si256(_mm256_permutevar8x32_epi32(table, idx), high),
                           sign);
}

/* The decode's constants: the magnitudes in the order the shuffle below leaves codes 0..7
 * in, and the sign bit of a double. */
typedef struct {
    __m256d m0, m1;
    __m256i top;
} mxfp4x_avx2_f64_tables;

MXFP4X_AVX2_INLINE mxfp4x_avx2_f64_tables mxfp4x_avx2_f64_load_tables(void) {
    mxfp4x_avx2_f64_tables t;
    t.m0 = _mm256_setr_pd(0.0, 0.5, 2.0, 3.0);
    t.m1 = _mm256_setr_pd(1.0, 1.5, 4.0, 6.0);
    t.top = _mm256_set1_epi64x((int64_t)0x8000000000000000ull);
    return t;
}

/* One group (16 bytes at bg, scale byte sb) -> 32 doubles at pg (generic/decode_f64.h). */
MXFP4X_AVX2_INLINE void mxfp4x_decode_group_f64_avx2(const uint8_t *bg, uint8_t sb,
                                                     const mxfp4x_avx2_f64_tables *t,
                                                     double *pg) {
    const __m256d sc = _mm256_set1_pd(mxfp4x_e8m0_f64(sb));
    /* dwords [hi 0, hi .5, hi 1, hi 1.5 | hi 2, hi 3, hi 4, hi 6] */
    const __m256i table = _mm256_castps_si256(
        _mm256_shuffle_ps(_mm256_castpd_ps(_mm256_mul_pd(t->m0, sc)),
                          _mm256_castpd_ps(_mm256_mul_pd(t->m1, sc)), 0xDD));
    const __m256i sign = sb == MXFP4X_E8M0_NAN ? _mm256_setzero_si256() : t->top;
    int j;
    for (j = 0; j < 16; j += 4) {
        int32_t four;
        __m256i q;
        memcpy(&four, bg + j, 4);
        q = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(four));
        _mm256_storeu_si256((__m256i *)(pg + j),
                            mxfp4x_f64_quad_avx2(table, _mm256_slli_epi64(q, 32),
                                                 _mm256_and_si256(_mm256_slli_epi64(q, 60),
                                                                  sign)));
        _mm256_storeu_si256((__m256i *)(pg + 16 + j),
                            mxfp4x_f64_quad_avx2(table, _mm256_slli_epi64(q, 28),
                                                 _mm256_and_si256(_mm256_slli_epi64(q, 56),
                                                                  sign)));
    }
}

#define MXFP4X_MK_F64_TABLES mxfp4x_avx2_f64_tables
#define MXFP4X_MK_F64_LOAD_TABLES mxfp4x_avx2_f64_load_tables
#define MXFP4X_MK_DECODE_F64 mxfp4x_decode_group_f64_avx2
#include "generic/decode_f64.h"

/* The float64 path's panel_dot and axpy_rows (float64.h), as mxfp4x_*_f64_avx2. */
#define MXFP4X_F64_NAME(name) name##_avx2
#define MXFP4X_F64_FN MXFP4X_AVX2_FN
#define MXFP4X_F64_INLINE MXFP4X_AVX2_INLINE
#define MXFP4X_F64_NOINLINE MXFP4X_AVX2_NOINLINE
#include "float64.h"

/* Roofline: 10 independent vfmadd231ps chains (hides the 4-5 cycle latency on two ports). */
#define MXFP4X_MK_FMA_CHAINS 10
#include "generic/fma_probe.h"

/* The dense bf16 kernels (generic/dense_bf16.h). */
#include "dense/avx2.h"
#include "generic/end.h"

#endif /* MXFP4X_HAVE_X86_SIMD */
#endif /* MXFP4X_AVX2_H */
