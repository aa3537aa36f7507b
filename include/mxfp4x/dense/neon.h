/* mxfp4x/dense/neon.h -- the dense bf16 kernels of the neon entry (the dense
 * product of mxfp4x.h's mxfp4x_dense_bf16_fn), apart from its MXFP4 kernels.  Included
 * by neon.h only, at its end, inside its macros (MXFP4X_NEON_*). */
#ifndef MXFP4X_DENSE_NEON_H
#define MXFP4X_DENSE_NEON_H

/* ---- dense bf16 rows x float32 tokens (mxfp4x.h, mxfp4x_dense_bf16_fn) ----
 * One 4-lane accumulator per (row, token): lane l sums w[i] x[i] over i = l (mod 4)
 * ascending, with fmla (bf16 widened exactly: ushll by 16); the last d_in % 4 elements
 * through zero-filled copies; lanes reduced as (0 + 2) + (1 + 3).  Blocks of up to 4
 * rows x 4 tokens. */
MXFP4X_NEON_INLINE float32x4_t mxfp4x_bf16x4_neon(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

MXFP4X_NEON_INLINE float mxfp4x_neon_hsum1(float32x4_t a) {
    const float32x2_t d = vadd_f32(vget_low_f32(a), vget_high_f32(a));
    return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);
}

MXFP4X_NEON_INLINE void mxfp4x_dense_block_neon(const uint16_t *w, int64_t rs, int64_t d_in,
                                                const float *x, int64_t xs, int mr, int nt,
                                                float *out, int64_t os) {
    float32x4_t a[4][4], xv[4], wv;
    const int64_t body = d_in & ~(int64_t)3;
    int64_t k;
    int i, c;
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) a[i][c] = vdupq_n_f32(0.0f);
    for (k = 0; k < body; k += 4) {
        for (c = 0; c < nt; c++) xv[c] = vld1q_f32(x + c * xs + k);
        for (i = 0; i < mr; i++) {
            wv = mxfp4x_bf16x4_neon(w + i * rs + k);
            for (c = 0; c < nt; c++) a[i][c] = vfmaq_f32(a[i][c], wv, xv[c]);
        }
    }
    if (body < d_in) {
        const int n = (int)(d_in - body);
        uint16_t wt[4];
        float xt[4];
        for (c = 0; c < nt; c++) {
            memset(xt, 0, sizeof xt);
            memcpy(xt, x + c * xs + body, (size_t)n * sizeof(float));
            xv[c] = vld1q_f32(xt);
        }
        for (i = 0; i < mr; i++) {
            memset(wt, 0, sizeof wt);
            memcpy(wt, w + i * rs + body, (size_t)n * sizeof(uint16_t));
            wv = mxfp4x_bf16x4_neon(wt);
            for (c = 0; c < nt; c++) a[i][c] = vfmaq_f32(a[i][c], wv, xv[c]);
        }
    }
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) out[c * os + i] = mxfp4x_neon_hsum1(a[i][c]);
}

#define MXFP4X_NEON_DENSE_CASE(M, N)                                                       \
    case (M) * 8 + (N):                                                                    \
        mxfp4x_dense_block_neon(w + r * row_stride, row_stride, d_in, xt, x_stride, M, N, o, \
                                out_stride);                                               \
        break;
#define MXFP4X_NEON_DENSE_ROW(M)                                                           \
    MXFP4X_NEON_DENSE_CASE(M, 1) MXFP4X_NEON_DENSE_CASE(M, 2)                              \
    MXFP4X_NEON_DENSE_CASE(M, 3) MXFP4X_NEON_DENSE_CASE(M, 4)

MXFP4X_NEON_FN void mxfp4x_dense_bf16_neon(const uint16_t *w, int64_t row_stride,
                                           int64_t row_start, int64_t row_end, int64_t d_in,
                                           const float *x, int64_t x_stride, int64_t n_tok,
                                           float *out, int64_t out_stride) {
    int64_t t, r;
    for (t = 0; t < n_tok; t += 4) {
        const int nt = n_tok - t < 4 ? (int)(n_tok - t) : 4;
        const float *xt = x + t * x_stride;
        for (r = row_start; r < row_end; r += 4) {
            const int mr = row_end - r < 4 ? (int)(row_end - r) : 4;
            float *o = out + t * out_stride + (r - row_start);
            switch (mr * 8 + nt) {
                MXFP4X_NEON_DENSE_ROW(4)
                MXFP4X_NEON_DENSE_ROW(3)
                MXFP4X_NEON_DENSE_ROW(2)
                MXFP4X_NEON_DENSE_ROW(1)
            default: break;
            }
        }
    }
}

#endif /* MXFP4X_DENSE_NEON_H */
