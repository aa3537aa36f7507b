/* mxfp4x/generic/dense_bf16.h -- dense_bf16: dense bf16 rows x float32 tokens (mxfp4x.h,
 * mxfp4x_dense_bf16_fn).  One MXFP4X_MK_LANES-lane accumulator per (row, token): lane l
 * sums w[i] x[i] over i = l (mod LANES) ascending with MXFP4X_MK_FMA, the bf16 widened
 * exactly by MXFP4X_MK_BF16_LOAD(p) (LANES bf16 at p -> a vector); the last d_in % LANES
 * elements through zero-filled copies; lanes reduced by MXFP4X_MK_HSUM(v), the entry's
 * tree.  Blocks of up to 4 rows x 4 tokens; one token alone in blocks of up to
 * MXFP4X_MK_DENSE_MR1 rows (more row streams in flight: the same chain per row, so the
 * same bits).  With MXFP4X_MK_DENSE_PREFETCH, one line per row MXFP4X_DENSE_PREFETCH
 * bytes ahead per 64 bytes of row (config.h). */

MXFP4X_STATIC_ASSERT(MXFP4X_MK_DENSE_MR1 >= 4 && MXFP4X_MK_DENSE_MR1 <= 8,
                     "the one-token switch below names rows 8 (7 6 5) 4 3 2 1");
MXFP4X_STATIC_ASSERT(32 % MXFP4X_MK_LANES == 0, "a 64-byte line of bf16 in whole steps");

MXFP4X_MK_INLINE void MXFP4X_MK_NAME(mxfp4x_dense_block)(const uint16_t *w, int64_t rs,
                                                        int64_t d_in, const float *x,
                                                        int64_t xs, int mr, int nt,
                                                        float *out, int64_t os) {
    enum { L = MXFP4X_MK_LANES };
    MXFP4X_MK_VEC a[MXFP4X_MK_DENSE_MR1][4], xv[4], wv; /* up to MR1 rows x 1 token or 4 x 4 */
    const int64_t body = d_in & ~(int64_t)(L - 1);
    int64_t k;
#if MXFP4X_MK_DENSE_PREFETCH
    const int64_t wrap = MXFP4X_DENSE_WRAP(mr, rs, d_in);
#endif
    int i, c;
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) a[i][c] = MXFP4X_MK_SET1(0.0f);
    for (k = 0; k < body; k += L) {
#if MXFP4X_MK_DENSE_PREFETCH
        if (!(k & 31)) { /* one line per row, MXFP4X_DENSE_PREFETCH bytes ahead (config.h) */
            const int64_t ahead = MXFP4X_DENSE_AHEAD(k, MXFP4X_DENSE_PREFETCH, d_in, wrap);
            for (i = 0; i < mr; i++)
                MXFP4X_PREFETCH_L2((const char *)(w + i * rs + k) + ahead);
        }
#endif
        for (c = 0; c < nt; c++) xv[c] = MXFP4X_MK_LOAD(x + c * xs + k);
        for (i = 0; i < mr; i++) {
            wv = MXFP4X_MK_BF16_LOAD(w + i * rs + k);
            for (c = 0; c < nt; c++) a[i][c] = MXFP4X_MK_FMA(wv, xv[c], a[i][c]);
        }
    }
    if (body < d_in) {
        const int n = (int)(d_in - body);
        uint16_t wt[L];
        float xt[L];
        for (c = 0; c < nt; c++) {
            memset(xt, 0, sizeof xt);
            memcpy(xt, x + c * xs + body, (size_t)n * sizeof(float));
            xv[c] = MXFP4X_MK_LOAD(xt);
        }
        for (i = 0; i < mr; i++) {
            memset(wt, 0, sizeof wt);
            memcpy(wt, w + i * rs + body, (size_t)n * sizeof(uint16_t));
            wv = MXFP4X_MK_BF16_LOAD(wt);
            for (c = 0; c < nt; c++) a[i][c] = MXFP4X_MK_FMA(wv, xv[c], a[i][c]);
        }
    }
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) out[c * os + i] = MXFP4X_MK_HSUM(a[i][c]);
}

/* Constant (mr, nt) per case, so each block's accumulators stay in registers. */
#define MXFP4X_MK_DENSE_CASE(M, N)                                                         \
    case (M) * 8 + (N):                                                                    \
        MXFP4X_MK_NAME(mxfp4x_dense_block)(w + r * row_stride, row_stride, d_in, xt,       \
                                           x_stride, M, N, o, out_stride);                 \
        break;
#define MXFP4X_MK_DENSE_ROW(M)                                                             \
    MXFP4X_MK_DENSE_CASE(M, 1) MXFP4X_MK_DENSE_CASE(M, 2)                                  \
    MXFP4X_MK_DENSE_CASE(M, 3) MXFP4X_MK_DENSE_CASE(M, 4)

MXFP4X_MK_FN void MXFP4X_MK_NAME(mxfp4x_dense_bf16)(const uint16_t *w, int64_t row_stride,
                                                    int64_t row_start, int64_t row_end,
                                                    int64_t d_in, const float *x,
                                                    int64_t x_stride, int64_t n_tok,
                                                    float *out, int64_t out_stride) {
    enum { MR1 = MXFP4X_MK_DENSE_MR1 };
    int64_t t, r;
    for (t = 0; t < n_tok; t += 4) {
        const int nt = n_tok - t < 4 ? (int)(n_tok - t) : 4;
        const float *xt = x + t * x_stride;
#if MXFP4X_MK_DENSE_MR1 > 4
        if (nt == 1) { /* one token: blocks of up to MR1 rows */
            for (r = row_start; r < row_end; r += MR1) {
                const int mr = row_end - r < MR1 ? (int)(row_end - r) : MR1;
                float *o = out + t * out_stride + (r - row_start);
                switch (mr * 8 + 1) {
#if MXFP4X_MK_DENSE_MR1 >= 8
                    MXFP4X_MK_DENSE_CASE(8, 1)
#endif
#if MXFP4X_MK_DENSE_MR1 >= 7
                    MXFP4X_MK_DENSE_CASE(7, 1)
#endif
#if MXFP4X_MK_DENSE_MR1 >= 6
                    MXFP4X_MK_DENSE_CASE(6, 1)
#endif
                    MXFP4X_MK_DENSE_CASE(5, 1) MXFP4X_MK_DENSE_CASE(4, 1)
                    MXFP4X_MK_DENSE_CASE(3, 1) MXFP4X_MK_DENSE_CASE(2, 1)
                    MXFP4X_MK_DENSE_CASE(1, 1)
                default: break;
                }
            }
            continue;
        }
#endif
        for (r = row_start; r < row_end; r += 4) {
            const int mr = row_end - r < 4 ? (int)(row_end - r) : 4;
            float *o = out + t * out_stride + (r - row_start);
            switch (mr * 8 + nt) {
                MXFP4X_MK_DENSE_ROW(4)
                MXFP4X_MK_DENSE_ROW(3)
                MXFP4X_MK_DENSE_ROW(2)
                MXFP4X_MK_DENSE_ROW(1)
            default: break;
            }
        }
    }
}

#undef MXFP4X_MK_DENSE_ROW
#undef MXFP4X_MK_DENSE_CASE
