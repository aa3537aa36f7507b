/* mxfp4x/float64.h -- the float64 path's panel_dot and axpy_rows in 256-bit vectors,
 * written once and compiled twice: by avx2.h (native AVX2: the avx2 entry) and by avx512.h
 * (the AVX-512 entries; under MXFP4X_EMULATE_AVX512 through SIMDe like the rest of
 * avx512.h, so the emulated entry runs on any x86-64).  No include guard: the includer
 * defines MXFP4X_F64_NAME(name) (the name with its suffix), MXFP4X_F64_FN,
 * MXFP4X_F64_INLINE and MXFP4X_F64_NOINLINE (its target attributes), undefined at the end.
 *
 * The arithmetic is scalar.h's, bit for bit (the C checker's f64 check): one 4-lane
 * accumulator per (row, token) is scalar.h's acc[0..3], lane j adding the product of
 * elements i + j, multiply and add apart (no FMA); at the end lanes (0, 2) and (1, 3), then
 * the two.  Blocks of 8 rows for one token (eight add chains in flight) and 4 rows x 2
 * tokens; the edges through the same inlined form.  Faster than scalar.h's kernels, more so
 * with each entry's own decode (a Zen 4: docs/performance.md, "The bf16 units, AMX and
 * float64"). */

MXFP4X_F64_INLINE void MXFP4X_F64_NAME(mxfp4x_dot_block_f64)(const double *panel,
                                                            int64_t d_in, int64_t r, int mr,
                                                            const double *const *xs, int nt,
                                                            double *out, int64_t out_stride) {
    __m256d acc[8][2];
    int64_t k;
    int i, t;
    for (i = 0; i < mr; i++)
        for (t = 0; t < nt; t++) acc[i][t] = _mm256_setzero_pd();
    for (k = 0; k < d_in; k += 4)
        for (t = 0; t < nt; t++) {
            const __m256d x = _mm256_loadu_pd(xs[t] + k);
            for (i = 0; i < mr; i++)
                acc[i][t] = _mm256_add_pd(
                    acc[i][t], _mm256_mul_pd(_mm256_loadu_pd(panel + (r + i) * d_in + k), x));
        }
    for (i = 0; i < mr; i++)
        for (t = 0; t < nt; t++) {
            const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(acc[i][t]),
                                         _mm256_extractf128_pd(acc[i][t], 1));
            out[t * out_stride + r + i] = _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
        }
}

MXFP4X_F64_NOINLINE void MXFP4X_F64_NAME(mxfp4x_dot_8x1_f64)(const double *panel,
                                                            int64_t d_in, int64_t r,
                                                            const double *const *xs,
                                                            double *out, int64_t out_stride) {
    MXFP4X_F64_NAME(mxfp4x_dot_block_f64)(panel, d_in, r, 8, xs, 1, out, out_stride);
}

MXFP4X_F64_NOINLINE void MXFP4X_F64_NAME(mxfp4x_dot_4x2_f64)(const double *panel,
                                                            int64_t d_in, int64_t r,
                                                            const double *const *xs,
                                                            double *out, int64_t out_stride) {
    MXFP4X_F64_NAME(mxfp4x_dot_block_f64)(panel, d_in, r, 4, xs, 2, out, out_stride);
}

MXFP4X_F64_NOINLINE void MXFP4X_F64_NAME(mxfp4x_dot_edge_f64)(const double *panel,
                                                             int64_t d_in, int64_t r, int mr,
                                                             const double *const *xs, int nt,
                                                             double *out, int64_t out_stride) {
    MXFP4X_F64_NAME(mxfp4x_dot_block_f64)(panel, d_in, r, mr, xs, nt, out, out_stride);
}

MXFP4X_F64_FN void MXFP4X_F64_NAME(mxfp4x_panel_dot_f64)(const double *panel, int64_t n_rows,
                                                        int64_t n_groups, const double *x,
                                                        int64_t x_stride,
                                                        const int64_t *x_rows, int64_t n_tok,
                                                        double *out, int64_t out_stride) {
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    int64_t t, r;
    for (t = 0; t < n_tok; t += 2) {
        const int nt = n_tok - t < 2 ? 1 : 2;
        const double *xs[2];
        double *o = out + t * out_stride;
        xs[0] = x + x_rows[t] * x_stride;
        xs[1] = nt == 2 ? x + x_rows[t + 1] * x_stride : xs[0];
        r = 0;
        if (nt == 1)
            for (; r + 8 <= n_rows; r += 8)
                MXFP4X_F64_NAME(mxfp4x_dot_8x1_f64)(panel, d_in, r, xs, o, out_stride);
        for (; r + 4 <= n_rows; r += 4) {
            if (nt == 2)
                MXFP4X_F64_NAME(mxfp4x_dot_4x2_f64)(panel, d_in, r, xs, o, out_stride);
            else
                MXFP4X_F64_NAME(mxfp4x_dot_edge_f64)(panel, d_in, r, 4, xs, 1, o, out_stride);
        }
        if (r < n_rows)
            MXFP4X_F64_NAME(mxfp4x_dot_edge_f64)(panel, d_in, r, (int)(n_rows - r), xs, nt, o,
                                                 out_stride);
    }
}

/* dst[j] += coef[r] * panel[r][j], r ascending: 32 columns at a time, a scalar tail. */
MXFP4X_F64_FN void MXFP4X_F64_NAME(mxfp4x_axpy_rows_f64)(const double *panel, int64_t n_rows,
                                                        int64_t width, const double *coef,
                                                        double *dst) {
    int64_t j = 0, r;
    int c;
    for (; j + 32 <= width; j += 32) {
        __m256d a[8];
        for (c = 0; c < 8; c++) a[c] = _mm256_loadu_pd(dst + j + 4 * c);
        for (r = 0; r < n_rows; r++) {
            const __m256d cf = _mm256_set1_pd(coef[r]);
            const double *p = panel + r * width + j;
            for (c = 0; c < 8; c++)
                a[c] = _mm256_add_pd(a[c], _mm256_mul_pd(cf, _mm256_loadu_pd(p + 4 * c)));
        }
        for (c = 0; c < 8; c++) _mm256_storeu_pd(dst + j + 4 * c, a[c]);
    }
    for (; j < width; j++) {
        __m128d a = _mm_set_sd(dst[j]);
        for (r = 0; r < n_rows; r++)
            a = _mm_add_sd(a, _mm_mul_sd(_mm_set_sd(coef[r]), _mm_set_sd(panel[r * width + j])));
        dst[j] = _mm_cvtsd_f64(a);
    }
}

#undef MXFP4X_F64_NAME
#undef MXFP4X_F64_FN
#undef MXFP4X_F64_INLINE
#undef MXFP4X_F64_NOINLINE
