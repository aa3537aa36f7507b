/* mxfp4x/generic/decode.h -- decode_f32: rows [row_start, row_end) into a panel of
 * floats, one row after another, each group through MXFP4X_MK_DECODE_STORE (the
 * microkernel interface: generic/interface.h). */

MXFP4X_MK_FN void MXFP4X_MK_NAME(mxfp4x_decode_f32)(const mxfp4x_rows *w, int64_t row_start,
                                                    int64_t row_end, float *panel) {
    const MXFP4X_MK_TABLES t = MXFP4X_MK_LOAD_TABLES();
    const int64_t d_in = w->n_groups * MXFP4X_GROUP;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t r, g;
    for (r = row_start; r < row_end; r++) {
        const uint8_t *b = w->blocks + r * w->row_stride_blocks;
        const uint8_t *s = w->scales + r * w->row_stride_scales;
        float *p = panel + (r - row_start) * d_in;
        for (g = 0; g < w->n_groups; g++)
            MXFP4X_MK_DECODE_STORE(b + g * gb, s[g * gs], &t, p + g * MXFP4X_GROUP);
    }
}
