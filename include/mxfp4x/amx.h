/* mxfp4x/amx.h -- bfloat16 latents on AMX (Intel Sapphire Rapids and later: AMX-TILE +
 * AMX-BF16, with AVX-512 for the decode).  The "amx" ISA is the avx512 kernel table plus
 * mxfp4x_amx_bf16_rows, which a float32-compute forward call with bfloat16 latents uses
 * for every token, at any batch size (so a token's path never depends on its batch).
 *
 * The product: C (16 rows x 16 tokens, float32) += A (16 rows x 32 bf16: one group of 16
 * decoded rows) . B (16 pairs x 16 tokens: the same group of 16 tokens, pairs of bf16 in
 * one dword), one tdpbf16ps per group, C accumulated over every group of the row.
 *
 *   A: each group decoded to bf16 with its scale folded in: e2m1[c] * 2^(s - 127) has one
 *      mantissa bit, so it is a bfloat16 exactly while it is a normal number (s >= 2);
 *      element pair k of a row is (word 2k, word 2k + 1), the low and high nibble of byte
 *      k (pairs arrangement: elements 2k and 2k + 1; GGUF halves: k and k + 16).
 *   B: the latents of an expert's tokens gathered once per call (the driver), in blocks
 *      of up to 16 tokens: block base + ((g * 16 + k) * nb + n) dwords holds pair k of
 *      group g of token n (nb tokens in the block; the tile's other columns read
 *      neighbouring data and are never stored: a column of C depends only on its column
 *      of B).
 *
 * Exactness.  A bf16 latent times a scaled E2M1 value is exact in float32 (8 + 2
 * significant bits); tdpbf16ps adds the products in float32 with round-to-nearest-even,
 * but it treats subnormal inputs as zero and flushes subnormal results, whatever MXCSR
 * says.  Neither can happen when every nonzero weight is at least 2^-59 (every nonzero
 * code of the row's groups has s >= MXFP4X_AMX_MIN_SCALE) and every nonzero finite latent
 * at least 2^-60 in magnitude: then every product, hence every partial sum, is a
 * multiple of 2^-126, zero or normal.  Nor can anything overflow when every latent is
 * under 2^64 and every scale byte under MXFP4X_AMX_MAX_SCALE (160; 255 is NaN).  A token
 * outside these (flagged by the gather) and a block of 16 rows outside them (a scan of
 * its scale bytes) leave the tiles, for every row or token, whatever the batch (so
 * results stay batch-invariant): small values only for avx512bf16.h's float32 path (the
 * vdpbf16ps unit's arithmetic in FMAs, subnormals kept: its bits, not the tiles', where
 * nothing is subnormal), values that could overflow for the exact path, products and
 * sums in float64, elements in natural order, rounded once.
 *
 * Order: what tdpbf16ps does inside one instruction is the hardware's (measured on a
 * Xeon: the even-element and odd-element products of the 16 pairs summed as two
 * sequential float32 chains, then added together and to C); it is the same for every
 * (row, token) cell, whatever the tile's position, so results do not depend on the
 * batch or the thread count (the suite checks both bit for bit).  Up to
 * MXFP4X_AMX_GEMV_MAX_TOKENS tokens a register gemv replays that arithmetic with FMAs
 * (mxfp4x_amx_gemv below): the same bits without the tiles; up to
 * MXFP4X_AMX_FEW_MAX_TOKENS the tiles read A from a small buffer in L1 (mxfp4x_amx_few),
 * above from a panel of 64 decoded rows: the same products in the same order. */
#ifndef MXFP4X_AMX_H
#define MXFP4X_AMX_H

#include "mxfp4x.h"
#include "bf16/unit.h"
#include "avx512bf16.h" /* the float32 path off the unit */

#if MXFP4X_HAVE_AMX
#include <immintrin.h>

#ifdef MXFP4X_EMULATE_AMX /* a test build: the tile instructions in C (emulate_amx.h) */
#include "emulate_amx.h"
#define MXFP4X_TARGET_AMX MXFP4X_TARGET("avx512f,avx512bw,avx2,fma")
#else
#define MXFP4X_TARGET_AMX MXFP4X_TARGET("avx512f,avx512bw,avx2,fma,amx-tile,amx-bf16")
#endif
#define MXFP4X_AMX_FN static MXFP4X_TARGET_AMX
#define MXFP4X_AMX_INLINE static inline MXFP4X_TARGET_AMX MXFP4X_ALWAYS_INLINE

/* Rows and tokens of one tile; row blocks of a task's rows decoded at once (the AMX
 * entry's tile_rows: 4 x 16 = 64). */
#define MXFP4X_AMX_ROWS 16
#define MXFP4X_AMX_TOKENS 16
#define MXFP4X_AMX_ROW_BLOCKS 4
#define MXFP4X_AMX_TILE_ROWS (MXFP4X_AMX_ROW_BLOCKS * MXFP4X_AMX_ROWS)

/* The palette-1 tile configuration (64 bytes, Intel SDM vol. 1, 3.2). */
typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} mxfp4x_amx_config;

/* tmm0..3: C of up to 4 token blocks; tmm4: A; tmm5..7: B.  Every tile 16 x 64 bytes. */
MXFP4X_AMX_INLINE void mxfp4x_amx_configure(void) {
    mxfp4x_amx_config cfg;
    int i;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* One group of one row (bf16/unit.h's decode) stored at dst. */
MXFP4X_AMX_INLINE void mxfp4x_amx_decode_group(const uint8_t *b, uint8_t s, uint16_t *dst) {
    _mm512_storeu_si512((void *)dst, mxfp4x_bf16_decode_group(b, s));
}

/* The exact path of one (row, token): float64 products and sums over the natural element
 * order (the pair order of the B layout: pair k = element lo then hi of byte k). */
static float mxfp4x_amx_exact_dot(const mxfp4x_rows *w, int64_t r, const uint16_t *xb,
                                  int64_t nb, int64_t n) {
    const uint8_t *b = w->blocks + r * w->row_stride_blocks;
    const uint8_t *s = w->scales + r * w->row_stride_scales;
    double acc = 0.0;
    int64_t g;
    int k;
    for (g = 0; g < w->n_groups; g++) {
        const uint8_t *q = b + g * w->group_stride_blocks;
        const double sc = mxfp4x_e8m0_f64(s[g * w->group_stride_scales]);
        for (k = 0; k < 16; k++) {
            const uint16_t *p = xb + 2 * ((g * 16 + k) * nb + n);
            acc += ((double)mxfp4x_e2m1_f32[q[k] & 0xF] * sc) * (double)mxfp4x_bf16_to_f32(p[0]);
            acc += ((double)mxfp4x_e2m1_f32[q[k] >> 4] * sc) * (double)mxfp4x_bf16_to_f32(p[1]);
        }
    }
    return (float)acc;
}

/* What rows [r, r + mr) need instead of the tiles: the union of their flags
 * (bf16/unit.h, row by row; 0: the tiles take them). */
MXFP4X_AMX_INLINE int mxfp4x_amx_rows_unsafe(const mxfp4x_rows *w, int64_t r, int mr) {
    int m, f = 0;
    if (mxfp4x_bf16_rows_safe(w, r, r + mr)) return 0;
    for (m = 0; m < mr; m++) f |= mxfp4x_bf16_row_unsafe(w, r + m);
    return f;
}

/* Token n of a B block (nb tokens from xb) in avx512bf16.h's chunks (d_in words). */
static void mxfp4x_amx_token_chunks(const mxfp4x_rows *w, const uint16_t *xb, int64_t nb,
                                    int64_t n, uint16_t *chunk) {
#if MXFP4X_HAVE_AVX512BF16
    const int64_t G = w->n_groups;
    const int paired = mxfp4x_bf16dp_paired(w->nibbles);
    int64_t g;
    int k;
    for (g = 0; g < G; g++)
        for (k = 0; k < 16; k++) {
            const uint16_t *p = xb + 2 * ((g * 16 + k) * nb + n);
            chunk[mxfp4x_bf16dp_xpos(g, k, G, paired, 0)] = p[0];
            chunk[mxfp4x_bf16dp_xpos(g, k, G, paired, 1)] = p[1];
        }
#else
    (void)w, (void)xb, (void)nb, (void)n, (void)chunk;
#endif
}

/* Rows [r0, r1) . token t (of the call's n_tok, B blocks from xt) off the tiles by
 * `flags` into out[r - r0]: values that could overflow (MXFP4X_BF16_LARGE) by the float64
 * exact path above, small ones by avx512bf16.h's float32 path (the vdpbf16ps unit's
 * arithmetic, subnormals kept) on the token's pairs regathered into its chunks (`chunk`,
 * d_in words; *gathered: whether they already are), where that path is compiled in. */
MXFP4X_AMX_FN void mxfp4x_amx_off_unit(const mxfp4x_rows *w, int64_t r0, int64_t r1,
                                       const uint16_t *xt, int64_t n_tok, int64_t t,
                                       int flags, float *out, uint16_t *chunk,
                                       int *gathered) {
    const int64_t tb = t / MXFP4X_AMX_TOKENS * MXFP4X_AMX_TOKENS;
    const int64_t nb = n_tok - tb < MXFP4X_AMX_TOKENS ? n_tok - tb : MXFP4X_AMX_TOKENS;
    const uint16_t *xb = xt + tb * w->n_groups * MXFP4X_GROUP;
    int64_t r;
#if MXFP4X_HAVE_AVX512BF16
    if (!(flags & MXFP4X_BF16_LARGE)) {
        const uint16_t *x1 = chunk;
        if (!*gathered) mxfp4x_amx_token_chunks(w, xb, nb, t - tb, chunk);
        *gathered = 1;
        mxfp4x_bf16dp_off_unit(w, r0, r1, &x1, 1, 0, &out);
        return;
    }
#else
    (void)flags, (void)chunk, (void)gathered;
#endif
    for (r = r0; r < r1; r++) out[r - r0] = mxfp4x_amx_exact_dot(w, r, xb, nb, t - tb);
}

/* The pass off the tiles, after a call's tiles or gemv wrote every (row, token): each
 * (row block of 16, token) flagged by the block's rows or by the token's latents is
 * written again, by their union (bf16/unit.h), which depends on the rows or the token
 * alone, never on the batch.  First each flagged block, for every token (each block's
 * scale bytes scanned once, as the tiles' loop did); then each flagged token, for the
 * other blocks (all rows at once where none is flagged), its chunks gathered once. */
MXFP4X_AMX_FN void mxfp4x_amx_off_pass(const mxfp4x_rows *w, int64_t row_start,
                                       int64_t row_end, const uint16_t *xt,
                                       const uint8_t *unsafe, int64_t n_tok, float *out,
                                       int64_t out_stride, uint16_t *chunk) {
    const int rows_bad = !mxfp4x_bf16_rows_safe(w, row_start, row_end);
    int64_t r, re, t;
    int any = 0, fb, gathered;
    for (t = 0; t < n_tok; t++) any |= unsafe[t];
    for (r = row_start; rows_bad && r < row_end; r = re) {
        re = row_end - r < MXFP4X_AMX_ROWS ? row_end : r + MXFP4X_AMX_ROWS;
        fb = mxfp4x_amx_rows_unsafe(w, r, (int)(re - r));
        for (t = 0; fb && t < n_tok; t++) {
            gathered = 0;
            mxfp4x_amx_off_unit(w, r, re, xt, n_tok, t, fb | unsafe[t],
                                out + t * out_stride + (r - row_start), chunk, &gathered);
        }
    }
    for (t = 0; any && t < n_tok; t++) {
        if (!unsafe[t]) continue;
        gathered = 0;
        if (!rows_bad) {
            mxfp4x_amx_off_unit(w, row_start, row_end, xt, n_tok, t, unsafe[t],
                                out + t * out_stride, chunk, &gathered);
            continue;
        }
        for (r = row_start; r < row_end; r = re) {
            re = row_end - r < MXFP4X_AMX_ROWS ? row_end : r + MXFP4X_AMX_ROWS;
            if (!mxfp4x_amx_rows_unsafe(w, r, (int)(re - r)))
                mxfp4x_amx_off_unit(w, r, re, xt, n_tok, t, unsafe[t],
                                    out + t * out_stride + (r - row_start), chunk, &gathered);
        }
    }
}

/* Rows [r, r + mr) (mr <= 16) decoded into panel[g][16][32] (rows past mr zero). */
MXFP4X_AMX_INLINE void mxfp4x_amx_decode_block(const mxfp4x_rows *w, int64_t r, int mr,
                                               uint16_t *panel) {
    const int64_t G = w->n_groups, gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t g;
    int m;
    for (m = 0; m < mr; m++) {
        const uint8_t *b = w->blocks + (r + m) * w->row_stride_blocks;
        const uint8_t *s = w->scales + (r + m) * w->row_stride_scales;
        uint16_t *d = panel + m * MXFP4X_GROUP;
        for (g = 0; g < G; g++)
            mxfp4x_amx_decode_group(b + g * gb, s[g * gs], d + g * MXFP4X_AMX_ROWS * MXFP4X_GROUP);
    }
    for (; m < MXFP4X_AMX_ROWS; m++)
        for (g = 0; g < G; g++)
            memset(panel + (g * MXFP4X_AMX_ROWS + m) * MXFP4X_GROUP, 0, MXFP4X_GROUP * 2);
}

/* The C tiles of nrb row blocks x ntb token blocks (nrb * ntb <= 4: tmm0..3) over every
 * group: A of row block i at a[i] + g * 512 (stride 64 bytes), B of token block j at
 * xb[j] + g * 16 * strides[j] bytes; C (i, j) stored to c + (i * ntb + j) * 256 (16 x 16).
 * Each C accumulates its groups in order, one tdpbf16ps per group, whatever the shape:
 * the shapes only give the tile unit independent chains (one chain is latency-bound:
 * docs/performance.md, "The bf16 units, AMX and float64").  A in tmm4 / tmm6, B in
 * tmm5 / tmm7. */
#define MXFP4X_AMX_A(T, I) _tile_loadd(T, a[I] + g * 512, 64);
#define MXFP4X_AMX_B(T, J) _tile_loadd(T, (const char *)xb[J] + g * 16 * strides[J], strides[J]);
MXFP4X_AMX_INLINE void mxfp4x_amx_zero(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

MXFP4X_AMX_INLINE void mxfp4x_amx_store(float *c) {
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* The C tiles mxfp4x_amx_store left at c, nrb row blocks x ntb token blocks (token block j:
 * tokens tb[j] .. tb[j] + nb[j]), into out (token-major, out_stride apart) from row rr of
 * it; rows from the `rows`-th on (counted from rr) are not stored.  What leaves the unit
 * is written again after (the pass off the tiles). */
MXFP4X_AMX_INLINE void mxfp4x_amx_c_out(const float *c, int nrb, int ntb, const int64_t *tb,
                                        const int64_t *nb, int64_t rr, int64_t rows,
                                        float *out, int64_t out_stride) {
    int i, j, m;
    int64_t n;
    for (i = 0; i < nrb; i++)
        for (j = 0; j < ntb; j++)
            for (n = 0; n < nb[j]; n++) {
                const float *ci = c + (i * ntb + j) * 256;
                float *o = out + (tb[j] + n) * out_stride + rr + i * MXFP4X_AMX_ROWS;
                for (m = 0; m < MXFP4X_AMX_ROWS && i * MXFP4X_AMX_ROWS + m < rows; m++)
                    o[m] = ci[m * 16 + n];
            }
}

MXFP4X_AMX_INLINE void mxfp4x_amx_tiles(const uint16_t *const *a, int nrb,
                                        const uint16_t *const *xb, const int64_t *strides,
                                        int ntb, int64_t G) {
    int64_t g;
    switch (nrb * 8 + ntb) {
    case 4 * 8 + 1:
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_B(5, 0)
            MXFP4X_AMX_A(4, 0) _tile_dpbf16ps(0, 4, 5);
            MXFP4X_AMX_A(6, 1) _tile_dpbf16ps(1, 6, 5);
            MXFP4X_AMX_A(4, 2) _tile_dpbf16ps(2, 4, 5);
            MXFP4X_AMX_A(6, 3) _tile_dpbf16ps(3, 6, 5);
        }
        break;
    case 3 * 8 + 1:
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_B(5, 0)
            MXFP4X_AMX_A(4, 0) _tile_dpbf16ps(0, 4, 5);
            MXFP4X_AMX_A(6, 1) _tile_dpbf16ps(1, 6, 5);
            MXFP4X_AMX_A(4, 2) _tile_dpbf16ps(2, 4, 5);
        }
        break;
    case 2 * 8 + 1:
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_B(5, 0)
            MXFP4X_AMX_A(4, 0) _tile_dpbf16ps(0, 4, 5);
            MXFP4X_AMX_A(6, 1) _tile_dpbf16ps(1, 6, 5);
        }
        break;
    case 2 * 8 + 2:
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_A(4, 0) MXFP4X_AMX_B(5, 0) MXFP4X_AMX_B(7, 1)
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 7);
            MXFP4X_AMX_A(6, 1)
            _tile_dpbf16ps(2, 6, 5);
            _tile_dpbf16ps(3, 6, 7);
        }
        break;
    case 1 * 8 + 4:
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_A(4, 0)
            MXFP4X_AMX_B(5, 0) _tile_dpbf16ps(0, 4, 5);
            MXFP4X_AMX_B(7, 1) _tile_dpbf16ps(1, 4, 7);
            MXFP4X_AMX_B(5, 2) _tile_dpbf16ps(2, 4, 5);
            MXFP4X_AMX_B(7, 3) _tile_dpbf16ps(3, 4, 7);
        }
        break;
    case 1 * 8 + 3:
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_A(4, 0)
            MXFP4X_AMX_B(5, 0) _tile_dpbf16ps(0, 4, 5);
            MXFP4X_AMX_B(7, 1) _tile_dpbf16ps(1, 4, 7);
            MXFP4X_AMX_B(5, 2) _tile_dpbf16ps(2, 4, 5);
        }
        break;
    case 1 * 8 + 2:
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_A(4, 0)
            MXFP4X_AMX_B(5, 0) _tile_dpbf16ps(0, 4, 5);
            MXFP4X_AMX_B(7, 1) _tile_dpbf16ps(1, 4, 7);
        }
        break;
    default: /* 1 x 1 */
        for (g = 0; g < G; g++) {
            MXFP4X_AMX_A(4, 0) MXFP4X_AMX_B(5, 0) _tile_dpbf16ps(0, 4, 5);
        }
        break;
    }
}

/* ---- up to 64 tokens: the tiles fed from L1 ----
 * Through the panel a row block's decoded groups (23 KiB of gpt-oss rows) leave L1 before
 * the tiles read them back; at a few tokens per expert, where the products are few, that
 * round trip bounds the call.  Here a chunk of rows is decoded a few groups at a time
 * into a small buffer that the tiles read at once. */
/* groups decoded per step (up to 64 rows x this many groups: 4 KiB each) */
#ifndef MXFP4X_AMX_FEW_GROUPS
#define MXFP4X_AMX_FEW_GROUPS 4
#endif
/* up to this many tokens per expert (4 blocks of 16: 4 C tiles of one row block) */
#ifndef MXFP4X_AMX_FEW_MAX_TOKENS
#define MXFP4X_AMX_FEW_MAX_TOKENS 64
#endif
MXFP4X_STATIC_ASSERT(MXFP4X_AMX_FEW_MAX_TOKENS <= 4 * MXFP4X_AMX_TOKENS,
                     "amx few-token tiles: at most 4 C tiles");
#define MXFP4X_AMX_FEW_STEP_ELEMS (MXFP4X_AMX_FEW_GROUPS * MXFP4X_AMX_TILE_ROWS * MXFP4X_GROUP)
#define MXFP4X_AMX_BLOCK_ELEMS (MXFP4X_AMX_ROWS * MXFP4X_GROUP)

/* Rows [r0, r0 + rows), groups [g0, g0 + gc) (gc <= MXFP4X_AMX_FEW_GROUPS) decoded into
 * buf[i][j][16][32] (row block i, group g0 + j, as mxfp4x_amx_tiles reads A), a line of
 * the next rows (pf) fetched per row.  Rows past `rows` in its last block keep what they
 * hold: their C rows are never stored. */
MXFP4X_AMX_INLINE void mxfp4x_amx_few_decode(const mxfp4x_rows *w, int64_t r0, int rows,
                                             int64_t g0, int gc, uint16_t *buf,
                                             mxfp4x_pf_cursor *pf) {
    const int64_t sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    const uint8_t *bp = w->blocks + r0 * sb + g0 * gb, *sp = w->scales + r0 * ss + g0 * gs;
    int m, j;
    for (m = 0; m < rows; m++, bp += sb, sp += ss) {
        uint16_t *d = buf + (m / MXFP4X_AMX_ROWS) * MXFP4X_AMX_FEW_GROUPS * MXFP4X_AMX_BLOCK_ELEMS +
                      (m % MXFP4X_AMX_ROWS) * MXFP4X_GROUP;
        if (gc == MXFP4X_AMX_FEW_GROUPS) {
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 8
#endif
            for (j = 0; j < MXFP4X_AMX_FEW_GROUPS; j++)
                _mm512_store_si512((void *)(d + j * MXFP4X_AMX_BLOCK_ELEMS),
                                   mxfp4x_bf16_decode_group(bp + j * gb, sp[j * gs]));
        } else {
            for (j = 0; j < gc; j++)
                _mm512_store_si512((void *)(d + j * MXFP4X_AMX_BLOCK_ELEMS),
                                   mxfp4x_bf16_decode_group(bp + j * gb, sp[j * gs]));
        }
        if (pf->p < pf->end) MXFP4X_PF_LINE(*pf);
    }
}

/* mxfp4x_amx_bf16_rows for n_tok <= MXFP4X_AMX_FEW_MAX_TOKENS: the 4 C tiles as row
 * blocks x token blocks (4 x 1 up to 16 tokens, 2 x 2 up to 32, 1 x 4 up to 64), a chunk
 * of their rows at a time, accumulating its groups in order, one tdpbf16ps per group, as
 * the panel path does (so the same bits), A from the step's buffer; the next chunk's
 * rows (or the next call's) stream into L2 meanwhile.  buf: MXFP4X_AMX_FEW_STEP_ELEMS
 * elements, 64-byte aligned; c: 4 x 256 floats. */
MXFP4X_AMX_FN void mxfp4x_amx_few(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                  const uint16_t *xt, int64_t n_tok, float *out,
                                  int64_t out_stride, uint16_t *buf, float *c) {
    const int64_t G = w->n_groups, d_in = G * MXFP4X_GROUP;
    const int ntb = (int)((n_tok + MXFP4X_AMX_TOKENS - 1) / MXFP4X_AMX_TOKENS);
    const int rstep = ntb >= 3 ? 1 : ntb == 2 ? 2 : 4;
    const int chunk = rstep * MXFP4X_AMX_ROWS;
    const uint16_t *a[4], *xb[4];
    int64_t strides[4], nb[4], tb[4], r0, g0;
    int rows, nrb, i, j, gc;
    for (i = 0; i < 4; i++) a[i] = buf + i * MXFP4X_AMX_FEW_GROUPS * MXFP4X_AMX_BLOCK_ELEMS;
    for (j = 0; j < ntb; j++) {
        tb[j] = j * MXFP4X_AMX_TOKENS;
        nb[j] = n_tok - j * MXFP4X_AMX_TOKENS < MXFP4X_AMX_TOKENS ? n_tok - j * MXFP4X_AMX_TOKENS
                                                                 : MXFP4X_AMX_TOKENS;
        strides[j] = nb[j] * 4;
    }
    mxfp4x_amx_configure();
    for (r0 = row_start; r0 < row_end; r0 += chunk) {
        mxfp4x_pf_cursor pf = mxfp4x_pf_block_ahead(w, r0, chunk, row_end, 1);
        rows = row_end - r0 < chunk ? (int)(row_end - r0) : chunk;
        nrb = (rows + MXFP4X_AMX_ROWS - 1) / MXFP4X_AMX_ROWS;
        mxfp4x_amx_zero();
        for (g0 = 0; g0 < G; g0 += MXFP4X_AMX_FEW_GROUPS) {
            gc = G - g0 < MXFP4X_AMX_FEW_GROUPS ? (int)(G - g0) : MXFP4X_AMX_FEW_GROUPS;
            mxfp4x_amx_few_decode(w, r0, rows, g0, gc, buf, &pf);
            for (j = 0; j < ntb; j++) /* B of the step's groups */
                xb[j] = xt + j * MXFP4X_AMX_TOKENS * d_in + g0 * 16 * nb[j] * 2;
            mxfp4x_amx_tiles(a, nrb, xb, strides, ntb, gc);
        }
        mxfp4x_amx_store(c);
        mxfp4x_amx_c_out(c, nrb, ntb, tb, nb, r0 - row_start, rows, out, out_stride);
    }
    _tile_release();
}

/* a few tokens: the tiles' arithmetic in AVX-512 FMAs */
#include "bf16/amx_gemv.h"

/* Panel elements of mxfp4x_amx_bf16_rows for n_groups groups: 4 blocks of 16 rows of
 * every group.  (Decoding in L1-sized chunks of groups, each multiplied at once, was no
 * faster: docs/performance.md, "The bf16 units, AMX and float64".) */
static int64_t mxfp4x_amx_panel_elems(int64_t n_groups) {
    return MXFP4X_AMX_ROW_BLOCKS * n_groups * MXFP4X_AMX_ROWS * MXFP4X_GROUP;
}
/* ... or the few-token tiles' step buffer, the larger */
static int64_t mxfp4x_amx_a_elems(int64_t n_groups) {
    const int64_t p = mxfp4x_amx_panel_elems(n_groups);
    return p > MXFP4X_AMX_FEW_STEP_ELEMS ? p : MXFP4X_AMX_FEW_STEP_ELEMS;
}

/* Scratch (bytes) of mxfp4x_amx_bf16_rows: the panel and the 4 C tiles, or the gemv's. */
static int64_t mxfp4x_amx_work_bytes(int64_t n_groups) {
    const int64_t tiles = mxfp4x_amx_a_elems(n_groups) * 2 + 4 * 256 * 4;
    const int64_t gemv = mxfp4x_amx_gemv_floats(n_groups) * 4;
    return ((tiles > gemv ? tiles : gemv) + 63) / 64 * 64;
}
/* ... and after them one token's chunks for the pass off the tiles (d_in words). */
static int64_t mxfp4x_amx_scratch_bytes(int64_t n_groups) {
    return mxfp4x_amx_work_bytes(n_groups) + n_groups * MXFP4X_GROUP * 2 + 64;
}

/* out[t * out_stride + r - row_start] = W[r] . x_t for r in [row_start, row_end), t <
 * n_tok: x_t's pairs in the B blocks from xt (block b at xt + 16 b d_in elements),
 * unsafe[t] nonzero for a token off the unit (the gather's flags).  row_start a multiple
 * of 16 apart from the rows' own origin (the driver's tiles are), so the 16-row blocks,
 * hence each row's path, do not depend on the split.  `scratch`: mxfp4x_amx_scratch_bytes(G) bytes
 * at any alignment.
 * Up to 4 tokens the register gemv, up to 64 the tiles fed from L1; above, the rows go in
 * chunks of up to 4 blocks of 16, decoded once into the panel, and the tokens in blocks
 * of 16, 4 C tiles at a time: 4 row blocks x 1 token block, or 2 x 2 for 2 blocks of
 * tokens.  (1 x 4 read every token's B once per row block: from L3 once they outgrow L2,
 * twice the time at 512 tokens.) */
MXFP4X_AMX_FN void mxfp4x_amx_bf16_rows(const mxfp4x_rows *w, int64_t row_start,
                                        int64_t row_end, const uint16_t *xt,
                                        const uint8_t *unsafe, int64_t n_tok, float *out,
                                        int64_t out_stride, void *scratch) {
    const int64_t G = w->n_groups, d_in = G * MXFP4X_GROUP;
    const int64_t blk_elems = G * MXFP4X_AMX_ROWS * MXFP4X_GROUP;
    /* 64-byte aligned: a tile row or a decoded group split over two lines cost about
     * twice the time (the driver's scratch is carved at no particular alignment) */
    uint16_t *panel = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *c = (float *)(panel + mxfp4x_amx_a_elems(G));
    uint16_t *chunk = (uint16_t *)((char *)panel + mxfp4x_amx_work_bytes(G));
    const uint16_t *xb[4], *a[4];
    int64_t strides[4], nb[4], tb[4], r, r0, t0;
    int mrs[MXFP4X_AMX_ROW_BLOCKS];
    int n_rb, rb, i, j, nrb, ntb, rstep, tstep;
    const int n_tb = (int)((n_tok + MXFP4X_AMX_TOKENS - 1) / MXFP4X_AMX_TOKENS);
    if (n_tok <= MXFP4X_AMX_GEMV_MAX_TOKENS) { /* the same bits without the tiles */
        /* tokens all flagged (a SwiGLU output under 2^-60, say): the pass off the unit
         * writes every (row, token) of theirs, so the gemv would be done twice */
        int all_off = 1;
        for (t0 = 0; t0 < n_tok; t0++) all_off &= unsafe[t0] != 0;
        if (!all_off)
            mxfp4x_amx_gemv(w, row_start, row_end, xt, n_tok, out, out_stride, (float *)panel);
        mxfp4x_amx_off_pass(w, row_start, row_end, xt, unsafe, n_tok, out, out_stride, chunk);
        return;
    }
    if (n_tok <= MXFP4X_AMX_FEW_MAX_TOKENS) { /* the tiles fed from L1 */
        mxfp4x_amx_few(w, row_start, row_end, xt, n_tok, out, out_stride, panel, c);
        mxfp4x_amx_off_pass(w, row_start, row_end, xt, unsafe, n_tok, out, out_stride, chunk);
        return;
    }
    /* the shape of the C tiles: row blocks x token blocks */
    rstep = n_tb == 2 ? 2 : 4;
    tstep = 4 / rstep;
    mxfp4x_amx_configure();
    for (r0 = row_start; r0 < row_end; r0 += MXFP4X_AMX_TILE_ROWS) {
        n_rb = 0;
        for (r = r0; r < row_end && n_rb < MXFP4X_AMX_ROW_BLOCKS; r += MXFP4X_AMX_ROWS) {
            mrs[n_rb] = row_end - r < MXFP4X_AMX_ROWS ? (int)(row_end - r) : MXFP4X_AMX_ROWS;
            n_rb++;
        }
        for (i = 0; i < n_rb; i++)
            mxfp4x_amx_decode_block(w, r0 + i * MXFP4X_AMX_ROWS, mrs[i], panel + i * blk_elems);
        for (rb = 0; rb < n_rb; rb += rstep) {
            nrb = n_rb - rb < rstep ? n_rb - rb : rstep;
            for (t0 = 0; t0 < n_tb; t0 += tstep) {
                ntb = n_tb - t0 < tstep ? (int)(n_tb - t0) : tstep;
                for (i = 0; i < nrb; i++) a[i] = panel + (rb + i) * blk_elems;
                for (j = 0; j < ntb; j++) {
                    tb[j] = (t0 + j) * MXFP4X_AMX_TOKENS;
                    nb[j] = n_tok - tb[j] < MXFP4X_AMX_TOKENS ? n_tok - tb[j] : MXFP4X_AMX_TOKENS;
                    xb[j] = xt + tb[j] * d_in;
                    strides[j] = nb[j] * 4;
                }
                mxfp4x_amx_zero();
                mxfp4x_amx_tiles(a, nrb, xb, strides, ntb, G);
                mxfp4x_amx_store(c);
                mxfp4x_amx_c_out(c, nrb, ntb, tb, nb, r0 + rb * MXFP4X_AMX_ROWS - row_start,
                                 row_end - (r0 + rb * MXFP4X_AMX_ROWS), out, out_stride);
            }
        }
    }
    _tile_release();
    mxfp4x_amx_off_pass(w, row_start, row_end, xt, unsafe, n_tok, out, out_stride, chunk);
}

/* Gather the latents of n pairs (token rows src[0..n) of x, natural order, bf16 bits,
 * row stride x_stride elements) into B blocks at dst (n * d_in elements), in the element
 * order of arrangement `nibbles`; unsafe[i] = what token i needs instead of the unit
 * (MXFP4X_BF16_SMALL: a nonzero finite latent under 2^-60 in magnitude, |bits| in 1 ..
 * 0x217F, bf16 exponent field under 67, subnormals included; MXFP4X_BF16_LARGE: one of at
 * least 2^64, infinities and NaNs included, exponent field 191 or more; 0: neither).
 * Per token and group: one 64-byte load, the check, (GGUF halves: one vpermw into pairs)
 * and a scatter of its 16 pairs at stride nb dwords. */
MXFP4X_AMX_FN void mxfp4x_amx_gather(const uint16_t *x, int64_t x_stride, const int64_t *src,
                                     int64_t n, int64_t n_groups, int nibbles, uint16_t *dst,
                                     uint8_t *unsafe) {
    const int64_t d_in = n_groups * MXFP4X_GROUP;
    /* halves: pair k = (element k, element k + 16) */
    const __m512i halves = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                            9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                            17, 1, 16, 0);
    int64_t tb, i, g;
    for (tb = 0; tb < n; tb += MXFP4X_AMX_TOKENS) {
        const int64_t nb = n - tb < MXFP4X_AMX_TOKENS ? n - tb : MXFP4X_AMX_TOKENS;
        const __m512i vidx = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32((int)nb));
        uint16_t *blk = dst + tb * d_in;
        for (i = 0; i < nb; i++) {
            const uint16_t *row = x + src[tb + i] * x_stride;
            __mmask32 small = 0, large = 0;
            for (g = 0; g < n_groups; g++) {
                __m512i v = _mm512_loadu_si512((const void *)(row + g * MXFP4X_GROUP));
                small |= mxfp4x_bf16_latents_small(v);
                large |= mxfp4x_bf16_latents_large(v);
                if (nibbles == MXFP4X_NIBBLES_HALVES) v = _mm512_permutexvar_epi16(halves, v);
                _mm512_i32scatter_epi32((void *)(blk + 2 * (g * 16 * nb + i)), vidx, v, 4);
            }
            unsafe[tb + i] = mxfp4x_bf16_token_flags(small, large);
        }
    }
}

/* The roofline's bf16 compute peak (mxfp4x_fma_loop_fn): six independent tdpbf16ps
 * chains (C in tmm0..5, A and B loaded once into tmm6 and tmm7; four were slower on a
 * Xeon), each instruction 16 x 16 cells x 32 products x 2 FLOPs.  The
 * operands are normal bf16 (1 and seed x 2^-24 truncated), so no flush or overflow
 * changes the instruction's timing. */
MXFP4X_AMX_FN float mxfp4x_amx_loop(int64_t iters, float seed, int64_t *flops) {
    MXFP4X_ALIGN64 uint16_t ab[2][16 * 32];
    MXFP4X_ALIGN64 float c[256];
    const float t = seed * 0x1p-24f;
    uint32_t u;
    uint16_t tiny;
    int64_t i;
    int j;
    memcpy(&u, &t, 4);
    tiny = (uint16_t)(u >> 16);
    for (j = 0; j < 16 * 32; j++) {
        ab[0][j] = 0x3F80; /* 1 */
        ab[1][j] = tiny;
    }
    mxfp4x_amx_configure();
    _tile_loadd(6, ab[0], 64);
    _tile_loadd(7, ab[1], 64);
    mxfp4x_amx_zero();
    _tile_zero(4);
    _tile_zero(5);
    for (i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 6, 7);
        _tile_dpbf16ps(1, 6, 7);
        _tile_dpbf16ps(2, 6, 7);
        _tile_dpbf16ps(3, 6, 7);
        _tile_dpbf16ps(4, 6, 7);
        _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(0, c, 64);
    _tile_release();
    *flops = iters * 6 * 16 * 16 * 32 * 2;
    return c[0];
}

#endif /* MXFP4X_HAVE_AMX */
#endif /* MXFP4X_AMX_H */
