/* mxfp4x/dense/avx2.h -- the dense bf16 kernels of the avx2 entry (the dense
 * product of mxfp4x.h's mxfp4x_dense_bf16_fn), apart from its MXFP4 kernels.  Included
 * by avx2.h only, at its end, inside its target region (MXFP4X_AVX2_*). */
#ifndef MXFP4X_DENSE_AVX2_H
#define MXFP4X_DENSE_AVX2_H

/* ---- dense bf16 rows x float32 tokens (mxfp4x.h, mxfp4x_dense_bf16_fn) ----
 * One 8-lane accumulator per (row, token): lane l sums w[i] x[i] over i = l (mod 8)
 * ascending, with FMA (bf16 widened exactly: vpmovzxwd + a 16-bit shift); the last
 * d_in % 8 elements through zero-filled copies; lanes reduced by mxfp4x_hsum8_avx2.
 * Blocks of up to 4 rows x 4 tokens (8 rows at one token), as avx512.h's. */
MXFP4X_AVX2_INLINE __m256 mxfp4x_bf16x8_avx2(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

MXFP4X_AVX2_INLINE void mxfp4x_dense_block_avx2(const uint16_t *w, int64_t rs, int64_t d_in,
                                                const float *x, int64_t xs, int mr, int nt,
                                                float *out, int64_t os) {
    __m256 a[8][4], xv[4], wv; /* up to 8 rows x 1 token or 4 x 4 */
    const int64_t body = d_in & ~(int64_t)7;
    int64_t k;
    const int64_t wrap = MXFP4X_DENSE_WRAP(mr, rs, d_in);
    int i, c;
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) a[i][c] = _mm256_setzero_ps();
    for (k = 0; k < body; k += 8) {
        if (!(k & 31)) { /* one line per row, MXFP4X_DENSE_PREFETCH bytes ahead (config.h) */
            const int64_t ahead = MXFP4X_DENSE_AHEAD(k, MXFP4X_DENSE_PREFETCH, d_in, wrap);
            for (i = 0; i < mr; i++)
                MXFP4X_PREFETCH_L2((const char *)(w + i * rs + k) + ahead);
        }
        for (c = 0; c < nt; c++) xv[c] = _mm256_loadu_ps(x + c * xs + k);
        for (i = 0; i < mr; i++) {
            wv = mxfp4x_bf16x8_avx2(w + i * rs + k);
            for (c = 0; c < nt; c++) a[i][c] = _mm256_fmadd_ps(wv, xv[c], a[i][c]);
        }
    }
    if (body < d_in) {
        const int n = (int)(d_in - body);
        uint16_t wt[8];
        float xt[8];
        for (c = 0; c < nt; c++) {
            memset(xt, 0, sizeof xt);
            memcpy(xt, x + c * xs + body, (size_t)n * sizeof(float));
            xv[c] = _mm256_loadu_ps(xt);
        }
        for (i = 0; i < mr; i++) {
            memset(wt, 0, sizeof wt);
            memcpy(wt, w + i * rs + body, (size_t)n * sizeof(uint16_t));
            wv = mxfp4x_bf16x8_avx2(wt);
            for (c = 0; c < nt; c++) a[i][c] = _mm256_fmadd_ps(wv, xv[c], a[i][c]);
        }
    }
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) out[c * os + i] = mxfp4x_hsum8_avx2(a[i][c]);
}

#define MXFP4X_AVX2_DENSE_CASE(M, N)                                                       \
    case (M) * 8 + (N):                                                                    \
        mxfp4x_dense_block_avx2(w + r * row_stride, row_stride, d_in, xt, x_stride, M, N, o, \
                                out_stride);                                               \
        break;
#define MXFP4X_AVX2_DENSE_ROW(M)                                                           \
    MXFP4X_AVX2_DENSE_CASE(M, 1) MXFP4X_AVX2_DENSE_CASE(M, 2)                              \
    MXFP4X_AVX2_DENSE_CASE(M, 3) MXFP4X_AVX2_DENSE_CASE(M, 4)

MXFP4X_AVX2_FN void mxfp4x_dense_bf16_avx2(const uint16_t *w, int64_t row_stride,
                                           int64_t row_start, int64_t row_end, int64_t d_in,
                                           const float *x, int64_t x_stride, int64_t n_tok,
                                           float *out, int64_t out_stride) {
    int64_t t, r;
    for (t = 0; t < n_tok; t += 4) {
        const int nt = n_tok - t < 4 ? (int)(n_tok - t) : 4;
        const float *xt = x + t * x_stride;
        if (nt == 1) { /* one token: blocks of up to 8 rows, eight row streams in flight
                          * (the same chain per row, so the same bits as blocks of 4) */
            for (r = row_start; r < row_end; r += 8) {
                const int mr = row_end - r < 8 ? (int)(row_end - r) : 8;
                float *o = out + t * out_stride + (r - row_start);
                switch (mr * 8 + 1) {
                    MXFP4X_AVX2_DENSE_CASE(8, 1) MXFP4X_AVX2_DENSE_CASE(7, 1)
                    MXFP4X_AVX2_DENSE_CASE(6, 1) MXFP4X_AVX2_DENSE_CASE(5, 1)
                    MXFP4X_AVX2_DENSE_CASE(4, 1) MXFP4X_AVX2_DENSE_CASE(3, 1)
                    MXFP4X_AVX2_DENSE_CASE(2, 1) MXFP4X_AVX2_DENSE_CASE(1, 1)
                default: break;
                }
            }
            continue;
        }
        for (r = row_start; r < row_end; r += 4) {
            const int mr = row_end - r < 4 ? (int)(row_end - r) : 4;
            float *o = out + t * out_stride + (r - row_start);
            switch (mr * 8 + nt) {
                MXFP4X_AVX2_DENSE_ROW(4)
                MXFP4X_AVX2_DENSE_ROW(3)
                MXFP4X_AVX2_DENSE_ROW(2)
                MXFP4X_AVX2_DENSE_ROW(1)
            default: break;
            }
        }
    }
}

#endif /* MXFP4X_DENSE_AVX2_H */
