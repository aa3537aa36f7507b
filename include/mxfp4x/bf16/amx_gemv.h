/* mxfp4x/bf16/amx_gemv.h -- amx's few-token path: tdpbf16ps's arithmetic replayed in
 * AVX-512 FMAs (the tiles' bits without the tiles).  Part of amx.h, included there inside
 * its target region: it uses that header's macros and what it defines before the include. */
#ifndef MXFP4X_BF16_AMX_GEMV_H
#define MXFP4X_BF16_AMX_GEMV_H

/* ---- a few tokens: tdpbf16ps's arithmetic in AVX-512 FMAs ----
 *
 * At a few tokens per expert the tiles lose to a register gemv: the decode to bf16 and the
 * tile instructions take their time one after the other, even fed from L1
 * (MXFP4X_AMX_GEMV_MAX_TOKENS below).
 * This gemv gives the tiles' bits.  tdpbf16ps computes, per cell and group (measured on
 * a Xeon, bit for bit on 10^6 cells of random operands):
 *
 *     E = sum over pairs k = 0..15 of a[2k] b[2k], O = the same of a[2k+1] b[2k+1], each
 *     a float32 round-to-nearest-even chain in k from 0;  C = C + (E + O).
 *
 * Here the 16 lanes of a vector are 16 rows (a group's bytes transposed), so each chain
 * is one FMA per pair with the token's latent broadcast: every product is exact in
 * float32, and an FMA rounds the sum once, as the unit does.  The scale is taken out of
 * the chains: E and O are summed on the unscaled E2M1 values, and C += 2^(s-127) (E + O)
 * by one FMA.  Multiplying by a power of two commutes with each rounding while the values
 * stay normal and finite, which the exact-path conditions ensure (tables.h: unscaled
 * products are at least 2^-61 and under 2^67, scaled ones multiples of 2^-126 under
 * 2^104), so every step equals the tile's. */
/* Up to this many tokens per expert the gemv outruns the tiles streaming from DRAM (a Xeon:
 * docs/performance.md, "Few tokens and the path switches"). */
#ifndef MXFP4X_AMX_GEMV_MAX_TOKENS
#define MXFP4X_AMX_GEMV_MAX_TOKENS 4
#endif
/* groups whose chains the one-token gemv runs side by side */
#ifndef MXFP4X_AMX_GEMV_NG
#define MXFP4X_AMX_GEMV_NG 2
#endif
/* the gemv reads its tokens as one B block (at most 16) */
MXFP4X_STATIC_ASSERT(MXFP4X_AMX_GEMV_MAX_TOKENS >= 0 && MXFP4X_AMX_GEMV_MAX_TOKENS <= 16,
                     "amx gemv: at most one block of tokens");
static int mxfp4x_amx_gemv_max_tokens(void) { return MXFP4X_AMX_GEMV_MAX_TOKENS; }
/* Round to nearest even whatever MXCSR says, as the tile unit does. */
#define MXFP4X_AMX_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* 16 bytes of 16 rows (b[i] + off: row i's) transposed: r[j] lane i = bytes 4j .. 4j + 3
 * of row i (only the first n bytes read when n < 16, the others zero). */
#define MXFP4X_AMX_LOAD16(p, n)                                                           \
    ((n) >= 16 ? _mm_loadu_si128((const __m128i *)(p))                                     \
               : _mm512_castsi512_si128(                                                   \
                     _mm512_maskz_loadu_epi8((__mmask64)((1ull << (n)) - 1), (const void *)(p))))
MXFP4X_AMX_INLINE void mxfp4x_amx_transpose16(const uint8_t *const *b, int64_t off, __m512i *r,
                                              int n) {
    __m512i z[4], t0, t1, t2, t3;
    int a;
    for (a = 0; a < 4; a++) {
        z[a] = _mm512_castsi128_si512(MXFP4X_AMX_LOAD16(b[a] + off, n));
        z[a] = _mm512_inserti32x4(z[a], MXFP4X_AMX_LOAD16(b[a + 4] + off, n), 1);
        z[a] = _mm512_inserti32x4(z[a], MXFP4X_AMX_LOAD16(b[a + 8] + off, n), 2);
        z[a] = _mm512_inserti32x4(z[a], MXFP4X_AMX_LOAD16(b[a + 12] + off, n), 3);
    }
    t0 = _mm512_unpacklo_epi32(z[0], z[1]);
    t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    t2 = _mm512_unpacklo_epi32(z[2], z[3]);
    t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    r[0] = _mm512_unpacklo_epi64(t0, t2);
    r[1] = _mm512_unpackhi_epi64(t0, t2);
    r[2] = _mm512_unpacklo_epi64(t1, t3);
    r[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 rows (b[i], scale floats sf[g * 16 + i] = 2^(s - 127), or 0 for s = 0) x nt tokens
 * (xf[t]: token t's latents as float32, the low and high words of pair k of group g at
 * g * 32 + k and g * 32 + 16 + k): c[t] lane i = row i . token t. */
MXFP4X_AMX_INLINE void mxfp4x_amx_gemv_groups(const uint8_t *const *b, int64_t gb, int64_t g,
                                              int ng, const float *sf,
                                              const float *const *xf, int nt, __m512 *c,
                                              __m512 tab) {
    __m512 e[MXFP4X_AMX_GEMV_NG][4], o[MXFP4X_AMX_GEMV_NG][4];
    __m512i r[MXFP4X_AMX_GEMV_NG][4];
    int h, j, q, t;
    for (h = 0; h < ng; h++) {
        mxfp4x_amx_transpose16(b, (g + h) * gb, r[h], 16);
        for (t = 0; t < nt; t++) e[h][t] = o[h][t] = _mm512_setzero_ps();
    }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 4
#endif
    for (j = 0; j < 4; j++)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 4
#endif
        for (q = 0; q < 4; q++)
            for (h = 0; h < ng; h++) {
                const int k = 4 * j + q;
                const float *xg = NULL;
                const __m512i lo = q ? _mm512_srli_epi32(r[h][j], 8 * q) : r[h][j];
                const __m512 vlo = _mm512_permutexvar_ps(lo, tab);
                const __m512 vhi =
                    _mm512_permutexvar_ps(_mm512_srli_epi32(r[h][j], 8 * q + 4), tab);
                for (t = 0; t < nt; t++) {
                    xg = xf[t] + (g + h) * 32;
                    e[h][t] = _mm512_fmadd_round_ps(vlo, _mm512_set1_ps(xg[k]), e[h][t],
                                                    MXFP4X_AMX_RNE);
                    o[h][t] = _mm512_fmadd_round_ps(vhi, _mm512_set1_ps(xg[16 + k]), o[h][t],
                                                    MXFP4X_AMX_RNE);
                }
            }
    for (h = 0; h < ng; h++) { /* C += 2^(s-127) (E + O), group after group */
        const __m512 sc = _mm512_loadu_ps(sf + (g + h) * 16);
        for (t = 0; t < nt; t++)
            c[t] = _mm512_fmadd_round_ps(sc, _mm512_add_round_ps(e[h][t], o[h][t], MXFP4X_AMX_RNE),
                                         c[t], MXFP4X_AMX_RNE);
    }
}

MXFP4X_AMX_INLINE void mxfp4x_amx_gemv_block(const uint8_t *const *b, int64_t gb, int64_t G,
                                             const float *sf, const float *const *xf, int nt,
                                             __m512 *c, mxfp4x_pf_cursor pf) {
    const __m512 tab = _mm512_loadu_ps(mxfp4x_e2m1_f32);
    /* one token: groups side by side, as each group's two chains are 16 dependent FMAs
     * (faster in L2 on a Xeon, no faster at two tokens: docs/performance.md) */
    const int ng = nt == 1 ? MXFP4X_AMX_GEMV_NG : 1;
    int64_t g;
    int t, h;
    for (t = 0; t < nt; t++) c[t] = _mm512_setzero_ps();
    for (g = 0; g + ng <= G; g += ng) {
        /* the next 16 rows: 4 lines per group (4.5 with the extra steps: GGUF's 4.25) */
        for (h = 0; h < ng; h++) {
            MXFP4X_PF_STEP(pf, g + h);
            MXFP4X_PF_STEP(pf, g + h);
            MXFP4X_PF_STEP(pf, g + h);
            MXFP4X_PF_STEP(pf, g + h);
        }
        mxfp4x_amx_gemv_groups(b, gb, g, ng, sf, xf, nt, c, tab);
    }
    for (; g < G; g++) {
        MXFP4X_PF_STEP(pf, g);
        MXFP4X_PF_STEP(pf, g);
        MXFP4X_PF_STEP(pf, g);
        MXFP4X_PF_STEP(pf, g);
        mxfp4x_amx_gemv_groups(b, gb, g, 1, sf, xf, nt, c, tab);
    }
}

/* The full-width cases compiled apart, their accumulators in registers. */
#define MXFP4X_AMX_GEMV_BLOCK(N)                                                           \
    static MXFP4X_TARGET_AMX __attribute__((noinline)) void mxfp4x_amx_gemv_block##N(     \
        const uint8_t *const *b, int64_t gb, int64_t G, const float *sf,                  \
        const float *const *xf, __m512 *c, mxfp4x_pf_cursor pf) {                         \
        mxfp4x_amx_gemv_block(b, gb, G, sf, xf, N, c, pf);                                \
    }
MXFP4X_AMX_GEMV_BLOCK(1)
MXFP4X_AMX_GEMV_BLOCK(2)
MXFP4X_AMX_GEMV_BLOCK(3)
MXFP4X_AMX_GEMV_BLOCK(4)

/* Scratch floats of mxfp4x_amx_gemv: the latents of MXFP4X_AMX_GEMV_MAX_TOKENS tokens
 * and one block's scale floats. */
static int64_t mxfp4x_amx_gemv_floats(int64_t n_groups) {
    return (MXFP4X_AMX_GEMV_MAX_TOKENS * MXFP4X_GROUP + MXFP4X_AMX_ROWS) * n_groups + 16;
}

/* mxfp4x_amx_bf16_rows for n_tok <= MXFP4X_AMX_GEMV_MAX_TOKENS (one block of tokens in
 * xt): the same bits, without tiles. */
MXFP4X_AMX_FN void mxfp4x_amx_gemv(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                   const uint16_t *xt, int64_t n_tok, float *out,
                                   int64_t out_stride, float *scratch) {
    const int64_t G = w->n_groups, d_in = G * MXFP4X_GROUP;
    const int64_t sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    float *sf = scratch + MXFP4X_AMX_GEMV_MAX_TOKENS * d_in;
    const float *xf[MXFP4X_AMX_GEMV_MAX_TOKENS];
    const uint8_t *b[MXFP4X_AMX_ROWS], *sp[MXFP4X_AMX_ROWS];
    __m512 c[4];
    int64_t r, g, t, t0;
    int i, mr, nt;
    /* the tokens' pairs as float32: token t's pair k of group g is dword (g * 16 + k) *
     * n_tok + t of the block */
    for (t = 0; t < n_tok; t++) {
        float *x = scratch + t * d_in;
        const __m512i idx = _mm512_mullo_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
            _mm512_set1_epi32((int)n_tok));
        for (g = 0; g < G; g++) {
            const __m512i p = _mm512_i32gather_epi32(
                idx, (const void *)(xt + 2 * (g * 16 * n_tok + t)), 4);
            /* pair k = (lo, hi) words: lo << 16 and hi & 0xFFFF0000 are the floats */
            _mm512_storeu_si512((void *)(x + g * 32), _mm512_slli_epi32(p, 16));
            _mm512_storeu_si512((void *)(x + g * 32 + 16),
                                _mm512_and_si512(p, _mm512_set1_epi32((int)0xFFFF0000u)));
        }
        xf[t] = x;
    }
    for (r = row_start; r < row_end; r += MXFP4X_AMX_ROWS) {
        mr = row_end - r < MXFP4X_AMX_ROWS ? (int)(row_end - r) : MXFP4X_AMX_ROWS;
        for (i = 0; i < MXFP4X_AMX_ROWS; i++) { /* rows past mr: row r again, never stored */
            b[i] = w->blocks + (r + (i < mr ? i : 0)) * sb;
            sp[i] = w->scales + (r + (i < mr ? i : 0)) * ss;
        }
        /* the scale floats, 2^(s - 127) = s << 23 (0 for s = 0: only zero codes there) */
        if (gs == 1) { /* 16 groups' scale bytes of the 16 rows at a time, transposed */
            for (g = 0; g < G; g += 16) {
                const int n = G - g < 16 ? (int)(G - g) : 16;
                __m512i v[4];
                mxfp4x_amx_transpose16(sp, g, v, n);
                for (i = 0; i < n; i++)
                    _mm512_storeu_si512(
                        (void *)(sf + (g + i) * 16),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v[i / 4], 8 * (i % 4)),
                                                           _mm512_set1_epi32(0xFF)), 23));
            }
        } else if (w->nibbles == MXFP4X_NIBBLES_HALVES && 15 * ss <= INT32_MAX) {
            /* GGUF: each scale byte heads its 17-byte block, so 4 bytes are in bounds */
            const __m512i ro = _mm512_mullo_epi32(
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                _mm512_set1_epi32((int)ss));
            const __m512i off = mr < MXFP4X_AMX_ROWS
                ? _mm512_mask_blend_epi32((__mmask16)(0xFFFFu << mr), ro, _mm512_setzero_si512())
                : ro;
            for (g = 0; g < G; g++)
                _mm512_storeu_si512(
                    (void *)(sf + g * 16),
                    _mm512_slli_epi32(_mm512_and_si512(_mm512_i32gather_epi32(
                                          off, (const void *)(w->scales + r * ss + g * gs), 1),
                                                       _mm512_set1_epi32(0xFF)), 23));
        } else { /* other strides: byte by byte */
            for (i = 0; i < MXFP4X_AMX_ROWS; i++)
                for (g = 0; g < G; g++) {
                    const uint32_t u = (uint32_t)sp[i][g * gs] << 23;
                    memcpy(sf + g * 16 + i, &u, 4);
                }
        }
        for (t0 = 0; t0 < n_tok; t0 += 4) {
            /* the next block of rows (or the next call's), fetched during the first pass */
            mxfp4x_pf_cursor pf = {NULL, NULL, 0};
            /* one 16-row block ahead, as measured on the Xeon (prefetch.h) */
            if (t0 == 0) pf = mxfp4x_pf_block_ahead(w, r, MXFP4X_AMX_ROWS, row_end, 1);
            nt = n_tok - t0 < 4 ? (int)(n_tok - t0) : 4;
            switch (nt) {
            case 4: mxfp4x_amx_gemv_block4(b, gb, G, sf, xf + t0, c, pf); break;
            case 3: mxfp4x_amx_gemv_block3(b, gb, G, sf, xf + t0, c, pf); break;
            case 2: mxfp4x_amx_gemv_block2(b, gb, G, sf, xf + t0, c, pf); break;
            default: mxfp4x_amx_gemv_block1(b, gb, G, sf, xf + t0, c, pf); break;
            }
            for (t = 0; t < nt; t++) /* what leaves the unit is written again below */
                _mm512_mask_storeu_ps(out + (t0 + t) * out_stride + (r - row_start),
                                      (__mmask16)((1u << mr) - 1), c[t]);
        }
    }
}

#endif /* MXFP4X_BF16_AMX_GEMV_H */
