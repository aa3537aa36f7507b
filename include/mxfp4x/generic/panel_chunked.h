/* mxfp4x/generic/panel_chunked.h -- panel_dot_f32 over k-chunks: decoded panel rows x
 * tokens in register blocks of up to MXFP4X_MK_PANEL_MR rows x MXFP4X_MK_PANEL_NT tokens,
 * k in chunks of MXFP4X_MK_PANEL_KC floats (the block's rows stay in L1 while the tokens
 * stream past), tokens in super-blocks of MXFP4X_MK_PANEL_TOKENS (the scratch stays
 * bounded, the latents L2-sized).  Between chunks each (row, token)'s accumulators are
 * parked unreduced in the scratch, MXFP4X_MK_PANEL_PARK floats each, so every lane's
 * sequence is the unchunked one; after the last chunk MXFP4X_MK_HSUM_PARKED(lanes)
 * reduces them by the entry's tree.
 *
 * The entry supplies the register block, always inlined:
 *   MXFP4X_MK_NAME(mxfp4x_block)(ps, mr, xs, nt, k0, k1, lanes)
 * ps[0..mr) the rows, xs[0..nt) the tokens, lanes[(r * NT + c) * PARK ...] the parked
 * accumulators of (row r, token c), loaded, advanced over [k0, k1), stored back;
 * mxfp4x_block_switch below calls it with constant (mr, nt), so each edge is compiled
 * with its accumulators in registers. */

MXFP4X_STATIC_ASSERT(MXFP4X_MK_PANEL_TOKENS % MXFP4X_MK_PANEL_NT == 0, "whole token blocks");
MXFP4X_STATIC_ASSERT(MXFP4X_MK_PANEL_KC % MXFP4X_GROUP == 0, "chunks of whole groups");
MXFP4X_STATIC_ASSERT(MXFP4X_MK_PANEL_NT == 4, "the switch below names tokens 4, 3, 2 and 1");
MXFP4X_STATIC_ASSERT(MXFP4X_MK_PANEL_MR >= 2 && MXFP4X_MK_PANEL_MR <= 4, "rows 4 (3) 2 1");

/* The register block specialised by (mr, nt) at compile time through constant arguments,
 * rows and tokens descending. */
MXFP4X_MK_FN void MXFP4X_MK_NAME(mxfp4x_block_switch)(const float *const *ps, int mr,
                                                      const float *const *xs, int nt,
                                                      int64_t k0, int64_t k1, float *lanes) {
#define MXFP4X_MK_BLOCK_CASE(M, N)                                                         \
    case (M) * 8 + (N): MXFP4X_MK_NAME(mxfp4x_block)(ps, M, xs, N, k0, k1, lanes); break;
#define MXFP4X_MK_BLOCK_ROW(M)                                                             \
    MXFP4X_MK_BLOCK_CASE(M, 4) MXFP4X_MK_BLOCK_CASE(M, 3)                                  \
    MXFP4X_MK_BLOCK_CASE(M, 2) MXFP4X_MK_BLOCK_CASE(M, 1)
    switch (mr * 8 + nt) {
#if MXFP4X_MK_PANEL_MR >= 4
        MXFP4X_MK_BLOCK_ROW(4)
#endif
#if MXFP4X_MK_PANEL_MR >= 3
        MXFP4X_MK_BLOCK_ROW(3)
#endif
        MXFP4X_MK_BLOCK_ROW(2)
        MXFP4X_MK_BLOCK_ROW(1)
        default: break;
    }
#undef MXFP4X_MK_BLOCK_ROW
#undef MXFP4X_MK_BLOCK_CASE
}

/* panel_dot's scratch: the parked accumulators of every block of one super-block. */
static int64_t MXFP4X_MK_NAME(mxfp4x_panel_scratch_f32)(int64_t n_rows) {
    return ((n_rows + MXFP4X_MK_PANEL_MR - 1) / MXFP4X_MK_PANEL_MR) *
           (MXFP4X_MK_PANEL_TOKENS / MXFP4X_MK_PANEL_NT) *
           (MXFP4X_MK_PANEL_MR * MXFP4X_MK_PANEL_NT * MXFP4X_MK_PANEL_PARK);
}

MXFP4X_MK_FN void MXFP4X_MK_NAME(mxfp4x_panel_dot_f32)(const float *panel, int64_t n_rows,
                                                       int64_t n_groups, const float *x,
                                                       int64_t x_stride, const int64_t *x_rows,
                                                       int64_t n_tok, float *out,
                                                       int64_t out_stride, float *scratch) {
    enum {
        MR = MXFP4X_MK_PANEL_MR, NT = MXFP4X_MK_PANEL_NT, TOKENS = MXFP4X_MK_PANEL_TOKENS,
        KC = MXFP4X_MK_PANEL_KC, PARK = MXFP4X_MK_PANEL_PARK, BLOCK = MR * NT * PARK
    };
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    int64_t t0, k0, r, t;
    int c, rr;
    if (d_in == 0) { /* empty dot products: the k loop below would write nothing */
        for (t = 0; t < n_tok; t++)
            for (r = 0; r < n_rows; r++) out[t * out_stride + r] = 0.0f;
        return;
    }
    for (t0 = 0; t0 < n_tok; t0 += TOKENS) {
        const int64_t t1 = t0 + TOKENS < n_tok ? t0 + TOKENS : n_tok;
        for (k0 = 0; k0 < d_in; k0 += KC) {
            const int64_t k1 = k0 + KC < d_in ? k0 + KC : d_in;
            for (r = 0; r < n_rows; r += MR) {
                const int mr = n_rows - r < MR ? (int)(n_rows - r) : MR;
                const float *ps[MR];
                for (rr = 0; rr < MR; rr++) ps[rr] = panel + (r + (rr < mr ? rr : 0)) * d_in;
                for (t = t0; t < t1; t += NT) {
                    const int nt = t1 - t < NT ? (int)(t1 - t) : NT;
                    const float *xs[NT];
                    float *lb = scratch + ((r / MR) * (TOKENS / NT) + (t - t0) / NT) * BLOCK;
                    for (c = 0; c < nt; c++) xs[c] = x + x_rows[t + c] * x_stride;
                    if (k0 == 0) memset(lb, 0, BLOCK * sizeof(float));
                    MXFP4X_MK_NAME(mxfp4x_block_switch)(ps, mr, xs, nt, k0, k1, lb);
                    if (k1 == d_in)
                        for (rr = 0; rr < mr; rr++)
                            for (c = 0; c < nt; c++)
                                out[(t + c) * out_stride + r + rr] =
                                    MXFP4X_MK_HSUM_PARKED(lb + (rr * NT + c) * PARK);
                }
            }
        }
    }
}
