/* mxfp4x/activation.h -- what runs between an MoE layer's two expert products, in one pass
 * over rows: gpt-oss's clamped SwiGLU on the gate/up outputs (with their bias), the down
 * projection's bias weighted by the routing weights, and Kimi K3's SiTU times its
 * clipped up branch; and gpt-oss's RMS norm (before each attention and each MLP).
 *
 * Plain C on float32 (no intrinsics, no contraction: the build passes -ffp-contract=off),
 * so the compiler's vectors change no bit: every element is computed alone, by the same
 * operations in the same order, whatever the ISA, the row's position or the thread.  A
 * row is handled in chunks of MXFP4X_ACT_CHUNK elements through arrays on the stack, so
 * each loop is a simple one over floats. */
#ifndef MXFP4X_ACTIVATION_H
#define MXFP4X_ACTIVATION_H

#include <math.h>

#include "convert.h"
#include "format.h"

#define MXFP4X_ACT_CHUNK 256

/* a where c holds, else b: chosen on the bits, so that a loop of it has no branch to
 * vectorise around (GCC keeps a float ?: a branch under -ftrapping-math). */
MXFP4X_INLINE float mxfp4x_act_pick(int c, float a, float b) {
    const uint32_t m = 0u - (uint32_t)(c != 0);
    return mxfp4x_bits_to_f32((m & mxfp4x_f32_to_bits(a)) | (~m & mxfp4x_f32_to_bits(b)));
}

/* e^x in float32, within 1 ulp where the result is a normal float (docs/guarantees.md);
 * +inf above ~88.72, subnormal then 0 below ~-87.3, NaN for NaN.  x = n ln 2 + r,
 * |r| <= ln 2 / 2: n by rounding x / ln 2 (the 1.5 * 2^23 addition), r by Cody and
 * Waite's two-part ln 2 (n times its high part is exact), e^r by Cephes' degree-6
 * polynomial, 2^n applied as two powers of two so that n may reach -150 and 129 (the
 * first product is exact, the second rounds once).  Branch-free: a loop of it
 * vectorises. */
MXFP4X_INLINE float mxfp4x_expf(float x) {
    const int nan = x != x;
    float xc = mxfp4x_act_pick(x > 89.0f, 89.0f, x);
    float t, nf, r, z, p;
    int32_t n, h;
    xc = mxfp4x_act_pick(xc < -104.0f, -104.0f, xc);
    xc = mxfp4x_act_pick(nan, 0.0f, xc); /* a NaN: anything finite, replaced at the end */
    /* t's low mantissa bits hold n: 1.5 * 2^23 has an ulp of 1 */
    t = xc * 1.44269504088896341f + 12582912.0f;
    nf = t - 12582912.0f;
    n = (int32_t)(mxfp4x_f32_to_bits(t) - 0x4B400000u);
    r = xc - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    z = r * r;
    p = (((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r +
           4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * z + r + 1.0f;
    h = n / 2;
    p = p * mxfp4x_bits_to_f32((uint32_t)(h + 127) << 23) *
        mxfp4x_bits_to_f32((uint32_t)(n - h + 127) << 23);
    return mxfp4x_act_pick(nan, x, p);
}

/* sigmoid(z) = 1 / (1 + e^-z) for z >= 0, e^z / (1 + e^z) for z < 0: the second form
 * where e^-z would overflow (z < -88.7: 1 / (1 + e^-z) would be 0, the true value a
 * subnormal down to z = -103.9), so one division either way; within 2.5 ulps where the
 * result is normal. */
MXFP4X_INLINE float mxfp4x_sigmoidf(float z) {
    const float e = mxfp4x_expf(mxfp4x_act_pick(z < 0.0f, z, -z)); /* e^-|z| */
    return mxfp4x_act_pick(z < 0.0f, e, 1.0f) / (1.0f + e);
}

/* tanh(x) in float32 within 1.6 ulps where the result is normal: below |x| = 0.625
 * Cephes' odd polynomial x + x^3 P(x^2), above
 * (1 - e^-2|x|) / (1 + e^-2|x|) with x's sign (no cancellation there: e^-2|x| < 0.29);
 * NaN for NaN, +-1 from |x| ~ 9. */
MXFP4X_INLINE float mxfp4x_tanhf(float x) {
    const float a = mxfp4x_bits_to_f32(mxfp4x_f32_to_bits(x) & 0x7FFFFFFFu);
    const float z = x * x;
    const float small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) *
                              z + 1.33314422036e-1f) * z - 3.33332819422e-1f) * z * x + x;
    const float e = mxfp4x_expf(-2.0f * a);
    const float large = (1.0f - e) / (1.0f + e);
    const float signed_large = mxfp4x_bits_to_f32(mxfp4x_f32_to_bits(large) |
                                                  (mxfp4x_f32_to_bits(x) & 0x80000000u));
    return mxfp4x_act_pick(a < 0.625f, small, signed_large);
}

/* n float32 values of a row from its storage (MXFP4X_DTYPE_F32, _BF16 or _F16), elements
 * first, first + step, ...: exact. */
MXFP4X_INLINE void mxfp4x_act_load(const void *src, int dtype, int64_t first, int64_t step,
                                   int64_t n, float *dst) {
    int64_t i;
    if (dtype == MXFP4X_DTYPE_F32) {
        const float *s = (const float *)src + first;
        for (i = 0; i < n; i++) dst[i] = s[i * step];
    } else if (dtype == MXFP4X_DTYPE_BF16) {
        const uint16_t *s = (const uint16_t *)src + first;
        for (i = 0; i < n; i++) dst[i] = mxfp4x_bf16_to_f32(s[i * step]);
    } else {
        const uint16_t *s = (const uint16_t *)src + first;
        for (i = 0; i < n; i++) dst[i] = mxfp4x_f16_to_f32(s[i * step]);
    }
}

/* n float32 values into dtype's storage at dst (float32, or rounded once to bf16 / f16). */
MXFP4X_INLINE void mxfp4x_act_store(const float *src, int64_t n, int dtype, void *dst) {
    if (dtype == MXFP4X_DTYPE_F32)
        memcpy(dst, src, (size_t)n * sizeof(float));
    else
        mxfp4x_store_f16s(src, n, dtype, (uint16_t *)dst);
}

/* gpt-oss's activation of rows [r0, r1) of gate_up (n_rows, 2 * d_ff) of dtype in_dtype,
 * the gate in the even columns and the up in the odd ones, into out (n_rows, d_ff) of
 * dtype out_dtype:
 *
 *     g = gate + bias[ids[r]][2j],  u = up + bias[ids[r]][2j + 1]   (no bias: bias NULL)
 *     g = min(g, limit),  u = min(max(u, -limit), limit)             (a NaN stays NaN)
 *     out[r][j] = (u + 1) * (g * sigmoid(g * alpha))
 *
 * each operation a float32 one in this order (sigmoid: mxfp4x_sigmoidf), the result
 * rounded once into out_dtype.  ids[r] must lie in the bias's rows (the caller checks). */
typedef struct {
    const void *gate_up;
    int in_dtype;
    const void *bias; /* (n_experts, 2 * d_ff) of dtype bias_dtype, or NULL */
    int bias_dtype;
    const int64_t *ids;
    int64_t d_ff;
    float limit, alpha;
    void *out;
    int out_dtype;
} mxfp4x_swiglu_args;

MXFP4X_INLINE void mxfp4x_gpt_oss_swiglu_body(const mxfp4x_swiglu_args *x, int64_t r0,
                                              int64_t r1) {
    float g[MXFP4X_ACT_CHUNK], u[MXFP4X_ACT_CHUNK], a[MXFP4X_ACT_CHUNK];
    float bg[MXFP4X_ACT_CHUNK], bu[MXFP4X_ACT_CHUNK];
    const int64_t d_ff = x->d_ff;
    const size_t bias_size = x->bias_dtype == MXFP4X_DTYPE_F32 ? 4 : 2;
    const float limit = x->limit, alpha = x->alpha;
    const size_t in_size = x->in_dtype == MXFP4X_DTYPE_F32 ? 4 : 2;
    const size_t out_size = x->out_dtype == MXFP4X_DTYPE_F32 ? 4 : 2;
    int64_t r, j0, i, n;
    for (r = r0; r < r1; r++) {
        const char *row = (const char *)x->gate_up + (size_t)r * (size_t)(2 * d_ff) * in_size;
        const char *b =
            x->bias ? (const char *)x->bias + (size_t)x->ids[r] * (size_t)(2 * d_ff) * bias_size
                    : NULL;
        char *o = (char *)x->out + (size_t)r * (size_t)d_ff * out_size;
        for (j0 = 0; j0 < d_ff; j0 += n) {
            n = d_ff - j0 < MXFP4X_ACT_CHUNK ? d_ff - j0 : MXFP4X_ACT_CHUNK;
            mxfp4x_act_load(row, x->in_dtype, 2 * j0, 2, n, g);
            mxfp4x_act_load(row, x->in_dtype, 2 * j0 + 1, 2, n, u);
            if (b) {
                mxfp4x_act_load(b, x->bias_dtype, 2 * j0, 2, n, bg);
                mxfp4x_act_load(b, x->bias_dtype, 2 * j0 + 1, 2, n, bu);
                for (i = 0; i < n; i++) {
                    g[i] = g[i] + bg[i];
                    u[i] = u[i] + bu[i];
                }
            }
            for (i = 0; i < n; i++) {
                const float gi = mxfp4x_act_pick(g[i] > limit, limit, g[i]);
                float ui = mxfp4x_act_pick(u[i] < -limit, -limit, u[i]);
                ui = mxfp4x_act_pick(ui > limit, limit, ui);
                a[i] = (ui + 1.0f) * (gi * mxfp4x_sigmoidf(gi * alpha));
            }
            mxfp4x_act_store(a, n, x->out_dtype, o + (size_t)j0 * out_size);
        }
    }
}

/* Rows [t0, t1) of out (n_tokens, d) float32: out[t] = sum over k < top_k, in order from
 * 0, of weights[t][k] * rows[ids[t][k]] (each product and sum a float32 operation; ids
 * in the rows' range, checked by the caller).  The down projection's bias of gpt-oss,
 * weighted as its outputs are. */
typedef struct {
    const float *weights; /* (n_tokens, top_k) */
    const void *rows;     /* (n_rows, d) of dtype rows_dtype */
    int rows_dtype;
    const int64_t *ids;   /* (n_tokens, top_k) */
    int64_t top_k, d;
    float *out;
} mxfp4x_mix_args;

MXFP4X_INLINE void mxfp4x_mix_rows_body(const mxfp4x_mix_args *x, int64_t t0, int64_t t1) {
    float s[MXFP4X_ACT_CHUNK];
    const int64_t top_k = x->top_k, d = x->d;
    int64_t t, k, i, i0, n;
    for (t = t0; t < t1; t++) {
        float *o = x->out + t * d;
        for (i = 0; i < d; i++) o[i] = 0.0f;
        for (k = 0; k < top_k; k++) {
            const float w = x->weights[t * top_k + k];
            const int64_t row = x->ids[t * top_k + k] * d;
            for (i0 = 0; i0 < d; i0 += n) {
                n = d - i0 < MXFP4X_ACT_CHUNK ? d - i0 : MXFP4X_ACT_CHUNK;
                mxfp4x_act_load(x->rows, x->rows_dtype, row + i0, 1, n, s);
                for (i = 0; i < n; i++) o[i0 + i] = o[i0 + i] + w * s[i];
            }
        }
    }
}

/* Kimi K3's activation of rows: for outer o < n_outer and inner i < n_inner, the gate row
 * at element (o * outer + i * inner) of gate and the up row at the same offset of up
 * (both of dtype in_dtype, d elements each, contiguous), into out row o * n_inner + i
 * (out_dtype):
 *
 *     out = (beta * tanh(g / beta)) * sigmoid(g) * clip(u),
 *     clip(u) = beta_lin * tanh(u / beta_lin), or u where beta_lin is 0 (no clip)
 *
 * each operation a float32 one in this order (SiTU, then the product with the clipped
 * up, as torch computes it), tanh by mxfp4x_tanhf, sigmoid by mxfp4x_sigmoidf, rounded
 * once into out_dtype. */
typedef struct {
    const void *gate, *up;
    int in_dtype;
    int64_t n_inner, outer, inner, d;
    float beta, beta_lin;
    void *out;
    int out_dtype;
} mxfp4x_situ_args;

MXFP4X_INLINE void mxfp4x_situ_glu_body(const mxfp4x_situ_args *x, int64_t r0, int64_t r1) {
    float g[MXFP4X_ACT_CHUNK], u[MXFP4X_ACT_CHUNK], a[MXFP4X_ACT_CHUNK];
    const float beta = x->beta, lin = x->beta_lin;
    const size_t in_size = x->in_dtype == MXFP4X_DTYPE_F32 ? 4 : 2;
    const size_t out_size = x->out_dtype == MXFP4X_DTYPE_F32 ? 4 : 2;
    int64_t r, j0, i, n;
    for (r = r0; r < r1; r++) {
        const int64_t off = (r / x->n_inner) * x->outer + (r % x->n_inner) * x->inner;
        char *o = (char *)x->out + (size_t)r * (size_t)x->d * out_size;
        for (j0 = 0; j0 < x->d; j0 += n) {
            n = x->d - j0 < MXFP4X_ACT_CHUNK ? x->d - j0 : MXFP4X_ACT_CHUNK;
            mxfp4x_act_load((const char *)x->gate + (size_t)off * in_size, x->in_dtype, j0, 1,
                            n, g);
            mxfp4x_act_load((const char *)x->up + (size_t)off * in_size, x->in_dtype, j0, 1,
                            n, u);
            if (lin > 0.0f)
                for (i = 0; i < n; i++) u[i] = lin * mxfp4x_tanhf(u[i] / lin);
            for (i = 0; i < n; i++)
                a[i] = beta * mxfp4x_tanhf(g[i] / beta) * mxfp4x_sigmoidf(g[i]) * u[i];
            mxfp4x_act_store(a, n, x->out_dtype, o + (size_t)j0 * out_size);
        }
    }
}

/* gpt-oss's RMS norm of rows [r0, r1) of x (n_rows, d) of dtype in_dtype into out (same
 * shape, out_dtype), as transformers' GptOssRMSNorm computes it:
 *
 *     var = mean(x^2),  h = x * (1 / sqrt(var + eps)),  out = weight * h
 *
 * each operation a float32 one in this order, rounded once into out_dtype, except the
 * mean: the squares of the float32 values (exact in double) summed in double, in 8 lanes
 * by element index mod 8 then a fixed tree, divided by d and rounded once to float32 (torch
 * sums them in float32, so its var may differ from this correctly rounded one by an
 * ulp).  A row's bits depend only on the row. */
typedef struct {
    const void *x;
    int in_dtype;
    const void *weight; /* (d) of dtype weight_dtype */
    int weight_dtype;
    int64_t d;
    float eps;
    void *out;
    int out_dtype;
} mxfp4x_rms_norm_args;

MXFP4X_INLINE void mxfp4x_rms_norm_body(const mxfp4x_rms_norm_args *x, int64_t r0, int64_t r1) {
    float v[MXFP4X_ACT_CHUNK], w[MXFP4X_ACT_CHUNK], y[MXFP4X_ACT_CHUNK];
    const int64_t d = x->d;
    const size_t out_size = x->out_dtype == MXFP4X_DTYPE_F32 ? 4 : 2;
    int64_t r, j0, i, n;
    int l;
    for (r = r0; r < r1; r++) {
        double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        float var, rs;
        char *o = (char *)x->out + (size_t)r * (size_t)d * out_size;
        for (j0 = 0; j0 < d; j0 += n) { /* j0 stays a multiple of 8: lane = index mod 8 */
            n = d - j0 < MXFP4X_ACT_CHUNK ? d - j0 : MXFP4X_ACT_CHUNK;
            mxfp4x_act_load(x->x, x->in_dtype, r * d + j0, 1, n, v);
            for (i = 0; i + 8 <= n; i += 8)
                for (l = 0; l < 8; l++) s[l] += (double)v[i + l] * (double)v[i + l];
            for (; i < n; i++) s[i & 7] += (double)v[i] * (double)v[i];
        }
        var = (float)((((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))) /
                      (double)d);
        rs = 1.0f / sqrtf(var + x->eps);
        for (j0 = 0; j0 < d; j0 += n) {
            n = d - j0 < MXFP4X_ACT_CHUNK ? d - j0 : MXFP4X_ACT_CHUNK;
            mxfp4x_act_load(x->x, x->in_dtype, r * d + j0, 1, n, v);
            mxfp4x_act_load(x->weight, x->weight_dtype, j0, 1, n, w);
            for (i = 0; i < n; i++) y[i] = w[i] * (v[i] * rs);
            mxfp4x_act_store(y, n, x->out_dtype, o + (size_t)j0 * out_size);
        }
    }
}

/* Each compiled for the x86-64 baseline and, where the build has them, AVX2 and AVX-512
 * (wider vectors for the same operations: the same bits), picked by the call's ISA. */
#define MXFP4X_ACT_VARIANTS(SUFFIX, TARGET)                                                \
    static TARGET void mxfp4x_gpt_oss_swiglu##SUFFIX(const mxfp4x_swiglu_args *x,         \
                                                     int64_t r0, int64_t r1) {             \
        mxfp4x_gpt_oss_swiglu_body(x, r0, r1);                                             \
    }                                                                                      \
    static TARGET void mxfp4x_mix_rows##SUFFIX(const mxfp4x_mix_args *x, int64_t t0,       \
                                               int64_t t1) {                               \
        mxfp4x_mix_rows_body(x, t0, t1);                                                   \
    }                                                                                      \
    static TARGET void mxfp4x_situ_glu##SUFFIX(const mxfp4x_situ_args *x, int64_t r0,      \
                                               int64_t r1) {                               \
        mxfp4x_situ_glu_body(x, r0, r1);                                                   \
    }                                                                                      \
    static TARGET void mxfp4x_rms_norm##SUFFIX(const mxfp4x_rms_norm_args *x, int64_t r0,  \
                                               int64_t r1) {                               \
        mxfp4x_rms_norm_body(x, r0, r1);                                                   \
    }
MXFP4X_ACT_VARIANTS(_base, )
#if MXFP4X_HAVE_X86_SIMD
MXFP4X_ACT_VARIANTS(_avx2, MXFP4X_TARGET_AVX2)
MXFP4X_ACT_VARIANTS(_avx512, MXFP4X_TARGET_AVX512)
#define MXFP4X_ACT_PICK(isa, name)                                                         \
    ((isa) == MXFP4X_ISA_AVX2                                                              \
         ? name##_avx2                                                                     \
         : ((isa) == MXFP4X_ISA_AVX512 || (isa) == MXFP4X_ISA_AMX ||                        \
            (isa) == MXFP4X_ISA_AVX512BF16)                                                \
               ? name##_avx512                                                             \
               : name##_base)
#else
#define MXFP4X_ACT_PICK(isa, name) ((void)(isa), name##_base)
#endif

/* on the vectors of ISA isa (an MXFP4X_ISA_* this CPU runs) */
static void mxfp4x_gpt_oss_swiglu(int isa, const mxfp4x_swiglu_args *x, int64_t r0,
                                  int64_t r1) {
    MXFP4X_ACT_PICK(isa, mxfp4x_gpt_oss_swiglu)(x, r0, r1);
}

static void mxfp4x_mix_rows(int isa, const mxfp4x_mix_args *x, int64_t t0, int64_t t1) {
    MXFP4X_ACT_PICK(isa, mxfp4x_mix_rows)(x, t0, t1);
}

static void mxfp4x_situ_glu(int isa, const mxfp4x_situ_args *x, int64_t r0, int64_t r1) {
    MXFP4X_ACT_PICK(isa, mxfp4x_situ_glu)(x, r0, r1);
}

static void mxfp4x_rms_norm(int isa, const mxfp4x_rms_norm_args *x, int64_t r0, int64_t r1) {
    MXFP4X_ACT_PICK(isa, mxfp4x_rms_norm)(x, r0, r1);
}

#endif /* MXFP4X_ACTIVATION_H */
