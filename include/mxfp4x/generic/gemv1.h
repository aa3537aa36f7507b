/* mxfp4x/generic/gemv1.h -- gemv1_f32: the one-token fused gemv.  Rows go in blocks of
 * MXFP4X_MK_GEMV1_MR (independent chains hide the FMA latency behind the decodes), the
 * rows left over one at a time; every row runs the same steps either way: per group, its
 * decode (MXFP4X_MK_DECODE_GROUP into 32 / MXFP4X_MK_LANES vectors) and its multiply-adds
 * into the row's MXFP4X_MK_ROW_ACCS accumulators (MXFP4X_MK_FMA_GROUP, in the order the
 * entry's header states), then one horizontal sum (MXFP4X_MK_HSUM_ACCS).  With
 * MXFP4X_MK_GEMV1_PREFETCH the block after next is fetched while a block runs
 * (prefetch.h). */

MXFP4X_MK_FN void MXFP4X_MK_NAME(mxfp4x_gemv1_f32)(const mxfp4x_rows *w, int64_t row_start,
                                                   int64_t row_end, const float *x,
                                                   float *out) {
    enum { MR = MXFP4X_MK_GEMV1_MR, ACCS = MXFP4X_MK_ROW_ACCS };
    const MXFP4X_MK_TABLES t = MXFP4X_MK_LOAD_TABLES();
    const int64_t G = w->n_groups, sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t r = row_start, g;
    int i, j;
    MXFP4X_MK_VEC wv[MXFP4X_GROUP / MXFP4X_MK_LANES];
    for (; r + MR <= row_end; r += MR) {
        const uint8_t *b0 = w->blocks + r * sb;
        const uint8_t *s0 = w->scales + r * ss;
#if MXFP4X_MK_GEMV1_PREFETCH
        mxfp4x_pf_cursor pf = mxfp4x_pf_next_block(w, r, MR, row_end);
#endif
        MXFP4X_MK_VEC a[MR][ACCS];
        for (i = 0; i < MR; i++)
            for (j = 0; j < ACCS; j++) a[i][j] = MXFP4X_MK_SET1(0.0f);
        const uint8_t *bg = b0, *sg = s0;
        for (g = 0; g < G; g++, bg += gb, sg += gs) {
            const float *xg = x + g * MXFP4X_GROUP;
#if MXFP4X_MK_GEMV1_PREFETCH
            MXFP4X_PF_STEP(pf, g);
#endif
            for (i = 0; i < MR; i++) {
                MXFP4X_MK_DECODE_GROUP(bg + i * sb, sg[i * ss], &t, wv);
                MXFP4X_MK_FMA_GROUP(wv, xg, a[i]);
            }
        }
        for (i = 0; i < MR; i++) out[r + i - row_start] = MXFP4X_MK_HSUM_ACCS(a[i]);
    }
    for (; r < row_end; r++) {
        const uint8_t *b = w->blocks + r * sb;
        const uint8_t *s = w->scales + r * ss;
        MXFP4X_MK_VEC a[ACCS];
        for (j = 0; j < ACCS; j++) a[j] = MXFP4X_MK_SET1(0.0f);
        for (g = 0; g < G; g++) {
            MXFP4X_MK_DECODE_GROUP(b + g * gb, s[g * gs], &t, wv);
            MXFP4X_MK_FMA_GROUP(wv, x + g * MXFP4X_GROUP, a);
        }
        out[r - row_start] = MXFP4X_MK_HSUM_ACCS(a);
    }
}
