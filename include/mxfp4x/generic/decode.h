/* mxfp4x/generic/decode.h -- decode_f32: rows [row_start, row_end) into a panel of
 * floats, one row after another, each group through MXFP4X_MK_DECODE_STORE (the
 * microkernel interface: generic/interface.h).  The same loop, included by
 * generic/decode_f64.h (MXFP4X_MK_DECODE_AS_F64), is the float64 path's decode_f64: a
 * panel of doubles, each group through MXFP4X_MK_DECODE_F64 with the constants of
 * MXFP4X_MK_F64_TABLES. */

#ifdef MXFP4X_MK_DECODE_AS_F64
#define MXFP4X_MK_DEC_NAME MXFP4X_MK_NAME(mxfp4x_decode_f64)
#define MXFP4X_MK_DEC_T double
#define MXFP4X_MK_DEC_TABLES MXFP4X_MK_F64_TABLES
#define MXFP4X_MK_DEC_LOAD_TABLES MXFP4X_MK_F64_LOAD_TABLES
#define MXFP4X_MK_DEC_GROUP MXFP4X_MK_DECODE_F64
#else
#define MXFP4X_MK_DEC_NAME MXFP4X_MK_NAME(mxfp4x_decode_f32)
#define MXFP4X_MK_DEC_T float
#define MXFP4X_MK_DEC_TABLES MXFP4X_MK_TABLES
#define MXFP4X_MK_DEC_LOAD_TABLES MXFP4X_MK_LOAD_TABLES
#define MXFP4X_MK_DEC_GROUP MXFP4X_MK_DECODE_STORE
#endif

MXFP4X_MK_FN void MXFP4X_MK_DEC_NAME(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                     MXFP4X_MK_DEC_T *panel) {
    const MXFP4X_MK_DEC_TABLES t = MXFP4X_MK_DEC_LOAD_TABLES();
    const int64_t d_in = w->n_groups * MXFP4X_GROUP;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t r, g;
    for (r = row_start; r < row_end; r++) {
        const uint8_t *b = w->blocks + r * w->row_stride_blocks;
        const uint8_t *s = w->scales + r * w->row_stride_scales;
        MXFP4X_MK_DEC_T *p = panel + (r - row_start) * d_in;
        for (g = 0; g < w->n_groups; g++)
            MXFP4X_MK_DEC_GROUP(b + g * gb, s[g * gs], &t, p + g * MXFP4X_GROUP);
    }
}

#undef MXFP4X_MK_DEC_NAME
#undef MXFP4X_MK_DEC_T
#undef MXFP4X_MK_DEC_TABLES
#undef MXFP4X_MK_DEC_LOAD_TABLES
#undef MXFP4X_MK_DEC_GROUP
