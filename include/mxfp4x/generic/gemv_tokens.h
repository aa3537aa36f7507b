/* mxfp4x/generic/gemv_tokens.h -- gemv_f32: tokens in groups of MXFP4X_MK_GEMV_NT = 4,
 * each group through the entry's MXFP4X_MK_NAME(mxfp4x_gemv_tokens) with a constant token
 * count (its accumulators stay in registers), a lone token through its one-token
 * MXFP4X_MK_NAME(mxfp4x_gemv1_f32).  Every (row, token) runs the same steps in both, so a
 * token's bits do not depend on the tokens beside it. */

MXFP4X_STATIC_ASSERT(MXFP4X_MK_GEMV_NT == 4, "the switch below names 4, 3, 2 and 1");

MXFP4X_MK_FN void MXFP4X_MK_NAME(mxfp4x_gemv_f32)(const mxfp4x_rows *w, int64_t row_start,
                                                  int64_t row_end, const float *x,
                                                  int64_t x_stride, const int64_t *x_rows,
                                                  int64_t n_tok, float *out,
                                                  int64_t out_stride) {
    enum { NT = MXFP4X_MK_GEMV_NT };
    int64_t t;
    int c;
    for (t = 0; t < n_tok; t += NT) {
        const int nt = n_tok - t < NT ? (int)(n_tok - t) : NT;
        const float *xs[NT];
        float *o = out + t * out_stride;
        for (c = 0; c < nt; c++) xs[c] = x + x_rows[t + c] * x_stride;
#define MXFP4X_MK_TOKENS_CASE(N)                                                           \
    case N: MXFP4X_MK_NAME(mxfp4x_gemv_tokens)(w, row_start, row_end, xs, N, o, out_stride); break;
        switch (nt) {
            MXFP4X_MK_TOKENS_CASE(4)
            MXFP4X_MK_TOKENS_CASE(3)
            MXFP4X_MK_TOKENS_CASE(2)
        default: MXFP4X_MK_NAME(mxfp4x_gemv1_f32)(w, row_start, row_end, xs[0], o); break;
        }
#undef MXFP4X_MK_TOKENS_CASE
    }
}
