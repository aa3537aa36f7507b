/* mxfp4x/neon.h -- AArch64 Advanced SIMD (NEON) variant.
 *
 * Advanced SIMD is part of the AArch64 base architecture, so nothing here needs a
 * target region or a run-time check beyond "this is aarch64" (cpu.h).  Compiled
 * only where MXFP4X_HAVE_NEON (config.h): little-endian AArch64 with GCC or clang.
 *
 * Element order: layout 16 (as scalar and AVX-512): per group, the 16 even
 * elements (low nibbles) then the 16 odd ones (high nibbles).
 *
 * Decode of one group (16 bytes + scale byte s -> 32 floats in 8 q registers):
 *   codes:  lo = bytes & 0x0F, hi = bytes >> 4                      and, ushr
 *   bytes:  every E2M1 value times every scale 2^(s-127) has zero low 16 bits
 *           in float32 (one mantissa bit; s = 0's subnormals sit at bit 20 and
 *           up; s = 255 is the NaN 0x7FC00000), so the scale byte's two
 *           16-entry byte tables (mxfp4x_e2m1_scaled_b3/_b2, built by the
 *           compiler: the bits of the float32 multiply) give bits 31..24 and
 *           23..16 of each scaled code: 2 ldr q, tbl x 2 per 16 codes  tbl x 4
 *   halves: zip1/zip2 of (bits 23..16, bits 31..24) -> 8 bf16 per q   zip x 4
 *   floats: shll/shll2 #16 -> 4 float32 per q (the code order kept)   shll x 8
 *   => per 32 weights: 3 ldr q loads and 18 vector ops (the 8 fmul by the scale
 *      that this replaced gave the same bits), then 8 fmla per token.
 * (An alternative with 2-register tbl placing the two bytes directly into float
 * lanes needs 22 vector ops; not taken: its cost per uop differs across cores.)
 *
 * Order of operations (it defines the bits, see mxfp4x.h): per (row, token) four
 * 4-lane accumulators a0..a3 (16 lanes, lane 4j+l of a_j) start at +0; for each
 * group, in layout position order p = 32g + 16h + 4j + l (h = 0: low nibbles, then
 * h = 1), a_j = fma(w_p, x_p, a_j); lanes reduced by the tree (a0 + a2) + (a1 + a3),
 * then (l, l+2), then (0, 1).  gemv (1 token, several tokens) and decode +
 * panel_dot do exactly this, so they agree bit for bit (batch invariance; threads
 * own whole rows, so thread-count invariance too).
 *
 * Instructions per regime (the rates they give, estimated: docs/performance.md, "ARM
 * (NEON)"):
 *   1 token (gemv1, 2 rows interleaved): the decode's 18 vector ops and 8 fmla per
 *     32 weights.
 *   several tokens (gemv, one decode per group for up to 4 tokens): 18 + 8 per token,
 *     e.g. 18 + 32 per 4 x 32 weight-token products.
 *   panel_dot (many tokens): a 4 x 4 register block, 16 fmla per 8 q loads.
 */
#ifndef MXFP4X_NEON_H
#define MXFP4X_NEON_H

#include "mxfp4x.h"

#if MXFP4X_HAVE_NEON
#include <arm_neon.h>

#define MXFP4X_NEON_FN static
#define MXFP4X_NEON_INLINE static inline MXFP4X_ALWAYS_INLINE

typedef struct {
    uint8x16_t low_nibble;
} mxfp4x_neon_tables;

MXFP4X_NEON_INLINE mxfp4x_neon_tables mxfp4x_neon_load_tables(void) {
    mxfp4x_neon_tables t;
    t.low_nibble = vdupq_n_u8(0x0F);
    return t;
}

/* 16 codes -> 16 float32 in code order, through one scale's byte tables t3, t2 (bits
 * 31..24 and 23..16 of E2M1 times the scale, mxfp4x_e2m1_scaled). */
MXFP4X_NEON_INLINE void mxfp4x_neon_codes_f32(uint8x16_t codes, uint8x16_t t3, uint8x16_t t2,
                                              float32x4_t *w) {
    const uint8x16_t b3 = vqtbl1q_u8(t3, codes), b2 = vqtbl1q_u8(t2, codes);
    const uint16x8_t h0 = vreinterpretq_u16_u8(vzip1q_u8(b2, b3)); /* codes 0..7 */
    const uint16x8_t h1 = vreinterpretq_u16_u8(vzip2q_u8(b2, b3)); /* codes 8..15 */
    w[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h0), 16));
    w[1] = vreinterpretq_f32_u32(vshll_high_n_u16(h0, 16));
    w[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h1), 16));
    w[3] = vreinterpretq_f32_u32(vshll_high_n_u16(h1, 16));
}

/* One group (16 bytes at b, scale byte s) -> w[0..7], layout-16 positions 4k..4k+3. */
MXFP4X_NEON_INLINE void mxfp4x_decode_group_neon(const uint8_t *b, uint8_t s,
                                                 const mxfp4x_neon_tables *t, float32x4_t *w) {
    const uint8x16_t raw = vld1q_u8(b);
    const uint8x16_t t3 = vld1q_u8(mxfp4x_e2m1_scaled_b3[s]);
    const uint8x16_t t2 = vld1q_u8(mxfp4x_e2m1_scaled_b2[s]);
    mxfp4x_neon_codes_f32(vandq_u8(raw, t->low_nibble), t3, t2, w);
    mxfp4x_neon_codes_f32(vshrq_n_u8(raw, 4), t3, t2, w + 4);
}

/* a_j = fma(w_j, x_j, a_j) for the low half, then for the high half. */
MXFP4X_NEON_INLINE void mxfp4x_neon_fma_group(const float32x4_t *w, const float *xg,
                                              float32x4_t *a) {
    int j;
    for (j = 0; j < 4; j++) a[j] = vfmaq_f32(a[j], w[j], vld1q_f32(xg + 4 * j));
    for (j = 0; j < 4; j++) a[j] = vfmaq_f32(a[j], w[4 + j], vld1q_f32(xg + 16 + 4 * j));
}

/* The fixed tree: (a0 + a2) + (a1 + a3), then lanes (l, l+2), then (0, 1). */
MXFP4X_NEON_INLINE float mxfp4x_neon_hsum(const float32x4_t *a) {
    const float32x4_t c = vaddq_f32(vaddq_f32(a[0], a[2]), vaddq_f32(a[1], a[3]));
    const float32x2_t d = vadd_f32(vget_low_f32(c), vget_high_f32(c));
    return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);
}

MXFP4X_NEON_INLINE void mxfp4x_neon_zero4(float32x4_t *a) {
    a[0] = a[1] = a[2] = a[3] = vdupq_n_f32(0.0f);
}

/* One group decoded into the panel at p (generic/decode.h). */
MXFP4X_NEON_INLINE void mxfp4x_decode_store_neon(const uint8_t *b, uint8_t s,
                                                 const mxfp4x_neon_tables *t, float *p) {
    float32x4_t wv[8];
    int k;
    mxfp4x_decode_group_neon(b, s, t, wv);
    for (k = 0; k < 8; k++) vst1q_f32(p + 4 * k, wv[k]);
}

/* A (row, token)'s four parked accumulators, reduced by the tree (generic/panel_chunked.h). */
MXFP4X_NEON_INLINE float mxfp4x_neon_hsum_parked(const float *l) {
    float32x4_t a[4];
    int j;
    for (j = 0; j < 4; j++) a[j] = vld1q_f32(l + 4 * j);
    return mxfp4x_neon_hsum(a);
}

/* The microkernel the drivers of generic/ are compiled over (generic/interface.h). */
#define MXFP4X_MK_NAME(name) name##_neon
#define MXFP4X_MK_FN MXFP4X_NEON_FN
#define MXFP4X_MK_INLINE MXFP4X_NEON_INLINE
#define MXFP4X_MK_VEC float32x4_t
#define MXFP4X_MK_LANES 4
#define MXFP4X_MK_LOAD(p) vld1q_f32(p)
#define MXFP4X_MK_STORE(p, v) vst1q_f32((p), (v))
#define MXFP4X_MK_SET1(f) vdupq_n_f32(f)
#define MXFP4X_MK_ADD(a, b) vaddq_f32((a), (b))
#define MXFP4X_MK_FMA(a, b, c) vfmaq_f32((c), (a), (b))
#define MXFP4X_MK_FMA1(a, b, c) \
    vgetq_lane_f32(vfmaq_f32(vdupq_n_f32(c), vdupq_n_f32(a), vdupq_n_f32(b)), 0)
#define MXFP4X_MK_TABLES mxfp4x_neon_tables
#define MXFP4X_MK_LOAD_TABLES mxfp4x_neon_load_tables
#define MXFP4X_MK_DECODE_STORE mxfp4x_decode_store_neon
#include "generic/interface.h"

/* The one-token gemv: generic/gemv1.h, two rows at a time (8 independent FMA chains,
 * 2 fmla each per group, hide the 4-cycle FMA latency behind the two decodes; 8
 * accumulators + 8 latents + 8 weights + 3 tables fit the 32 q registers, where four
 * rows spilled). */
#define MXFP4X_MK_GEMV1_MR 2
#define MXFP4X_MK_GEMV1_PREFETCH 0
#define MXFP4X_MK_ROW_ACCS 4
#define MXFP4X_MK_DECODE_GROUP mxfp4x_decode_group_neon
#define MXFP4X_MK_FMA_GROUP mxfp4x_neon_fma_group
#define MXFP4X_MK_HSUM_ACCS mxfp4x_neon_hsum
#include "generic/gemv1.h"

/* 2..4 tokens: one row at a time, each group decoded once into registers and
 * applied to every token (4 x NT accumulators, 8 weights, 3 tables: GCC 12 keeps
 * all but ~5 q registers of a 4-token group in registers, the rest spill to L1). */
#define MXFP4X_NEON_NT 4
MXFP4X_NEON_INLINE void mxfp4x_gemv_tokens_neon(const mxfp4x_rows *w, int64_t row_start,
                                                int64_t row_end, const float *const *xs,
                                                int nt, float *out, int64_t out_stride) {
    const mxfp4x_neon_tables t = mxfp4x_neon_load_tables();
    const int64_t G = w->n_groups, sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t r, g;
    int c;
    float32x4_t wv[8];
    for (r = row_start; r < row_end; r++) {
        const uint8_t *b = w->blocks + r * sb;
        const uint8_t *s = w->scales + r * ss;
        float32x4_t a[MXFP4X_NEON_NT][4];
        for (c = 0; c < MXFP4X_NEON_NT; c++) mxfp4x_neon_zero4(a[c]);
        for (g = 0; g < G; g++) {
            mxfp4x_decode_group_neon(b + g * gb, s[g * gs], &t, wv);
            for (c = 0; c < nt; c++) mxfp4x_neon_fma_group(wv, xs[c] + g * MXFP4X_GROUP, a[c]);
        }
        for (c = 0; c < nt; c++) out[c * out_stride + r - row_start] = mxfp4x_neon_hsum(a[c]);
    }
}

/* The gemv/panel crossover: NOT MEASURED (no ARM hardware); the AVX2 value.  The NEON
 * decode (26 ops per group) costs ~3 token-FMAs' worth, so panels should pay off early. */
#define MXFP4X_NEON_GEMV_MAX_TOKENS 8
/* Unmeasured (no ARM hardware): AVX2's task and panel sizes; Apple M and Neoverse V2 L2s
 * (>= 1 MiB per core) hold a 384 KiB panel. */
#define MXFP4X_NEON_TILE_ROWS 48
#define MXFP4X_NEON_PANEL_BYTES (384 * 1024)

#define MXFP4X_MK_GEMV_NT MXFP4X_NEON_NT
#include "generic/gemv_tokens.h"
#include "generic/decode.h"

/* ---- panel x tokens: register-blocked micro-kernel over k-chunks ----
 *
 * The four accumulators a_j of a (row, token) are independent chains (a_j sees
 * positions p with p mod 16 in [4j, 4j+4)), so the block runs one j at a time:
 * MR = 4 rows x NT = 4 tokens = 16 accumulators, 4 row and 4 token vectors per
 * step (8 loads per 16 fmla), within the 32 q registers.  k runs in chunks of
 * MXFP4X_NEON_KC floats so the 4 rows' chunk stays in L1 while the tokens stream
 * past; between chunks (and j passes) the accumulators are parked unreduced in
 * `scratch`, so every lane's sequence is exactly the unchunked one. */
#define MXFP4X_NEON_KC 512
#define MXFP4X_NEON_MR 4       /* panel rows per register block */
#define MXFP4X_NEON_PT 4       /* tokens per register block */
#define MXFP4X_NEON_TOKENS 32  /* tokens per super-block (bounds the scratch) */
/* lanes[(r * PT + c) * 16 + 4 j + l]: lane l of a_j of (row r, token c). */
MXFP4X_NEON_INLINE void mxfp4x_block_neon(const float *const *ps, int mr,
                                          const float *const *xs, int nt, int64_t k0,
                                          int64_t k1, float *lanes) {
    float32x4_t a[MXFP4X_NEON_MR][MXFP4X_NEON_PT];
    int r, c, j;
    int64_t i;
    for (j = 0; j < 4; j++) {
        for (r = 0; r < MXFP4X_NEON_MR; r++)
            for (c = 0; c < MXFP4X_NEON_PT; c++)
                a[r][c] = (r < mr && c < nt)
                              ? vld1q_f32(lanes + (r * MXFP4X_NEON_PT + c) * 16 + 4 * j)
                              : vdupq_n_f32(0.0f);
        for (i = k0 + 4 * j; i < k1; i += 16) {
            float32x4_t wv[MXFP4X_NEON_MR], xv[MXFP4X_NEON_PT];
            for (r = 0; r < mr; r++) wv[r] = vld1q_f32(ps[r] + i);
            for (c = 0; c < nt; c++) xv[c] = vld1q_f32(xs[c] + i);
            for (r = 0; r < mr; r++)
                for (c = 0; c < nt; c++) a[r][c] = vfmaq_f32(a[r][c], wv[r], xv[c]);
        }
        for (r = 0; r < mr; r++)
            for (c = 0; c < nt; c++)
                vst1q_f32(lanes + (r * MXFP4X_NEON_PT + c) * 16 + 4 * j, a[r][c]);
    }
}

#define MXFP4X_MK_PANEL_MR MXFP4X_NEON_MR
#define MXFP4X_MK_PANEL_NT MXFP4X_NEON_PT
#define MXFP4X_MK_PANEL_TOKENS MXFP4X_NEON_TOKENS
#define MXFP4X_MK_PANEL_KC MXFP4X_NEON_KC
#define MXFP4X_MK_PANEL_PARK 16 /* four 4-lane accumulators per (row, token) */
#define MXFP4X_MK_HSUM_PARKED mxfp4x_neon_hsum_parked
#include "generic/panel_chunked.h"

/* dst[j] += sum_r coef[r] * panel[r][j], r ascending, one fmla per term: 64 columns in
 * 16 accumulators while the rows stream past; tails of 4 columns, then of 1 (the
 * same fused multiply-add in lane 0). */
#define MXFP4X_MK_AXPY_VECS 16
#include "generic/axpy_rows.h"

/* Roofline: 16 independent fmla chains (4 pipes x 4-cycle latency). */
#define MXFP4X_MK_FMA_CHAINS 16
#include "generic/fma_probe.h"

/* The dense bf16 kernels (generic/dense_bf16.h). */
#include "dense/neon.h"
#include "generic/end.h"

#endif /* MXFP4X_HAVE_NEON */
#endif /* MXFP4X_NEON_H */
