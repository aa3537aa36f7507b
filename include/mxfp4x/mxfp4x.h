/* mxfp4x/mxfp4x.h -- the public C API: the format (format.h), the decode tables
 * (tables.h), prefetch (prefetch.h) and 16-bit conversions (convert.h), and here the
 * kernel signatures, an ISA's kernel table and the description of one driver call. */
#ifndef MXFP4X_H
#define MXFP4X_H

#include "format.h"
#include "tables.h"
#include "prefetch.h"
#include "convert.h"

/* Kernel signatures (one implementation per ISA, see dispatch.h).
 *
 * All three compute, for every (row, token) pair, the same dot product with
 * the same operations in the same order, so a result does not depend on which
 * of them produced it (batch invariance):
 *
 *   gemv:      out[t * out_stride + r - row_start] = W[r] . x[x_rows[t]]
 *              fused, weights decoded in registers (for one or a few tokens)
 *   decode:    panel[(r - row_start) * d_in + i] = W[r][i] (the ISA's layout)
 *   panel_dot: out[t * out_stride + r] = panel[r] . x[x_rows[t]]; `scratch` holds
 *              panel_scratch_floats(n_rows) floats (the ISA's own blocking)
 */
typedef void (*mxfp4x_gemv_f32_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                   const float *x, int64_t x_stride, const int64_t *x_rows,
                                   int64_t n_tok, float *out, int64_t out_stride);
typedef void (*mxfp4x_decode_f32_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                     float *panel);
typedef void (*mxfp4x_panel_dot_f32_fn)(const float *panel, int64_t n_rows, int64_t n_groups,
                                        const float *x, int64_t x_stride, const int64_t *x_rows,
                                        int64_t n_tok, float *out, int64_t out_stride,
                                        float *scratch);
typedef int64_t (*mxfp4x_scratch_fn)(int64_t n_rows);

/* The ISA's float32 multiply-add peak, for the roofline: `iters` rounds of independent
 * register-resident multiply-adds; returns their result (so nothing is optimised away)
 * and sets *flops to the floating-point operations done. */
typedef float (*mxfp4x_fma_loop_fn)(int64_t iters, float seed, int64_t *flops);

/* Transposed product (gradient of the latents): dst[j] += sum_r coef[r] * panel[r][j],
 * r ascending for every j (one multiply-add per term, as the ISA does them). */
typedef void (*mxfp4x_axpy_rows_f32_fn)(const float *panel, int64_t n_rows, int64_t width,
                                        const float *coef, float *dst);

/* The float64 path (float64 latents): decode, panel_dot and axpy_rows as above in binary64,
 * with one arithmetic for every ISA (scalar.h states it), so the entries' forms differ in
 * speed only and a float64 result's bits do not depend on the ISA. */
typedef void (*mxfp4x_decode_f64_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                     double *panel);
typedef void (*mxfp4x_panel_dot_f64_fn)(const double *panel, int64_t n_rows, int64_t n_groups,
                                        const double *x, int64_t x_stride,
                                        const int64_t *x_rows, int64_t n_tok, double *out,
                                        int64_t out_stride);
typedef void (*mxfp4x_axpy_rows_f64_fn)(const double *panel, int64_t n_rows, int64_t width,
                                        const double *coef, double *dst);

/* Dense bfloat16 rows times float32 tokens (the dense projections around the experts,
 * which checkpoints ship in bf16): for r in [row_start, row_end), t < n_tok,
 *   out[t * out_stride + r - row_start] = sum_i W[r][i] * x[t * x_stride + i]
 * W[r] at w + r * row_stride (uint16 bf16 bits, d_in of them).  Each bf16 weight widens
 * to float32 exactly (a shift); products and sums in float32, in each ISA's lanes and
 * reduction tree, the same for every (row, token) whatever n_tok or the row range: the
 * bits depend on neither the batch nor the thread split. */
typedef void (*mxfp4x_dense_bf16_fn)(const uint16_t *w, int64_t row_stride, int64_t row_start,
                                     int64_t row_end, int64_t d_in, const float *x,
                                     int64_t x_stride, int64_t n_tok, float *out,
                                     int64_t out_stride);
/* The same with bf16 tokens (x: their uint16 bits): the same bits as the entry's
 * dense_bf16 on the tokens widened to float32. */
typedef void (*mxfp4x_dense_bf16x_fn)(const uint16_t *w, int64_t row_stride,
                                      int64_t row_start, int64_t row_end, int64_t d_in,
                                      const uint16_t *x, int64_t x_stride, int64_t n_tok,
                                      float *out, int64_t out_stride);

/* bfloat16 latents on a bf16 dot-product unit (amx.h): gather n pairs' latents (token
 * rows src[i] of x, bf16 bits) into the unit's blocks at dst (n * d_in elements, 64 bytes
 * of slack after), flagging in unsafe[i] a token the unit could not take exactly; then
 * out[t * out_stride + r - row_start] = W[r] . x_t for the gathered tokens. */
typedef void (*mxfp4x_bf16_gather_fn)(const uint16_t *x, int64_t x_stride, const int64_t *src,
                                      int64_t n, int64_t n_groups, int nibbles, uint16_t *dst,
                                      uint8_t *unsafe);
typedef void (*mxfp4x_bf16_rows_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                    const uint16_t *xt, const uint8_t *unsafe, int64_t n_tok,
                                    float *out, int64_t out_stride, void *scratch);
typedef int64_t (*mxfp4x_bf16_scratch_fn)(int64_t n_groups);
typedef int (*mxfp4x_count_fn)(void);

/* The driver uses gemv for experts with at most gemv_max_tokens tokens in a call (a
 * per-ISA crossover, measured: each ISA's header, docs/performance.md; dispatch.h's
 * mxfp4x_gemv_switch may move it for a core), and decode + panel_dot above it (where the panel's store and
 * reload pay off). */

typedef struct {
    int isa;
    const char *name;
    int layout_half;     /* element order inside a group, see mxfp4x_layout_pos */
    int panel_row_block; /* panel_dot's rows per register block: panels hold a multiple */
    int gemv_max_tokens; /* gemv up to this many tokens per expert, panels above */
    int tile_rows;       /* output rows of W per forward task (a multiple of the blocks;
                            the driver may take up to 4 tiles per task, _core/cpu.pyx) */
    int64_t panel_bytes; /* decoded rows a thread holds at once (float32 panel) */
    mxfp4x_gemv_f32_fn gemv_f32;
    mxfp4x_decode_f32_fn decode_f32;
    mxfp4x_panel_dot_f32_fn panel_dot_f32;
    mxfp4x_scratch_fn panel_scratch_floats; /* floats of panel_dot scratch for n_rows */
    mxfp4x_axpy_rows_f32_fn axpy_rows_f32;
    mxfp4x_decode_f64_fn decode_f64;       /* the float64 path (same bits on every entry) */
    mxfp4x_panel_dot_f64_fn panel_dot_f64;
    mxfp4x_axpy_rows_f64_fn axpy_rows_f64;
    mxfp4x_fma_loop_fn fma_loop;          /* roofline only */
    mxfp4x_dense_bf16_fn dense_bf16;      /* dense bf16 rows x float32 tokens */
    mxfp4x_dense_bf16x_fn dense_bf16x;    /* ... x bf16 tokens (NULL: widen them to
                                             float32 for dense_bf16) */
    /* bf16 rows x bf16 tokens on the bf16 unit, in its arithmetic (dense/avx512bf16.h;
     * the driver's calls of 5 to 16 tokens, _core/cpu_dense.pxi; NULL: none) */
    mxfp4x_dense_bf16x_fn dense_bf16_unit;
    /* bf16 latents of a float32 forward call (NULL: converted to float32 for gemv_f32 /
     * panel_dot_f32): the gather of an expert's tokens and the rows' product (amx.h) */
    mxfp4x_bf16_gather_fn bf16_gather;
    mxfp4x_bf16_rows_fn bf16_rows;
    mxfp4x_bf16_scratch_fn bf16_scratch_bytes;
    /* bf16_rows' own switch on this CPU: registers up to this many tokens per expert */
    mxfp4x_count_fn bf16_gemv_max_tokens;
    /* roofline only: the bf16 unit's multiply-add peak, as fma_loop (NULL: not measured;
     * the float32 peak stands in) */
    mxfp4x_fma_loop_fn bf16_dot_loop;
} mxfp4x_kernels;

/* ---- one call of the CPU driver, described once ------------------------------
 *
 * Built from tensors in one place (mxfp4x/_core/cpu_impl.py through the Call type of
 * mxfp4x/_core/cpu.pyx), checked in one place (cpu.pyx, _check_call), and read by
 * the one driver skeleton.  Modes are named fields, never inferred from shapes.
 */

/* The experts: expert e's rows are rows[e] (stacked or one tensor each: any
 * mix of base pointers and strides), all of one arrangement (rows[e].nibbles). */
typedef struct {
    int64_t n_experts, d_out, n_groups;
    const mxfp4x_rows *rows;
} mxfp4x_experts;

enum { MXFP4X_FORWARD = 0, MXFP4X_TRANSPOSED = 1 };          /* product */
enum { MXFP4X_ROWS_PER_TOKEN = 0, MXFP4X_ROWS_PER_SLOT = 1 }; /* rows of an operand */

/* For every pair p = t * top_k + k with e = selected[p] and w = mix ? mix[p] : 1:
 *
 *   FORWARD     src: latents (rows, d_in) of src_dtype; dst: (rows, d_out) of dst_dtype.
 *               mix given:  dst[t]  = start[t] + sum of w * (W_e src[row_src(p)])
 *                           start: init (n_tokens, d_out) of init_dtype, or (init NULL)
 *                           dst's own values
 *               mix NULL:   dst[p]   = W_e src[row_src(p)]         (per-slot outputs)
 *   TRANSPOSED  src: gradient (rows, d_out) of src_dtype; dst: (rows, d_in) of dst_dtype:
 *                           dst[row_dst(p)] = sum over its pairs of w * (W_e^T src[row_src(p)])
 *
 * Every sum is taken in compute and rounded once into dst_dtype, which is compute or,
 * with float32 compute, bfloat16 or float16 (a forward call then has init wherever it
 * has mix); init_dtype and a transposed call's src_dtype convert exactly into compute.
 * Rows in natural element order.  row_src(p) = p if src_rows is PER_SLOT else t, and
 * likewise row_dst.  mix is given exactly when the d_out side is per token (the
 * products are summed over the slots there). */
typedef struct {
    int product;                    /* MXFP4X_FORWARD or MXFP4X_TRANSPOSED */
    int compute;                    /* MXFP4X_DTYPE_F32 or _F64: accumulation */
    const mxfp4x_kernels *kernels;  /* the ISA this call runs (its float64 kernels for
                                       float64 compute) */
    int n_threads;
    mxfp4x_experts experts;
    int64_t n_tokens, top_k;
    const int64_t *selected;        /* (n_tokens, top_k); ids checked while routing */
    const void *mix;                /* (n_tokens, top_k) of compute, or NULL */
    const void *src;
    int src_dtype;                  /* MXFP4X_DTYPE_*: any for FORWARD, exact otherwise */
    int src_rows;                   /* MXFP4X_ROWS_* */
    void *dst;
    int dst_rows;                   /* MXFP4X_ROWS_* */
    int dst_dtype;                  /* compute; with float32 compute: or BF16, F16 */
    const void *init;               /* FORWARD with mix: the start of each sum, or NULL */
    int init_dtype;                 /* MXFP4X_DTYPE_* of init */
} mxfp4x_call;

#endif /* MXFP4X_H */
