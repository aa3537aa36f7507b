/* mxfp4x/dense/avx2.h -- the dense bf16 kernels of the avx2 entry (the dense
 * product of mxfp4x.h's mxfp4x_dense_bf16_fn), apart from its MXFP4 kernels.  Included
 * by avx2.h only, at its end, inside its target region (MXFP4X_AVX2_*) and its
 * microkernel's macros (generic/interface.h). */
#ifndef MXFP4X_DENSE_AVX2_H
#define MXFP4X_DENSE_AVX2_H

/* ---- dense bf16 rows x float32 tokens (mxfp4x.h, mxfp4x_dense_bf16_fn) ----
 * generic/dense_bf16.h: one 8-lane accumulator per (row, token): lane l sums w[i] x[i]
 * over i = l (mod 8) ascending, with FMA (bf16 widened exactly: vpmovzxwd + a 16-bit
 * shift); the last d_in % 8 elements through zero-filled copies; lanes reduced by
 * mxfp4x_hsum8_avx2.  Blocks of up to 4 rows x 4 tokens (8 rows at one token), as
 * avx512.h's, each row's lines prefetched ahead. */
MXFP4X_AVX2_INLINE __m256 mxfp4x_bf16x8_avx2(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

#define MXFP4X_MK_BF16_LOAD mxfp4x_bf16x8_avx2
#define MXFP4X_MK_HSUM mxfp4x_hsum8_avx2
#define MXFP4X_MK_DENSE_MR1 8 /* one token: eight row streams in flight */
#define MXFP4X_MK_DENSE_PREFETCH 1
#include "../generic/dense_bf16.h"

#endif /* MXFP4X_DENSE_AVX2_H */
