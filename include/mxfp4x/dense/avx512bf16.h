/* mxfp4x/dense/avx512bf16.h -- the dense bf16 product on vdpbf16ps (mxfp4x.h,
 * mxfp4x_kernels.dense_bf16_unit): bf16 rows times bf16 tokens (the driver's calls of 5 to
 * 16 tokens, mxfp4x/_core/cpu_dense.pxi).  Included by avx512bf16.h only, inside its
 * target region.
 *
 * Per (row, token) 16 float32 lanes, one vdpbf16ps per chunk of 32 elements (the last one
 * zero-filled), chunks ascending, then mxfp4x_hsum16_avx512:
 *
 *     acc = vdpbf16ps(acc, W[32m .. 32m + 31], x[32m .. 32m + 31])   for m = 0 .. M - 1
 *
 * so lane l sums elements 32m + 2l and 32m + 2l + 1 of every chunk, in the unit's pair
 * order.  Every blocking of rows and tokens issues the same instructions on the same
 * operands in the same order: a token's result depends neither on the other tokens of the
 * call nor on the threads.  The unit's arithmetic, not the exact kernels' (dense/avx512.h,
 * up to 4 tokens): products exact, sums rounded to nearest even, subnormal inputs read as
 * zero and subnormal results flushed -- what torch's own bf16 product computes on these
 * CPUs, which this replaces from 5 tokens on (docs/guarantees.md).
 *
 * Blocks of 4 rows x 4 tokens (16 accumulators): each block of rows runs against the
 * tokens four at a time while its rows are in L1, the first pass prefetching the rows'
 * lines MXFP4X_DENSE_PREFETCH bytes on into L2 (as the exact kernels' blocks do). */
#ifndef MXFP4X_DENSE_AVX512BF16_H
#define MXFP4X_DENSE_AVX512BF16_H

/* mr rows x nt tokens (constants after inlining) over every chunk */
MXFP4X_BF16DP_INLINE void mxfp4x_dense_unit_block(const uint16_t *w, int64_t rs, int64_t d_in,
                                                  const uint16_t *x, int64_t xs, const int mr,
                                                  const int nt, float *out, int64_t os,
                                                  const int pf) {
    __m512 a[4][4];
    __m512bh wv[4];
    const int64_t body = d_in & ~(int64_t)31;
    const int64_t wrap = MXFP4X_DENSE_WRAP(mr, rs, d_in);
    int64_t k;
    int i, c;
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) a[i][c] = _mm512_setzero_ps();
    for (k = 0; k < body; k += 32) {
        const int64_t ahead = MXFP4X_DENSE_AHEAD(k, MXFP4X_DENSE_PREFETCH, d_in, wrap);
        for (i = 0; i < mr; i++) {
            const uint16_t *p = w + i * rs + k;
            if (pf)
                MXFP4X_PREFETCH_L2((const char *)p + ahead);
            wv[i] = (__m512bh)_mm512_loadu_si512((const void *)p);
        }
        for (c = 0; c < nt; c++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + c * xs + k));
            for (i = 0; i < mr; i++) a[i][c] = _mm512_dpbf16_ps(a[i][c], wv[i], xv);
        }
    }
    if (body < d_in) { /* the last chunk through zero-filled copies: its zero lanes add +0 */
        const size_t n = (size_t)(d_in - body) * sizeof(uint16_t);
        MXFP4X_ALIGN64 uint16_t t[32];
        for (i = 0; i < mr; i++) {
            memset(t, 0, sizeof t);
            memcpy(t, w + i * rs + body, n);
            wv[i] = (__m512bh)_mm512_load_si512((const void *)t);
        }
        for (c = 0; c < nt; c++) {
            __m512bh xv;
            memset(t, 0, sizeof t);
            memcpy(t, x + c * xs + body, n);
            xv = (__m512bh)_mm512_load_si512((const void *)t);
            for (i = 0; i < mr; i++) a[i][c] = _mm512_dpbf16_ps(a[i][c], wv[i], xv);
        }
    }
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) out[c * os + i] = mxfp4x_hsum16_avx512(a[i][c]);
}

/* mr rows from w against every token, four at a time; the first pass prefetches */
MXFP4X_BF16DP_INLINE void mxfp4x_dense_unit_rows(const uint16_t *w, int64_t rs, int64_t d_in,
                                                 const uint16_t *x, int64_t xs, int64_t n_tok,
                                                 const int mr, float *out, int64_t os) {
    int64_t t;
    for (t = 0; t < n_tok; t += 4) {
        const int64_t left = n_tok - t;
        const uint16_t *xt = x + t * xs;
        float *ot = out + t * os;
        const int pf = t == 0;
        if (left >= 4)
            mxfp4x_dense_unit_block(w, rs, d_in, xt, xs, mr, 4, ot, os, pf);
        else if (left == 3)
            mxfp4x_dense_unit_block(w, rs, d_in, xt, xs, mr, 3, ot, os, pf);
        else if (left == 2)
            mxfp4x_dense_unit_block(w, rs, d_in, xt, xs, mr, 2, ot, os, pf);
        else
            mxfp4x_dense_unit_block(w, rs, d_in, xt, xs, mr, 1, ot, os, pf);
    }
}

MXFP4X_BF16DP_FN void mxfp4x_dense_bf16_unit(const uint16_t *w, int64_t row_stride,
                                             int64_t row_start, int64_t row_end, int64_t d_in,
                                             const uint16_t *x, int64_t x_stride,
                                             int64_t n_tok, float *out, int64_t out_stride) {
    int64_t r = row_start;
    for (; r + 4 <= row_end; r += 4)
        mxfp4x_dense_unit_rows(w + r * row_stride, row_stride, d_in, x, x_stride, n_tok, 4,
                               out + (r - row_start), out_stride);
    for (; r < row_end; r++)
        mxfp4x_dense_unit_rows(w + r * row_stride, row_stride, d_in, x, x_stride, n_tok, 1,
                               out + (r - row_start), out_stride);
}

#endif /* MXFP4X_DENSE_AVX512BF16_H */
