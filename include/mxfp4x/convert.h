/* mxfp4x/convert.h -- exact conversions between float32 and the 16-bit floats
 * (bfloat16, IEEE binary16), used once per call on the latents and the outputs. */
#ifndef MXFP4X_CONVERT_H
#define MXFP4X_CONVERT_H

#include <string.h>
#include "format.h"

MXFP4X_INLINE float mxfp4x_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bfloat16 is the top half of a binary32. */
MXFP4X_INLINE float mxfp4x_bf16_to_f32(uint16_t h) { return mxfp4x_bits_to_f32((uint32_t)h << 16); }

/* IEEE binary16 -> binary32, exact for every number (subnormals, infinities); a NaN keeps
 * its sign and payload and becomes quiet, as F16C's vcvtph2ps (torch's conversion) makes
 * it.  A subnormal half is man * 2^-24, an exact float product.  Every case computed and
 * one chosen by masks: a loop of it vectorises (a ?: chain stayed a branch). */
MXFP4X_INLINE float mxfp4x_f16_to_f32(uint16_t h) {
    const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const float subf = (float)(int32_t)man * 5.9604644775390625e-8f; /* 2^-24 */
    const uint32_t is_sub = 0u - (uint32_t)(exp == 0), is_max = 0u - (uint32_t)(exp == 0x1Fu);
    const uint32_t quiet = is_max & (0u - (uint32_t)(man != 0)) & 0x400000u; /* a NaN */
    const uint32_t normal = ((exp + 112u + (is_max & 112u)) << 23) | (man << 13) | quiet;
    uint32_t sub;
    memcpy(&sub, &subf, sizeof sub);
    return mxfp4x_bits_to_f32(sign | (is_sub & sub) | (~is_sub & normal));
}

MXFP4X_INLINE uint32_t mxfp4x_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* binary32 bits -> bfloat16 bits, rounded to nearest, ties to even (infinities kept,
 * overflow to infinity); every NaN -> 0xFFFF, as torch's vectorised CPU conversion gives
 * on x86. */
MXFP4X_INLINE uint16_t mxfp4x_bits_to_bf16(uint32_t u) {
    return (u & 0x7FFFFFFFu) > 0x7F800000u
               ? (uint16_t)0xFFFFu
               : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* binary32 -> IEEE binary16 bits, rounded to nearest, ties to even, subnormals included;
 * a NaN keeps its sign and its top 10 payload bits and becomes quiet (as F16C's vcvtps2ph,
 * which torch's CPU conversion uses).  Every case computed, one chosen by masks: a loop
 * of it vectorises. */
MXFP4X_INLINE uint16_t mxfp4x_f32_to_f16(float f) {
    const uint32_t u = mxfp4x_f32_to_bits(f);
    const int32_t a = (int32_t)(u & 0x7FFFFFFFu); /* |f|'s bits: signed compares suffice */
    const uint32_t sign = (u >> 16) & 0x8000u;
    /* under 2^-14: a count of 2^-24 units.  0.5 + |f| in binary32 has ulp 2^-24, so the
     * float addition rounds |f| to the nearest count, ties to even, exactly once. */
    const uint32_t sub = mxfp4x_f32_to_bits(mxfp4x_bits_to_f32((uint32_t)a) + 0.5f) -
                         0x3F000000u;
    /* exponent bias 127 -> 15, then 23 -> 10 mantissa bits, rounded */
    const uint32_t normal =
        ((uint32_t)a - 0x38000000u + 0xFFFu + (((uint32_t)a >> 13) & 1u)) >> 13;
    const uint32_t nan = 0x7E00u | (((uint32_t)a >> 13) & 0x3FFu);
    const uint32_t m_nan = 0u - (uint32_t)(a > 0x7F800000);
    const uint32_t m_inf = 0u - (uint32_t)(a >= 0x477FF000); /* 65520 and up: infinity */
    const uint32_t m_sub = 0u - (uint32_t)(a < 0x38800000);
    uint32_t r = (m_sub & sub) | (~m_sub & normal);
    r = (m_inf & 0x7C00u) | (~m_inf & r);
    r = (m_nan & nan) | (~m_nan & r);
    return (uint16_t)(sign | r);
}

/* n float32 sums rounded once into dtype dst_dtype (MXFP4X_DTYPE_BF16 or _F16). */
MXFP4X_INLINE void mxfp4x_store_f16s(const float *src, int64_t n, int dst_dtype, uint16_t *dst) {
    int64_t i;
    if (dst_dtype == MXFP4X_DTYPE_BF16) /* on the bit patterns: a vectorised loop */
        for (i = 0; i < n; i++) dst[i] = mxfp4x_bits_to_bf16(((const uint32_t *)src)[i]);
    else
        for (i = 0; i < n; i++) dst[i] = mxfp4x_f32_to_f16(src[i]);
}

#endif /* MXFP4X_CONVERT_H */
