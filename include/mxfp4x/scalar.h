/* mxfp4x/scalar.h -- the specification in portable C.
 *
 * The scalar variant runs on every CPU; it is also the reference the SIMD
 * variants are tested against and the float64 path of the CPU backend.
 *
 * Order of operations (it defines the bits of a result, see mxfp4x.h): each
 * dot product keeps 16 lane accumulators; lane j of group g accumulates
 * element j of the deinterleaved group (w*x, then the add), then element 16+j;
 * the lanes are reduced by the fixed tree of mxfp4x_hsum16_f32.
 * Built with -ffp-contract=off so the compiler cannot fuse mul+add here.
 */
#ifndef MXFP4X_SCALAR_H
#define MXFP4X_SCALAR_H

#include "mxfp4x.h"

/* Fixed pairwise tree: (j, j+8), then (j, j+4), (j, j+2), (0, 1). */
MXFP4X_INLINE float mxfp4x_hsum16_f32(const float *a) {
    float b[8], c[4], d[2];
    int j;
    for (j = 0; j < 8; j++) b[j] = a[j] + a[j + 8];
    for (j = 0; j < 4; j++) c[j] = b[j] + b[j + 4];
    for (j = 0; j < 2; j++) d[j] = c[j] + c[j + 2];
    return d[0] + d[1];
}

/* Decode one group into the deinterleaved order: out[j] = the low nibble of byte j,
 * out[16 + j] = its high nibble (elements 2j, 2j+1 in the pairs arrangement; j, j+16
 * in the halves one), both times the group scale. */
MXFP4X_INLINE void mxfp4x_decode_group_f32_scalar(const uint8_t *b, uint8_t s, float *out) {
    const float sc = mxfp4x_e8m0_f32(s);
    int j;
    for (j = 0; j < 16; j++) {
        out[j] = mxfp4x_e2m1_f32[b[j] & 0xF] * sc;
        out[16 + j] = mxfp4x_e2m1_f32[b[j] >> 4] * sc;
    }
}

/* One group's multiply-adds into 16 accumulators: its 16 low-nibble products, then its
 * 16 high-nibble ones (the layout's order), a multiply and an add apart. */
MXFP4X_INLINE void mxfp4x_fma_group_scalar(const float *wg, const float *xg, float *acc) {
    int j;
    for (j = 0; j < 16; j++) acc[j] = acc[j] + wg[j] * xg[j];
    for (j = 0; j < 16; j++) acc[j] = acc[j] + wg[16 + j] * xg[16 + j];
}

/* Deinterleaved dot product of one row against one latent row. */
MXFP4X_INLINE float mxfp4x_dot_f32_scalar(const float *w, const float *x, int64_t n_groups) {
    float acc[16] = {0};
    int64_t g;
    for (g = 0; g < n_groups; g++)
        mxfp4x_fma_group_scalar(w + g * MXFP4X_GROUP, x + g * MXFP4X_GROUP, acc);
    return mxfp4x_hsum16_f32(acc);
}

/* The microkernel the drivers of generic/ are compiled over (generic/interface.h): plain
 * C floats, a multiply and an add apart (the build never contracts them). */
MXFP4X_INLINE void mxfp4x_decode_store_scalar(const uint8_t *b, uint8_t s,
                                              const mxfp4x_no_tables *t, float *p) {
    (void)t;
    mxfp4x_decode_group_f32_scalar(b, s, p);
}

#define MXFP4X_MK_NAME(name) name##_scalar
#define MXFP4X_MK_FN static
#define MXFP4X_MK_INLINE MXFP4X_INLINE
#define MXFP4X_MK_VEC float
#define MXFP4X_MK_LANES 1
#define MXFP4X_MK_LOAD(p) (*(p))
#define MXFP4X_MK_STORE(p, v) (*(p) = (v))
#define MXFP4X_MK_SET1(f) (f)
#define MXFP4X_MK_ADD(a, b) ((a) + (b))
#define MXFP4X_MK_FMA(a, b, c) ((a) * (b) + (c))
#define MXFP4X_MK_FMA1(a, b, c) ((a) * (b) + (c))
#define MXFP4X_MK_TABLES mxfp4x_no_tables
#define MXFP4X_MK_LOAD_TABLES mxfp4x_no_tables_load
#define MXFP4X_MK_DECODE_STORE mxfp4x_decode_store_scalar
#include "generic/interface.h"
/* The one-token gemv (generic/gemv1.h): a row at a time, 16 accumulators, each group
 * decoded into 32 floats first (no panel in memory). */
#define MXFP4X_MK_GEMV1_MR 1
#define MXFP4X_MK_GEMV1_PREFETCH 0
#define MXFP4X_MK_ROW_ACCS 16
#define MXFP4X_MK_DECODE_GROUP(b, s, t, wv) \
    ((void)(t), mxfp4x_decode_group_f32_scalar((b), (s), (wv)))
#define MXFP4X_MK_FMA_GROUP mxfp4x_fma_group_scalar
#define MXFP4X_MK_HSUM_ACCS mxfp4x_hsum16_f32
#include "generic/gemv1.h"

static void mxfp4x_gemv_f32_scalar(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                   const float *x, int64_t x_stride, const int64_t *x_rows,
                                   int64_t n_tok, float *out, int64_t out_stride) {
    int64_t t;
    for (t = 0; t < n_tok; t++)
        mxfp4x_gemv1_f32_scalar(w, row_start, row_end, x + x_rows[t] * x_stride,
                                out + t * out_stride);
}

#include "generic/decode.h"

/* The scalar kernels are the spec, not a speed target: the driver's defaults (also the
 * float64 path's). */
#define MXFP4X_SCALAR_TILE_ROWS 48
#define MXFP4X_SCALAR_PANEL_BYTES (384 * 1024)
/* panel_dot takes one row at a time (no register block), so a panel may hold any number
 * of rows. */
#define MXFP4X_SCALAR_MR 1
/* The gemv/panel crossover: not measured for scalar code; AVX2's value (gemv decodes the
 * rows again for every token, a panel decodes them once). */
#define MXFP4X_SCALAR_GEMV_MAX_TOKENS 8

/* One row at a time, no scratch. */

static int64_t mxfp4x_panel_scratch_f32_scalar(int64_t n_rows) {
    (void)n_rows;
    return 0;
}

static void mxfp4x_panel_dot_f32_scalar(const float *panel, int64_t n_rows, int64_t n_groups,
                                        const float *x, int64_t x_stride, const int64_t *x_rows,
                                        int64_t n_tok, float *out, int64_t out_stride,
                                        float *scratch) {
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    int64_t t, r;
    (void)scratch;
    for (t = 0; t < n_tok; t++) {
        const float *xt = x + x_rows[t] * x_stride;
        for (r = 0; r < n_rows; r++)
            out[t * out_stride + r] = mxfp4x_dot_f32_scalar(panel + r * d_in, xt, n_groups);
    }
}

/* axpy_rows: each column's terms in row order, 16 columns at a time. */
#define MXFP4X_MK_AXPY_VECS 16
#include "generic/axpy_rows.h"

/* Roofline: 8 independent multiply-add chains (a mul and an add each: the build does not
 * contract them), about the best portable C reaches. */
#define MXFP4X_MK_FMA_CHAINS 8
#include "generic/fma_probe.h"
#include "generic/end.h"

/* Roofline: read n_words 64-bit words once (8 independent sums: the loads, not the adds,
 * are the limit), for the memory read bandwidth. */
static uint64_t mxfp4x_read_words(const uint64_t *p, int64_t n_words) {
    uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    int j;
    for (; i + 8 <= n_words; i += 8)
        for (j = 0; j < 8; j++) a[j] += p[i + j];
    for (; i < n_words; i++) a[0] += p[i];
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

/* ---- dense bf16 rows x float32 tokens (mxfp4x.h, mxfp4x_dense_bf16_fn) ----
 * As the MXFP4 dot product: 16 lane accumulators, lane j sums w[i] x[i] over
 * i = j (mod 16) ascending (multiply, then add), reduced by mxfp4x_hsum16_f32. */
static void mxfp4x_dense_bf16_scalar(const uint16_t *w, int64_t row_stride, int64_t row_start,
                                     int64_t row_end, int64_t d_in, const float *x,
                                     int64_t x_stride, int64_t n_tok, float *out,
                                     int64_t out_stride) {
    int64_t t, r, i;
    for (t = 0; t < n_tok; t++)
        for (r = row_start; r < row_end; r++) {
            const uint16_t *wr = w + r * row_stride;
            const float *xt = x + t * x_stride;
            float acc[16] = {0};
            for (i = 0; i < d_in; i++)
                acc[i & 15] = acc[i & 15] + mxfp4x_bf16_to_f32(wr[i]) * xt[i];
            out[t * out_stride + r - row_start] = mxfp4x_hsum16_f32(acc);
        }
}

/* ---- float64 path (float64 latents): decode exactly, accumulate in binary64 ----
 *
 * Every ISA computes the same numbers in the same order (float64.h's vector forms and the
 * decodes of avx2.h and avx512.h included), so a float64 result has the same bits under
 * every ISA:
 *   decode:    panel[r][j] = e2m1[low nibble of byte j] * scale, panel[r][16 + j] = e2m1[its
 *              high nibble] * scale (exact in binary64: MXFP4X_LAYOUT_16);
 *   panel_dot: four accumulators, acc[j] += panel[i + j] * x[i + j] for i = 0, 4, 8, ...,
 *              each product and each sum rounded once; (acc0 + acc2) + (acc1 + acc3);
 *   axpy_rows: dst[j] += coef[r] * panel[r][j] for r ascending, product and sum rounded. */

/* One group's decode: pg[j] = e2m1[low nibble of byte j] * scale, pg[16 + j] = e2m1[its
 * high nibble] * scale. */
MXFP4X_INLINE void mxfp4x_decode_group_f64_scalar(const uint8_t *bg, uint8_t sb,
                                                  const mxfp4x_no_tables *t, double *pg) {
    const double sc = mxfp4x_e8m0_f64(sb);
    int j;
    (void)t;
    for (j = 0; j < 16; j++) {
        pg[j] = (double)mxfp4x_e2m1_f32[bg[j] & 0xF] * sc;
        pg[16 + j] = (double)mxfp4x_e2m1_f32[bg[j] >> 4] * sc;
    }
}

/* generic/decode_f64.h over it, unsuffixed: the float64 path's kernels of this file are
 * named mxfp4x_*_f64 (the neon entry's too; the core names mxfp4x_decode_f64). */
#define MXFP4X_MK_NAME(name) name
#define MXFP4X_MK_FN static
#define MXFP4X_MK_F64_TABLES mxfp4x_no_tables
#define MXFP4X_MK_F64_LOAD_TABLES mxfp4x_no_tables_load
#define MXFP4X_MK_DECODE_F64 mxfp4x_decode_group_f64_scalar
#include "generic/decode_f64.h"
#include "generic/end.h"

static void mxfp4x_panel_dot_f64(const double *panel, int64_t n_rows, int64_t n_groups,
                                 const double *x, int64_t x_stride, const int64_t *x_rows,
                                 int64_t n_tok, double *out, int64_t out_stride) {
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    int64_t t, r, i;
    int j;
    for (t = 0; t < n_tok; t++) {
        const double *xt = x + x_rows[t] * x_stride;
        for (r = 0; r < n_rows; r++) {
            const double *pr = panel + r * d_in;
            double acc[4] = {0, 0, 0, 0};
            for (i = 0; i < d_in; i += 4)
                for (j = 0; j < 4; j++) acc[j] = acc[j] + pr[i + j] * xt[i + j];
            out[t * out_stride + r] = (acc[0] + acc[2]) + (acc[1] + acc[3]);
        }
    }
}

/* Transposed float64 product: dst[j] += sum_r coef[r] * panel[r][j], r ascending. */
static void mxfp4x_axpy_rows_f64(const double *panel, int64_t n_rows, int64_t width,
                                 const double *coef, double *dst) {
    int64_t r, j;
    for (r = 0; r < n_rows; r++)
        for (j = 0; j < width; j++) dst[j] = dst[j] + coef[r] * panel[r * width + j];
}

/* ---- latent preparation: convert one row to the compute dtype, deinterleaved ---- */

/* Element at position i (natural order) of a row of the given dtype, as float. */
MXFP4X_INLINE float mxfp4x_load_f32(const void *row, int dtype, int64_t i) {
    switch (dtype) {
    case MXFP4X_DTYPE_F32: return ((const float *)row)[i];
    case MXFP4X_DTYPE_BF16: return mxfp4x_bf16_to_f32(((const uint16_t *)row)[i]);
    case MXFP4X_DTYPE_F16: return mxfp4x_f16_to_f32(((const uint16_t *)row)[i]);
    default: return (float)((const double *)row)[i];
    }
}

/* n values of dtype `dtype` as float32 or float64, exactly (the driver passes float64 to
 * the float32 form never): the start of the forward sums (mxfp4x_call's init). */
static void mxfp4x_widen_f32(const void *src, int dtype, int64_t n, float *dst) {
    int64_t i;
    if (dtype == MXFP4X_DTYPE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == MXFP4X_DTYPE_BF16) { /* bit patterns shifted: a vectorised loop */
        const uint16_t *h = (const uint16_t *)src;
        uint32_t *u = (uint32_t *)dst;
        for (i = 0; i < n; i++) u[i] = (uint32_t)h[i] << 16;
    } else if (dtype == MXFP4X_DTYPE_F16) { /* branch-free: a vectorised loop */
        for (i = 0; i < n; i++) dst[i] = mxfp4x_f16_to_f32(((const uint16_t *)src)[i]);
    } else {
        for (i = 0; i < n; i++) dst[i] = mxfp4x_load_f32(src, dtype, i);
    }
}

static void mxfp4x_widen_f64(const void *src, int dtype, int64_t n, double *dst) {
    int64_t i;
    if (dtype == MXFP4X_DTYPE_F64) {
        memcpy(dst, src, (size_t)n * sizeof(double));
        return;
    }
    for (i = 0; i < n; i++) dst[i] = mxfp4x_load_f32(src, dtype, i); /* exact in float */
}

/* Permute one latent row into a kernel layout (mxfp4x_layout_pos, for the experts'
 * arrangement `nibbles`), converting it to float32. */
static void mxfp4x_prepare_x_f32(const void *row, int dtype, int64_t n_groups, int half,
                                 int nibbles, float *dst) {
    const int64_t n = n_groups * MXFP4X_GROUP;
    int64_t i;
    for (i = 0; i < n; i++)
        dst[mxfp4x_layout_pos(i, half, nibbles)] = mxfp4x_load_f32(row, dtype, i);
}

/* The float64 path's layout is MXFP4X_LAYOUT_16 (its decode is mxfp4x_decode_f64). */
static void mxfp4x_prepare_x_f64(const double *row, int64_t n_groups, int nibbles,
                                 double *dst) {
    const int64_t n = n_groups * MXFP4X_GROUP;
    int64_t i;
    for (i = 0; i < n; i++) dst[mxfp4x_layout_pos(i, MXFP4X_LAYOUT_16, nibbles)] = row[i];
}

/* The inverse permutation: a row in a kernel layout back to natural order. */
static void mxfp4x_natural_f32(const float *src, int64_t n_groups, int half, int nibbles,
                               float *dst) {
    const int64_t n = n_groups * MXFP4X_GROUP;
    int64_t i;
    for (i = 0; i < n; i++) dst[i] = src[mxfp4x_layout_pos(i, half, nibbles)];
}

static void mxfp4x_natural_f64(const double *src, int64_t n_groups, int half, int nibbles,
                               double *dst) {
    const int64_t n = n_groups * MXFP4X_GROUP;
    int64_t i;
    for (i = 0; i < n; i++) dst[i] = src[mxfp4x_layout_pos(i, half, nibbles)];
}

/* The same, each value rounded once into dst_dtype (MXFP4X_DTYPE_BF16 or _F16). */
static void mxfp4x_natural_f16s(const float *src, int64_t n_groups, int half, int nibbles,
                                int dst_dtype, uint16_t *dst) {
    const int64_t n = n_groups * MXFP4X_GROUP;
    int64_t i;
    for (i = 0; i < n; i++) {
        const float v = src[mxfp4x_layout_pos(i, half, nibbles)];
        dst[i] = dst_dtype == MXFP4X_DTYPE_BF16 ? mxfp4x_bits_to_bf16(mxfp4x_f32_to_bits(v))
                                                : mxfp4x_f32_to_f16(v);
    }
}

#endif /* MXFP4X_SCALAR_H */
