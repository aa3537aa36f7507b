/* mxfp4x/bf16/avx512bf16_gemv.h -- avx512bf16's few-token path: each group decoded once
 * in a register, applied to every token.  Part of avx512bf16.h, included there inside its
 * target region: it uses that header's macros and what it defines before the include. */
#ifndef MXFP4X_BF16_AVX512BF16_GEMV_H
#define MXFP4X_BF16_AVX512BF16_GEMV_H

/* ---- few tokens: each group decoded once in a register, applied to every token ---- */

/* mr <= 4 rows from r x nt <= 5 tokens (xs[t]: d_in words each) over every group:
 * out[t * out_stride + i] = row r + i . token t; the next rows prefetched meanwhile. */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_gemv_block(const mxfp4x_rows *w, int64_t r,
                                                   const uint16_t *const *xs, int mr, int nt,
                                                   float *out, int64_t out_stride,
                                                   int64_t row_end, const int l1) {
    const int64_t G = w->n_groups, sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    const uint8_t *b[MXFP4X_BF16DP_MR], *sc[MXFP4X_BF16DP_MR];
    __m512 a[MXFP4X_BF16DP_MR][MXFP4X_BF16DP_NT_MAX];
    int64_t g;
    int i, t;
    for (i = 0; i < mr; i++) {
        b[i] = w->blocks + (r + i) * sb;
        sc[i] = w->scales + (r + i) * ss;
        for (t = 0; t < nt; t++) a[i][t] = _mm512_setzero_ps();
    }
    mxfp4x_pf_cursor pf = mxfp4x_pf_next_block_to(w, r, MXFP4X_BF16DP_MR, row_end, l1);
    g = 0;
    if (mxfp4x_bf16dp_paired(w->nibbles)) {
        for (; g + 2 <= G; g += 2) {
            MXFP4X_PF_STEP(pf, g);
            MXFP4X_PF_STEP(pf, g + 1);
            for (i = 0; i < mr; i++) {
                __m512i lo, hi;
                mxfp4x_bf16dp_decode2(b[i] + g * gb, sc[i][g * gs], sc[i][(g + 1) * gs], &lo, &hi);
                for (t = 0; t < nt; t++) {
                    const uint16_t *xc = xs[t] + g * MXFP4X_GROUP;
                    a[i][t] = _mm512_dpbf16_ps(a[i][t], (__m512bh)lo,
                                               (__m512bh)_mm512_loadu_si512((const void *)xc));
                    a[i][t] = _mm512_dpbf16_ps(
                        a[i][t], (__m512bh)hi,
                        (__m512bh)_mm512_loadu_si512((const void *)(xc + MXFP4X_GROUP)));
                }
            }
        }
    }
    for (; g < G; g++) {
        __m512bh x[MXFP4X_BF16DP_NT_MAX];
        MXFP4X_PF_STEP(pf, g);
        for (t = 0; t < nt; t++)
            x[t] = (__m512bh)_mm512_loadu_si512((const void *)(xs[t] + g * MXFP4X_GROUP));
        for (i = 0; i < mr; i++) {
            const __m512bh wv = (__m512bh)mxfp4x_bf16_decode_group(b[i] + g * gb, sc[i][g * gs]);
            for (t = 0; t < nt; t++) a[i][t] = _mm512_dpbf16_ps(a[i][t], wv, x[t]);
        }
    }
    if (mr == MXFP4X_BF16DP_MR) { /* token 4 by hsum16 itself: the same tree */
        mxfp4x_bf16dp_reduce_4xn(a, nt < 4 ? nt : 4, out, out_stride);
        for (t = 4; t < nt; t++)
            for (i = 0; i < mr; i++) out[t * out_stride + i] = mxfp4x_hsum16_avx512(a[i][t]);
        return;
    }
    for (i = 0; i < mr; i++)
        for (t = 0; t < nt; t++) out[t * out_stride + i] = mxfp4x_hsum16_avx512(a[i][t]);
}

/* Full blocks compiled apart, their accumulators in registers. */
#define MXFP4X_BF16DP_GEMV_FULL(N)                                                         \
    MXFP4X_BF16DP_NOINLINE void mxfp4x_bf16dp_gemv_full##N(                               \
        const mxfp4x_rows *w, int64_t r, const uint16_t *const *xs, float *out,           \
        int64_t out_stride, int64_t row_end) {                                            \
        if (mxfp4x_pf_into_l1())                                                          \
            mxfp4x_bf16dp_gemv_block(w, r, xs, MXFP4X_BF16DP_MR, N, out, out_stride,      \
                                     row_end, 1);                                         \
        else                                                                              \
            mxfp4x_bf16dp_gemv_block(w, r, xs, MXFP4X_BF16DP_MR, N, out, out_stride,      \
                                     row_end, 0);                                         \
    }
MXFP4X_BF16DP_GEMV_FULL(1)
MXFP4X_BF16DP_GEMV_FULL(2)
MXFP4X_BF16DP_GEMV_FULL(3)
MXFP4X_BF16DP_GEMV_FULL(4)
MXFP4X_BF16DP_GEMV_FULL(5)

#endif /* MXFP4X_BF16_AVX512BF16_GEMV_H */
