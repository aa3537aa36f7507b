/* mxfp4x/dense/neon.h -- the dense bf16 kernels of the neon entry (the dense
 * product of mxfp4x.h's mxfp4x_dense_bf16_fn), apart from its MXFP4 kernels.  Included
 * by neon.h only, at its end, inside its macros (MXFP4X_NEON_*) and its microkernel's
 * (generic/interface.h). */
#ifndef MXFP4X_DENSE_NEON_H
#define MXFP4X_DENSE_NEON_H

/* ---- dense bf16 rows x float32 tokens (mxfp4x.h, mxfp4x_dense_bf16_fn) ----
 * generic/dense_bf16.h: one 4-lane accumulator per (row, token): lane l sums w[i] x[i]
 * over i = l (mod 4) ascending, with fmla (bf16 widened exactly: ushll by 16); the last
 * d_in % 4 elements through zero-filled copies; lanes reduced as (0 + 2) + (1 + 3).
 * Blocks of up to 4 rows x 4 tokens, one token too; no prefetch. */
MXFP4X_NEON_INLINE float32x4_t mxfp4x_bf16x4_neon(const uint16_t *p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}

MXFP4X_NEON_INLINE float mxfp4x_neon_hsum1(float32x4_t a) {
    const float32x2_t d = vadd_f32(vget_low_f32(a), vget_high_f32(a));
    return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);
}

#define MXFP4X_MK_BF16_LOAD mxfp4x_bf16x4_neon
#define MXFP4X_MK_HSUM mxfp4x_neon_hsum1
#define MXFP4X_MK_DENSE_MR1 4
#define MXFP4X_MK_DENSE_PREFETCH 0
#include "../generic/dense_bf16.h"

#endif /* MXFP4X_DENSE_NEON_H */
