/* mxfp4x/avx2.h -- AVX2 + FMA variant.  Everything here is inside the
 * "avx2,fma" target region; nothing is reachable before dispatch.h has checked
 * the CPU (cpu.h).
 *
 * Order of operations: one 8-lane accumulator per (row, token); per group,
 * fma with deinterleaved elements [0,8), [8,16), [16,24), [24,32) in that
 * order; lanes reduced by the tree (j, j+4), (j, j+2), (0, 1).  gemv,
 * decode + panel_dot follow it exactly, so they agree bit for bit.
 *
 * Decode of 8 bytes -> 16 weights: zero-extend to 8 x int32, look the 3-bit
 * magnitude up with vpermps in the positive and the negative table (both
 * pre-multiplied by the group scale: exact, a power of two), and blend on the
 * sign bit moved to bit 31 (<< 28 for the low nibble, << 24 for the high one).
 */
#ifndef MXFP4X_AVX2_H
#define MXFP4X_AVX2_H

#include "mxfp4x.h"

#if MXFP4X_HAVE_X86_SIMD
#include <immintrin.h>

#define MXFP4X_AVX2_FN static MXFP4X_TARGET_AVX2
#define MXFP4X_AVX2_INLINE static inline MXFP4X_TARGET_AVX2

MXFP4X_AVX2_INLINE float mxfp4x_hsum8_avx2(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

/* Decode one group (16 bytes, scale byte s) into 4 vectors, deinterleaved
 * positions [0,8), [8,16), [16,24), [24,32). */
MXFP4X_AVX2_INLINE void mxfp4x_decode_group_avx2(const uint8_t *b, uint8_t s, __m256 tpos,
                                                 __m256 tneg, __m256 *w) {
    const __m256 vs = _mm256_set1_ps(mxfp4x_e8m0_f32(s));
    const __m256 pos = _mm256_mul_ps(tpos, vs), neg = _mm256_mul_ps(tneg, vs);
    const __m256i i0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    const __m256i i1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
    const __m256i h0 = _mm256_srli_epi32(i0, 4), h1 = _mm256_srli_epi32(i1, 4);
    w[0] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, i0), _mm256_permutevar8x32_ps(neg, i0),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i0, 28)));
    w[1] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, i1), _mm256_permutevar8x32_ps(neg, i1),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i1, 28)));
    w[2] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, h0), _mm256_permutevar8x32_ps(neg, h0),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i0, 24)));
    w[3] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, h1), _mm256_permutevar8x32_ps(neg, h1),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i1, 24)));
}

MXFP4X_AVX2_INLINE __m256 mxfp4x_fma_group_avx2(const __m256 *w, const float *xg, __m256 acc) {
    acc = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg), acc);
    acc = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), acc);
    acc = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), acc);
    acc = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), acc);
    return acc;
}

/* Fused decode + dot; four rows at a time so four independent FMA chains
 * hide the latency, each row with the exact single-row sequence. */
MXFP4X_AVX2_FN void mxfp4x_gemv_f32_avx2(const mxfp4x_rows *w, int64_t row_start,
                                         int64_t row_end, const float *x, float *out) {
    const __m256 tpos = _mm256_loadu_ps(mxfp4x_e2m1_f32);
    const __m256 tneg = _mm256_loadu_ps(mxfp4x_e2m1_f32 + 8);
    const int64_t G = w->n_groups;
    int64_t r = row_start, g;
    __m256 wv[4];
    for (; r + 4 <= row_end; r += 4) {
        const uint8_t *b0 = w->blocks + r * w->row_stride_blocks;
        const uint8_t *s0 = w->scales + r * w->row_stride_scales;
        const int64_t sb = w->row_stride_blocks, ss = w->row_stride_scales;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (g = 0; g < G; g++) {
            const float *xg = x + g * MXFP4X_GROUP;
            const int64_t ob = g * MXFP4X_GROUP_BYTES;
            mxfp4x_decode_group_avx2(b0 + ob, s0[g], tpos, tneg, wv);
            a0 = mxfp4x_fma_group_avx2(wv, xg, a0);
            mxfp4x_decode_group_avx2(b0 + sb + ob, s0[ss + g], tpos, tneg, wv);
            a1 = mxfp4x_fma_group_avx2(wv, xg, a1);
            mxfp4x_decode_group_avx2(b0 + 2 * sb + ob, s0[2 * ss + g], tpos, tneg, wv);
            a2 = mxfp4x_fma_group_avx2(wv, xg, a2);
            mxfp4x_decode_group_avx2(b0 + 3 * sb + ob, s0[3 * ss + g], tpos, tneg, wv);
            a3 = mxfp4x_fma_group_avx2(wv, xg, a3);
        }
        out[r - row_start] = mxfp4x_hsum8_avx2(a0);
        out[r - row_start + 1] = mxfp4x_hsum8_avx2(a1);
        out[r - row_start + 2] = mxfp4x_hsum8_avx2(a2);
        out[r - row_start + 3] = mxfp4x_hsum8_avx2(a3);
    }
    for (; r < row_end; r++) {
        const uint8_t *b = w->blocks + r * w->row_stride_blocks;
        const uint8_t *s = w->scales + r * w->row_stride_scales;
        __m256 a = _mm256_setzero_ps();
        for (g = 0; g < G; g++) {
            mxfp4x_decode_group_avx2(b + g * MXFP4X_GROUP_BYTES, s[g], tpos, tneg, wv);
            a = mxfp4x_fma_group_avx2(wv, x + g * MXFP4X_GROUP, a);
        }
        out[r - row_start] = mxfp4x_hsum8_avx2(a);
    }
}

MXFP4X_AVX2_FN void mxfp4x_decode_f32_avx2(const mxfp4x_rows *w, int64_t row_start,
                                           int64_t row_end, float *panel) {
    const __m256 tpos = _mm256_loadu_ps(mxfp4x_e2m1_f32);
    const __m256 tneg = _mm256_loadu_ps(mxfp4x_e2m1_f32 + 8);
    const int64_t d_in = w->n_groups * MXFP4X_GROUP;
    int64_t r, g;
    __m256 wv[4];
    for (r = row_start; r < row_end; r++) {
        const uint8_t *b = w->blocks + r * w->row_stride_blocks;
        const uint8_t *s = w->scales + r * w->row_stride_scales;
        float *p = panel + (r - row_start) * d_in;
        for (g = 0; g < w->n_groups; g++) {
            float *pg = p + g * MXFP4X_GROUP;
            mxfp4x_decode_group_avx2(b + g * MXFP4X_GROUP_BYTES, s[g], tpos, tneg, wv);
            _mm256_storeu_ps(pg, wv[0]);
            _mm256_storeu_ps(pg + 8, wv[1]);
            _mm256_storeu_ps(pg + 16, wv[2]);
            _mm256_storeu_ps(pg + 24, wv[3]);
        }
    }
}

/* Register block of 4 rows x 2 tokens: per 8-wide step 4 panel loads, 2 latent
 * loads, 8 FMAs.  Every (row, token) accumulator sees the gemv sequence. */
MXFP4X_AVX2_FN void mxfp4x_panel_dot_f32_avx2(const float *panel, int64_t n_rows,
                                              int64_t n_groups, const float *x, int64_t x_stride,
                                              const int64_t *x_rows, int64_t n_tok, float *out,
                                              int64_t out_stride) {
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    int64_t t = 0, r, i;
    for (; t + 2 <= n_tok; t += 2) {
        const float *x0 = x + x_rows[t] * x_stride, *x1 = x + x_rows[t + 1] * x_stride;
        for (r = 0; r + 4 <= n_rows; r += 4) {
            const float *p0 = panel + r * d_in, *p1 = p0 + d_in, *p2 = p1 + d_in, *p3 = p2 + d_in;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00,
                   a21 = a00, a30 = a00, a31 = a00;
            for (i = 0; i < d_in; i += 8) {
                const __m256 v0 = _mm256_loadu_ps(x0 + i), v1 = _mm256_loadu_ps(x1 + i);
                __m256 wv = _mm256_loadu_ps(p0 + i);
                a00 = _mm256_fmadd_ps(wv, v0, a00);
                a01 = _mm256_fmadd_ps(wv, v1, a01);
                wv = _mm256_loadu_ps(p1 + i);
                a10 = _mm256_fmadd_ps(wv, v0, a10);
                a11 = _mm256_fmadd_ps(wv, v1, a11);
                wv = _mm256_loadu_ps(p2 + i);
                a20 = _mm256_fmadd_ps(wv, v0, a20);
                a21 = _mm256_fmadd_ps(wv, v1, a21);
                wv = _mm256_loadu_ps(p3 + i);
                a30 = _mm256_fmadd_ps(wv, v0, a30);
                a31 = _mm256_fmadd_ps(wv, v1, a31);
            }
            out[t * out_stride + r] = mxfp4x_hsum8_avx2(a00);
            out[(t + 1) * out_stride + r] = mxfp4x_hsum8_avx2(a01);
            out[t * out_stride + r + 1] = mxfp4x_hsum8_avx2(a10);
            out[(t + 1) * out_stride + r + 1] = mxfp4x_hsum8_avx2(a11);
            out[t * out_stride + r + 2] = mxfp4x_hsum8_avx2(a20);
            out[(t + 1) * out_stride + r + 2] = mxfp4x_hsum8_avx2(a21);
            out[t * out_stride + r + 3] = mxfp4x_hsum8_avx2(a30);
            out[(t + 1) * out_stride + r + 3] = mxfp4x_hsum8_avx2(a31);
        }
        for (; r < n_rows; r++) {
            const float *p = panel + r * d_in;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            for (i = 0; i < d_in; i += 8) {
                const __m256 wv = _mm256_loadu_ps(p + i);
                a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + i), a0);
                a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x1 + i), a1);
            }
            out[t * out_stride + r] = mxfp4x_hsum8_avx2(a0);
            out[(t + 1) * out_stride + r] = mxfp4x_hsum8_avx2(a1);
        }
    }
    for (; t < n_tok; t++) {
        const float *xt = x + x_rows[t] * x_stride;
        for (r = 0; r < n_rows; r++) {
            const float *p = panel + r * d_in;
            __m256 a = _mm256_setzero_ps();
            for (i = 0; i < d_in; i += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(xt + i), a);
            out[t * out_stride + r] = mxfp4x_hsum8_avx2(a);
        }
    }
}

#endif /* MXFP4X_HAVE_X86_SIMD */
#endif /* MXFP4X_AVX2_H */
