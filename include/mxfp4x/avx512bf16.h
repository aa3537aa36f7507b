/* mxfp4x/avx512bf16.h -- bfloat16 latents on AVX512-BF16's vdpbf16ps (AMD Zen 4 and later,
 * Intel Cooper Lake, Sapphire Rapids and later).  The "avx512bf16" ISA is the avx512 kernel
 * table plus mxfp4x_bf16dp_rows, which a float32-compute forward call with bfloat16
 * latents uses for every token, at any batch size.
 *
 * The product: per (row, token) 16 float32 lanes, one vdpbf16ps per chunk of 32 words
 * (as many chunks as groups), in order:
 *
 *     acc = vdpbf16ps(acc, W_c, X_c)   for c = 0 .. G-1;   W . x = hsum16(acc)
 *
 *   W_c: 32 bf16 weights with their scales folded in.  One group decoded alone: word 2k,
 *        2k + 1 = the low and high nibble of byte k (elements 2k and 2k + 1 for the pairs
 *        arrangement, k and k + 16 for GGUF's halves), for every group of GGUF rows and
 *        the odd last group of pairs rows; the other groups of pairs rows two at a time
 *        (mxfp4x_bf16dp_decode2: chunk 2p the low nibbles of groups 2p and 2p + 1, chunk
 *        2p + 1 their high nibbles);
 *   X_c: the token's latents in the same chunks (mxfp4x_bf16dp_gather).
 *
 * Few tokens per expert run it fused (the group decoded in a register, applied to each
 * token); more decode the rows into a bf16 panel first and run a 4-row x 6-token register
 * block over it.  Both issue the same vdpbf16ps on the same operands in the same order,
 * and reduce by the same tree, so a token's result does not depend on its batch whatever
 * the instruction does inside (its pair order and roundings are the hardware's; on an
 * Intel Xeon it matched acc + odd product, then + even product, each rounded, on 3.2e6
 * random cells).
 *
 * Exactness.  A bf16 latent times a scaled E2M1 value is exact in float32, and vdpbf16ps
 * rounds to nearest even, but it reads subnormal inputs as zero and flushes subnormal
 * results.  Neither can happen under amx.h's conditions (tables.h: nonzero weights at
 * least 2^-59, nonzero finite latents at least 2^-60, so every product and partial sum is
 * a multiple of 2^-126; scale bytes under 160 and latents under 2^64, so nothing
 * overflows).  A token outside them (flagged by the gather) and a row outside them (a
 * scan of its scale bytes) leave the unit, for every row or token, whatever the batch:
 *   - small values only (a latent under 2^-60, a nonzero code under a scale byte < 69):
 *     the unit's own arithmetic in float32 FMAs, which keep subnormals (per chunk and
 *     lane, acc = fma(even product, fma(odd product, acc)), then hsum16) -- the unit's
 *     bits wherever nothing is subnormal (vdpbf16ps matched it on every one of 3.2e6
 *     random cells on an Intel Xeon and on an AMD EPYC Zen 4), and where something is,
 *     a float32 sum within the float32 bound instead of a flushed one.  Four rows by
 *     four tokens at a time, near the unit's time where the float64 path is many times
 *     it (a SwiGLU's far-negative gates leave such latents: docs/performance.md, "AMD
 *     Zen 4");
 *   - values that could overflow a float32 product or sum (a latent of 2^64 or more, inf,
 *     NaN; a scale byte of 160 or more): the exact path, float64 products and sums in
 *     pair order (elements 2k, 2k + 1; GGUF: k, k + 16), rounded once. */
#ifndef MXFP4X_AVX512BF16_H
#define MXFP4X_AVX512BF16_H

#include "mxfp4x.h"
#include "avx512.h"
#include "bf16/unit.h"
#include "cpu.h"

#if MXFP4X_HAVE_AVX512BF16
#include <immintrin.h>

#define MXFP4X_TARGET_BF16DP MXFP4X_TARGET("avx512f,avx512bw,avx512bf16,avx2,fma")
#define MXFP4X_BF16DP_FN static MXFP4X_TARGET_BF16DP
#define MXFP4X_BF16DP_INLINE static inline MXFP4X_TARGET_BF16DP MXFP4X_ALWAYS_INLINE
#define MXFP4X_BF16DP_NOINLINE static MXFP4X_TARGET_BF16DP __attribute__((noinline))

/* Output rows per forward task, and the decoded panel's rows (a multiple of the 4-row
 * blocks: a row's block, hence its code path, does not depend on the split). */
#define MXFP4X_BF16DP_TILE_ROWS 48
#define MXFP4X_BF16DP_MR 4
#define MXFP4X_BF16DP_NT 4  /* tokens per fused block */
/* ... but a last 4 + 1 tokens as one block of 5 (its rows decoded once); blocks of 6
 * spill their 24 accumulators (an AMD Zen 5: docs/performance.md, "Few tokens and the
 * path switches"). */
#define MXFP4X_BF16DP_NT_MAX 5
#define MXFP4X_BF16DP_PNT 6 /* tokens per panel block */
/* Fused up to this many tokens per expert, decoded panel above: where the two cross
 * streaming rows from DRAM.  12: the Xeon's crossover, and every CPU's but an AMD Zen 4's
 * or Zen 5's; a Zen 5 (AMD family 1Ah) and a Zen 4 (family 19h; its Zen 3 siblings have
 * no AVX-512) take 32, where the fused path outruns the panel up to about 40 tokens
 * (docs/performance.md, "Few tokens and the path switches").
 * MXFP4X_BF16DP_GEMV_MAX_TOKENS set from outside sets every CPU's. */
#ifdef MXFP4X_BF16DP_GEMV_MAX_TOKENS
#ifndef MXFP4X_BF16DP_GEMV_MAX_TOKENS_ZEN
#define MXFP4X_BF16DP_GEMV_MAX_TOKENS_ZEN MXFP4X_BF16DP_GEMV_MAX_TOKENS
#endif
#else
#define MXFP4X_BF16DP_GEMV_MAX_TOKENS 12
#endif
#ifndef MXFP4X_BF16DP_GEMV_MAX_TOKENS_ZEN
#define MXFP4X_BF16DP_GEMV_MAX_TOKENS_ZEN 32
#endif

/* This CPU's switch (above): the kernel table's bf16_gemv_max_tokens. */
static int mxfp4x_bf16dp_gemv_max_tokens(void) {
    return mxfp4x_cpu_amd_zen4_or_5() ? MXFP4X_BF16DP_GEMV_MAX_TOKENS_ZEN
                                      : MXFP4X_BF16DP_GEMV_MAX_TOKENS;
}
MXFP4X_STATIC_ASSERT(MXFP4X_BF16DP_TILE_ROWS % MXFP4X_BF16DP_MR == 0,
                     "avx512bf16: tasks of whole row blocks");

/* The pairs arrangement (gpt-oss rows: 16-byte groups back to back) takes its groups two
 * at a time: groups g, g + 1 (32 bytes) widened to 32 words by one vpmovzxbw, word j =
 * byte j % 16 of group g + j / 16, and looked up twice in the two groups' scaled tables
 * by one vpermt2w each (index bit 5 picks the table):
 *   lo: word j = element 2 (j % 16) of group g + j / 16 (byte j's low nibble),
 *   hi: word j = element 2 (j % 16) + 1                  (its high nibble).
 * Lane i of vdpbf16ps thus adds the pair (words 2i, 2i + 1) of one group: lanes 0-7 group
 * g, lanes 8-15 group g + 1.  Per row-group that is 1.5 shuffle-unit operations (widen,
 * two lookups per two groups) instead of 2 (faster on a Zen 4: docs/performance.md,
 * "Decode and the one-token gemv").  An odd last group, and every
 * group of the halves arrangement (GGUF blocks of 17 bytes, not back to back), take the
 * one-group decode above.  Chunk c (32 words) of a row is thus: lo (c even) or hi (c odd)
 * of pair c / 2, or the one-group decode of the last group; the latents are gathered into
 * the same chunks (mxfp4x_bf16dp_gather), and every path runs chunk c against chunk c in
 * order c = 0, 1, ... G - 1. */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_decode2(const uint8_t *b, uint8_t s0, uint8_t s1,
                                                __m512i *lo, __m512i *hi) {
    const __m512i t0 = _mm512_castsi256_si512(
        _mm256_load_si256((const __m256i *)mxfp4x_e2m1_scaled_bf16[s0]));
    const __m512i t1 = _mm512_castsi256_si512(
        _mm256_load_si256((const __m256i *)mxfp4x_e2m1_scaled_bf16[s1]));
    const __m512i d = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)b));
    /* words 16-31: group g + 1, in the second table (index bit 5) */
    const __m512i sel = _mm512_set_epi16(32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32,
                                         32, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i lo_idx = _mm512_ternarylogic_epi32(d, _mm512_set1_epi16(15), sel, 0xEA);
    const __m512i hi_idx = _mm512_or_si512(_mm512_srli_epi16(d, 4), sel);
    *lo = _mm512_permutex2var_epi16(t0, lo_idx, t1);
    *hi = _mm512_permutex2var_epi16(t0, hi_idx, t1);
}

/* Whether rows of arrangement `nibbles` take their groups in pairs (the layout above). */
static inline int mxfp4x_bf16dp_paired(int nibbles) {
    return nibbles == MXFP4X_NIBBLES_PAIRS;
}

/* Word offsets, in a row's chunks (above), of the latents that meet byte k's low and
 * high nibble of group g. */
static int64_t mxfp4x_bf16dp_xpos(int64_t g, int k, int64_t n_groups, int paired, int high) {
    if (paired && g < (n_groups & ~(int64_t)1))
        return (g >> 1) * 64 + high * 32 + (g & 1) * 16 + k;
    return g * MXFP4X_GROUP + 2 * k + high;
}

/* paths off the unit (exact; the unit's arithmetic in float32 FMAs) */
#include "bf16/avx512bf16_off_unit.h"

/* hsum16's tree (avx512.h: lanes (j, j + 8), then (j, j + 4), (j, j + 2), (0, 1)) run on
 * many vectors at once: each level adds, for two vectors, the halves hsum16 would add, two
 * vectors' halves side by side in one register, so every sum is hsum16's own, operands in
 * the same order (the lower lanes first), rounded the same: the same bits in 3 operations
 * per pair of vectors per level instead of 4 per vector per level.
 *   level 1 (A, B):  [A0-7 + A8-15 | B0-7 + B8-15]
 *   level 2 (P, Q):  quarter k: vector k's four partials (P: k = 0, 1; Q: k = 2, 3)
 *   level 3 (P, Q):  quarter k: two partials of P's quarter k, two of Q's
 *   level 4 (P, Q):  quarter k: one sum of each of the four
 * From v[0..15] this leaves lane 4k + j = hsum16(v[4j + k]). */
MXFP4X_BF16DP_INLINE __m512 mxfp4x_bf16dp_hsum_l1(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
MXFP4X_BF16DP_INLINE __m512 mxfp4x_bf16dp_hsum_l2(__m512 p, __m512 q) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
}
MXFP4X_BF16DP_INLINE __m512 mxfp4x_bf16dp_hsum_l3(__m512 p, __m512 q) {
    const __m512d pd = _mm512_castps_pd(p), qd = _mm512_castps_pd(q);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(pd, qd)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(pd, qd)));
}
MXFP4X_BF16DP_INLINE __m512 mxfp4x_bf16dp_hsum_l4(__m512 p, __m512 q) {
    return _mm512_add_ps(_mm512_shuffle_ps(p, q, 0x88), _mm512_shuffle_ps(p, q, 0xDD));
}
/* levels 1-3 of 8 vectors: quarter k = [two partials of v[k], two of v[4 + k]] */
MXFP4X_BF16DP_INLINE __m512 mxfp4x_bf16dp_hsum_8(const __m512 *v) {
    return mxfp4x_bf16dp_hsum_l3(
        mxfp4x_bf16dp_hsum_l2(mxfp4x_bf16dp_hsum_l1(v[0], v[1]), mxfp4x_bf16dp_hsum_l1(v[2], v[3])),
        mxfp4x_bf16dp_hsum_l2(mxfp4x_bf16dp_hsum_l1(v[4], v[5]), mxfp4x_bf16dp_hsum_l1(v[6], v[7])));
}

/* 16 vectors v[4j + k] reduced, quarter k (lane 4k + j = hsum16(v[4j + k])) stored at
 * out + k * out_stride for k < n. */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_reduce_16(const __m512 *v, int n, float *out,
                                                  int64_t out_stride) {
    const __m512 r = mxfp4x_bf16dp_hsum_l4(mxfp4x_bf16dp_hsum_8(v), mxfp4x_bf16dp_hsum_8(v + 8));
    _mm_storeu_ps(out, _mm512_castps512_ps128(r));
    if (n > 1) _mm_storeu_ps(out + out_stride, _mm512_extractf32x4_ps(r, 1));
    if (n > 2) _mm_storeu_ps(out + 2 * out_stride, _mm512_extractf32x4_ps(r, 2));
    if (n > 3) _mm_storeu_ps(out + 3 * out_stride, _mm512_extractf32x4_ps(r, 3));
}

/* A 4-row x nt-token block's sums into out[t * out_stride + i] (= hsum16(a[i][t])):
 * nt = 1 pairs the 4 vectors through levels 1-2 and then each result with itself (quarter
 * k: row k's sum 4 times); 2-4 run 16 vectors (v[4j + k] = a[j][k], absent tokens
 * replaced by token 0) so quarter k is token k's 4 rows. */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_reduce_4xn(__m512 a[MXFP4X_BF16DP_MR][MXFP4X_BF16DP_NT_MAX],
                                                   int nt, float *out, int64_t out_stride) {
    if (nt == 1) {
        const __m512 q = mxfp4x_bf16dp_hsum_l2(mxfp4x_bf16dp_hsum_l1(a[0][0], a[1][0]),
                                               mxfp4x_bf16dp_hsum_l1(a[2][0], a[3][0]));
        const __m512 h = mxfp4x_bf16dp_hsum_l3(q, q);
        const __m512 r = mxfp4x_bf16dp_hsum_l4(h, h);
        const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
        _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, r)));
    } else {
        const int t1 = nt > 1, t2 = nt > 2 ? 2 : 0, t3 = nt > 3 ? 3 : 0;
        const __m512 v[16] = {a[0][0], a[0][t1], a[0][t2], a[0][t3], a[1][0], a[1][t1],
                              a[1][t2], a[1][t3], a[2][0], a[2][t1], a[2][t2], a[2][t3],
                              a[3][0], a[3][t1], a[3][t2], a[3][t3]};
        mxfp4x_bf16dp_reduce_16(v, nt, out, out_stride);
    }
}

/* few tokens fused, many through a decoded panel */
#include "bf16/avx512bf16_gemv.h"
#include "bf16/avx512bf16_panel.h"

/* Rows [r0, r1) . every token t whose flags (unsafe[t] | row_flags) send it off the unit
 * (all of them when row_flags is nonzero), into out[t * out_stride + r - row_start]: the
 * float32 path in blocks of tokens, the tokens that need float64 one by one. */
static void mxfp4x_bf16dp_off_tokens(const mxfp4x_rows *w, int64_t r0, int64_t r1,
                                     int64_t row_start, const uint16_t *xt,
                                     const uint8_t *unsafe, int64_t n_tok, int row_flags,
                                     float *out, int64_t out_stride) {
    const int64_t d_in = w->n_groups * MXFP4X_GROUP;
    const uint16_t *xs[MXFP4X_BF16DP_NT];
    float *outs[MXFP4X_BF16DP_NT];
    int64_t t;
    int n = 0;
    for (t = 0; t <= n_tok; t++) {
        const int f = t < n_tok ? unsafe[t] | row_flags : 0;
        if (f & MXFP4X_BF16_LARGE) {
            const uint16_t *x1 = xt + t * d_in;
            float *o1 = out + t * out_stride + (r0 - row_start);
            mxfp4x_bf16dp_off_unit(w, r0, r1, &x1, 1, 1, &o1);
        } else if (f) {
            xs[n] = xt + t * d_in;
            outs[n++] = out + t * out_stride + (r0 - row_start);
        }
        if (n == MXFP4X_BF16DP_NT || (t == n_tok && n > 0)) {
            mxfp4x_bf16dp_off_unit(w, r0, r1, xs, n, 0, outs);
            n = 0;
        }
    }
}

/* out[t * out_stride + r - row_start] = W[r] . x_t for r in [row_start, row_end), t <
 * n_tok (x_t at xt + t * d_in, in the pairing), unsafe[t] nonzero for a token the unit
 * may not take (the gather's flags).  row_start a multiple of 4 apart from the rows'
 * origin (the driver's tasks are), so the 4-row blocks do not depend on the split; the
 * rows go through the panel in chunks of MXFP4X_BF16DP_TILE_ROWS.  `scratch`:
 * mxfp4x_bf16dp_scratch_bytes(G) bytes. */
MXFP4X_BF16DP_FN void mxfp4x_bf16dp_rows(const mxfp4x_rows *w, int64_t row_start,
                                         int64_t row_end, const uint16_t *xt,
                                         const uint8_t *unsafe, int64_t n_tok, float *out,
                                         int64_t out_stride, void *scratch) {
    const int64_t G = w->n_groups, d_in = G * MXFP4X_GROUP;
    uint16_t *panel = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *acc = (float *)(panel + MXFP4X_BF16DP_TILE_ROWS * d_in); /* 64-byte aligned */
    const uint16_t *xs[MXFP4X_BF16DP_PNT];
    const int fused = n_tok <= mxfp4x_bf16dp_gemv_max_tokens();
    const int step = fused ? MXFP4X_BF16DP_NT : MXFP4X_BF16DP_PNT;
    /* the panel's slices: as few as KC allows, of equal length but the last; one (empty)
     * slice for rows of no groups, so their sums (zero) are still written */
    const int64_t kc_max = mxfp4x_bf16dp_kc();
    const int64_t n_slices = kc_max > 0 && G > kc_max ? (G + kc_max - 1) / kc_max : 1;
    const int64_t kc = G > 0 ? (G + n_slices - 1) / n_slices : 1;
    int64_t r0, r1, r, t, i, c0, c1, run_end, pf_per_call = 0;
    int nt, mr, row_next, any_unsafe = 0;
    mxfp4x_bf16dp_pf pf = {NULL, NULL, NULL, NULL};
    for (t = 0; t < n_tok; t++) any_unsafe |= unsafe[t];
    for (r0 = row_start; r0 < row_end; r0 = r1) {
        r1 = row_end - r0 < MXFP4X_BF16DP_TILE_ROWS ? row_end : r0 + MXFP4X_BF16DP_TILE_ROWS;
        if (!fused) {
            /* the next tile's bytes and scales stream into L2 while this one is computed:
             * its decode found them in DRAM and waited on every line */
            const int64_t n_calls = ((n_tok + step - 1) / step) * n_slices *
                                    ((r1 - r0 + MXFP4X_BF16DP_MR - 1) / MXFP4X_BF16DP_MR);
            mxfp4x_bf16dp_decode_rows(w, r0, r1 - r0, panel);
            pf = mxfp4x_bf16dp_pf_tile(w, r1, row_end);
            pf_per_call = (mxfp4x_bf16dp_pf_count(&pf) + n_calls - 1) / n_calls;
        }
        /* the unit takes the tokens in runs of consecutive ones it may take (every token,
         * as a rule), each run in blocks; the others go off the unit below */
        for (t = 0, run_end = 0; t < n_tok; t += nt) {
            if (t >= run_end) {
                while (t < n_tok && unsafe[t]) t++;
                if (t == n_tok) break;
                for (run_end = t; run_end < n_tok && !unsafe[run_end]; run_end++) {
                }
            }
            nt = run_end - t < step ? (int)(run_end - t) : step;
            if (fused && run_end - t == MXFP4X_BF16DP_NT_MAX) nt = MXFP4X_BF16DP_NT_MAX;
            for (i = 0; i < nt; i++) xs[i] = xt + (t + i) * d_in;
            if (fused) {
                for (r = r0; r < r1; r += MXFP4X_BF16DP_MR) {
                    float *o = out + t * out_stride + (r - row_start);
                    mr = r1 - r < MXFP4X_BF16DP_MR ? (int)(r1 - r) : MXFP4X_BF16DP_MR;
                    if (mr == MXFP4X_BF16DP_MR) {
                        switch (nt) {
                        case 5: mxfp4x_bf16dp_gemv_full5(w, r, xs, o, out_stride, row_end); break;
                        case 4: mxfp4x_bf16dp_gemv_full4(w, r, xs, o, out_stride, row_end); break;
                        case 3: mxfp4x_bf16dp_gemv_full3(w, r, xs, o, out_stride, row_end); break;
                        case 2: mxfp4x_bf16dp_gemv_full2(w, r, xs, o, out_stride, row_end); break;
                        default: mxfp4x_bf16dp_gemv_full1(w, r, xs, o, out_stride, row_end); break;
                        }
                    } else {
                        mxfp4x_bf16dp_gemv_block(w, r, xs, mr, nt, o, out_stride, row_end, 0);
                    }
                }
                continue;
            }
            c0 = 0;
            do {
                c1 = G - c0 < kc ? G : c0 + kc;
                for (r = r0; r < r1; r += MXFP4X_BF16DP_MR) {
                    float *o = out + t * out_stride + (r - row_start);
                    float *ra = acc + (r - r0) * MXFP4X_BF16DP_PNT * 16; /* row block's partials */
                    mr = r1 - r < MXFP4X_BF16DP_MR ? (int)(r1 - r) : MXFP4X_BF16DP_MR;
                    mxfp4x_bf16dp_pf_lines(&pf, pf_per_call);
                    if (mr == MXFP4X_BF16DP_MR)
                        mxfp4x_bf16dp_panel_full[nt](panel + (r - r0) * d_in, d_in, G, c0, c1,
                                                     xs, ra, o, out_stride);
                    else
                        mxfp4x_bf16dp_panel_block(panel + (r - r0) * d_in, d_in, G, c0, c1, xs,
                                                  mr, nt, ra, o, out_stride);
                }
                c0 = c1;
            } while (c0 < G);
        }
        /* off the unit: tokens outside the conditions, for every row of the tile, four
         * at a time (the float32 path) or one by one (float64); then rows outside them,
         * for every token (their unit results overwritten) */
        if (!any_unsafe && mxfp4x_bf16_rows_safe(w, r0, r1)) continue;
        mxfp4x_bf16dp_off_tokens(w, r0, r1, row_start, xt, unsafe, n_tok, 0, out, out_stride);
        if (mxfp4x_bf16_rows_safe(w, r0, r1)) continue;
        /* runs of rows with the same flags, 4 rows at a time; each row scanned once */
        for (r = r0, row_next = mxfp4x_bf16_row_unsafe(w, r0); r < r1;) {
            const int row_bad = row_next;
            int64_t re = r + 1;
            while (re < r1 && (row_next = mxfp4x_bf16_row_unsafe(w, re)) == row_bad) re++;
            if (row_bad)
                mxfp4x_bf16dp_off_tokens(w, r, re, row_start, xt, unsafe, n_tok, row_bad, out,
                                         out_stride);
            r = re;
        }
    }
}

/* Gather the latents of n pairs (token rows src[0..n) of x, natural order, bf16 bits,
 * row stride x_stride elements) to dst (pair i at i * d_in words) in the pairing of
 * arrangement `nibbles`; unsafe[i] = what token i needs instead of the unit (bf16/unit.h):
 * MXFP4X_BF16_SMALL for a nonzero finite latent under 2^-60 in magnitude,
 * MXFP4X_BF16_LARGE for one of at least 2^64, infinities and NaNs included; 0 if none. */
MXFP4X_BF16DP_FN void mxfp4x_bf16dp_gather(const uint16_t *x, int64_t x_stride,
                                           const int64_t *src, int64_t n, int64_t n_groups,
                                           int nibbles, uint16_t *dst, uint8_t *unsafe) {
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    /* halves: pair k = (element k, element k + 16) */
    const __m512i halves = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                            9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                            17, 1, 16, 0);
    /* pairs, two groups at a time (mxfp4x_bf16dp_decode2): word j of the lo chunk = element
     * 2 (j % 16) of group j / 16 (index bit 5: the second group), the hi chunk's + 1 */
    MXFP4X_ALIGN64 static const uint16_t pair_lo[32] = {
        0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
        32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
    const __m512i lo_idx = _mm512_load_si512((const void *)pair_lo);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(1));
    const int paired = mxfp4x_bf16dp_paired(nibbles);
    int64_t i, g;
    for (i = 0; i < n; i++) {
        const uint16_t *row = x + src[i] * x_stride;
        uint16_t *d = dst + i * d_in;
        __mmask32 small = 0, large = 0;
        g = 0;
        if (paired)
            for (; g + 2 <= n_groups; g += 2) {
                const __m512i v0 = _mm512_loadu_si512((const void *)(row + g * MXFP4X_GROUP));
                const __m512i v1 =
                    _mm512_loadu_si512((const void *)(row + (g + 1) * MXFP4X_GROUP));
                small |= mxfp4x_bf16_latents_small(v0) | mxfp4x_bf16_latents_small(v1);
                large |= mxfp4x_bf16_latents_large(v0) | mxfp4x_bf16_latents_large(v1);
                _mm512_storeu_si512((void *)(d + g * MXFP4X_GROUP),
                                    _mm512_permutex2var_epi16(v0, lo_idx, v1));
                _mm512_storeu_si512((void *)(d + (g + 1) * MXFP4X_GROUP),
                                    _mm512_permutex2var_epi16(v0, hi_idx, v1));
            }
        for (; g < n_groups; g++) {
            __m512i v = _mm512_loadu_si512((const void *)(row + g * MXFP4X_GROUP));
            small |= mxfp4x_bf16_latents_small(v);
            large |= mxfp4x_bf16_latents_large(v);
            if (nibbles == MXFP4X_NIBBLES_HALVES) v = _mm512_permutexvar_epi16(halves, v);
            _mm512_storeu_si512((void *)(d + g * MXFP4X_GROUP), v);
        }
        unsafe[i] = mxfp4x_bf16_token_flags(small, large);
    }
}

/* The roofline's bf16 compute peak (mxfp4x_fma_loop_fn): 12 independent vdpbf16ps chains,
 * each instruction 16 lanes x 2 products x 2 FLOPs.  The operands are normal bf16 (1 and
 * seed x 2^-24 rounded), so no flush or overflow changes the instruction's timing. */
MXFP4X_BF16DP_FN float mxfp4x_bf16dp_loop(int64_t iters, float seed, int64_t *flops) {
    __m512 a[12];
    const __m512bh one = (__m512bh)_mm512_set1_epi16((short)0x3F80);
    const __m512bh tiny = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed * 0x1p-24f),
                                              _mm512_set1_ps(seed * 0x1p-24f));
    int64_t i;
    int j;
    float out[16];
    for (j = 0; j < 12; j++) a[j] = _mm512_set1_ps(seed + (float)j);
    for (i = 0; i < iters; i++)
        for (j = 0; j < 12; j++) a[j] = _mm512_dpbf16_ps(a[j], one, tiny);
    for (j = 1; j < 12; j++) a[0] = _mm512_add_ps(a[0], a[j]);
    _mm512_storeu_ps(out, a[0]);
    *flops = iters * 12 * 16 * 4;
    return out[0];
}

/* The dense bf16 product from 5 tokens on (mxfp4x.h, dense_bf16_unit). */
#include "dense/avx512bf16.h"

#endif /* MXFP4X_HAVE_AVX512BF16 */
#endif /* MXFP4X_AVX512BF16_H */
