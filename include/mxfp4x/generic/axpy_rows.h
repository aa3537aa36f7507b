/* mxfp4x/generic/axpy_rows.h -- axpy_rows_f32: dst[j] += sum_r coef[r] * panel[r][j], r
 * ascending, one MXFP4X_MK_FMA per term.  Columns in blocks of MXFP4X_MK_AXPY_VECS
 * vectors held in registers while the rows stream past, then one vector at a time, then
 * one column at a time (MXFP4X_MK_FMA1): each column's sequence is the same whichever
 * part takes it. */

MXFP4X_MK_FN void MXFP4X_MK_NAME(mxfp4x_axpy_rows_f32)(const float *panel, int64_t n_rows,
                                                       int64_t width, const float *coef,
                                                       float *dst) {
    enum { V = MXFP4X_MK_AXPY_VECS, L = MXFP4X_MK_LANES };
    int64_t j = 0, r;
    int c;
    for (; j + V * L <= width; j += V * L) {
        MXFP4X_MK_VEC a[V];
        for (c = 0; c < V; c++) a[c] = MXFP4X_MK_LOAD(dst + j + L * c);
        for (r = 0; r < n_rows; r++) {
            const MXFP4X_MK_VEC cf = MXFP4X_MK_SET1(coef[r]);
            const float *p = panel + r * width + j;
            for (c = 0; c < V; c++) a[c] = MXFP4X_MK_FMA(cf, MXFP4X_MK_LOAD(p + L * c), a[c]);
        }
        for (c = 0; c < V; c++) MXFP4X_MK_STORE(dst + j + L * c, a[c]);
    }
    for (; j + L <= width; j += L) {
        MXFP4X_MK_VEC a = MXFP4X_MK_LOAD(dst + j);
        for (r = 0; r < n_rows; r++)
            a = MXFP4X_MK_FMA(MXFP4X_MK_SET1(coef[r]), MXFP4X_MK_LOAD(panel + r * width + j), a);
        MXFP4X_MK_STORE(dst + j, a);
    }
    for (; j < width; j++) {
        float a = dst[j];
        for (r = 0; r < n_rows; r++) a = MXFP4X_MK_FMA1(coef[r], panel[r * width + j], a);
        dst[j] = a;
    }
}
