/* mxfp4x/bf16/avx512bf16_panel.h -- avx512bf16's many-token path: rows decoded into a
 * bf16 panel, a 4-row x 6-token register block over it in slices of KC chunks, the next
 * tile prefetched.  Part of avx512bf16.h, included there inside its target region: it
 * uses that header's macros and what it defines before the include. */
#ifndef MXFP4X_BF16_AVX512BF16_PANEL_H
#define MXFP4X_BF16_AVX512BF16_PANEL_H

/* ---- many tokens: rows decoded into a bf16 panel, then a register block over it ---- */

/* Rows [r, r + n) decoded into panel (row i at i * d_in words). */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_decode_rows(const mxfp4x_rows *w, int64_t r, int64_t n,
                                                    uint16_t *panel) {
    const int64_t G = w->n_groups, d_in = G * MXFP4X_GROUP;
    const int64_t sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    int64_t i, g;
    for (i = 0; i < n; i++) {
        const uint8_t *b = w->blocks + (r + i) * sb;
        const uint8_t *s = w->scales + (r + i) * ss;
        uint16_t *d = panel + i * d_in;
        g = 0;
        if (mxfp4x_bf16dp_paired(w->nibbles))
            for (; g + 2 <= G; g += 2) {
                __m512i lo, hi;
                mxfp4x_bf16dp_decode2(b + g * gb, s[g * gs], s[(g + 1) * gs], &lo, &hi);
                _mm512_store_si512((void *)(d + g * MXFP4X_GROUP), lo);
                _mm512_store_si512((void *)(d + (g + 1) * MXFP4X_GROUP), hi);
            }
        for (; g < G; g++)
            _mm512_store_si512((void *)(d + g * MXFP4X_GROUP),
                               mxfp4x_bf16_decode_group(b + g * gb, s[g * gs]));
    }
}

/* The 4 rows x 6 tokens block's sums into out[t * out_stride + i] (= hsum16(a[i][t])). */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_reduce_4x6(__m512 a[MXFP4X_BF16DP_MR][MXFP4X_BF16DP_PNT],
                                                   float *out, int64_t out_stride) {
    /* tokens 0-3: v[4j + k] = a[j][k], so quarter k is token k's rows 0-3 */
    const __m512 v[16] = {a[0][0], a[0][1], a[0][2], a[0][3], a[1][0], a[1][1], a[1][2], a[1][3],
                          a[2][0], a[2][1], a[2][2], a[2][3], a[3][0], a[3][1], a[3][2], a[3][3]};
    /* tokens 4, 5: u[4j + k] = a[k][4 + j]: quarter k's lanes 0-1 row k of token 4, 2-3 of
     * token 5 (level 4 pairs it with itself) */
    const __m512 u[8] = {a[0][4], a[1][4], a[2][4], a[3][4], a[0][5], a[1][5], a[2][5], a[3][5]};
    const __m512 h = mxfp4x_bf16dp_hsum_8(u);
    const __m512 s = mxfp4x_bf16dp_hsum_l4(h, h); /* quarter k: row k of tokens 4, 5, 4, 5 */
    /* lanes 0-3: tokens 4's rows 0-3 (lane 4k), lanes 4-7: token 5's (lane 4k + 1) */
    const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0);
    const __m512 s45 = _mm512_permutexvar_ps(idx, s);
    mxfp4x_bf16dp_reduce_16(v, 4, out, out_stride);
    _mm_storeu_ps(out + 4 * out_stride, _mm512_castps512_ps128(s45));
    _mm_storeu_ps(out + 5 * out_stride, _mm512_extractf32x4_ps(s45, 1));
}

/* Chunks [c0, c1) of mr <= 4 panel rows (p0, stride d_in words) x nt <= 6 tokens.  The
 * accumulators start at zero (c0 == 0) or from `acc` (the previous chunks' partials, 24
 * vectors, [i][t]); they end reduced into out (c1 == G) or stored back to `acc`.  A float32
 * vector through memory is the same vector, so a row's chain of vdpbf16ps over c = 0 .. G-1
 * runs the same operations on the same operands whatever the split. */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_panel_block(const uint16_t *p0, int64_t d_in,
                                                    int64_t G, int64_t c0, int64_t c1,
                                                    const uint16_t *const *xs, int mr, int nt,
                                                    float *acc, float *out,
                                                    int64_t out_stride) {
    __m512 a[MXFP4X_BF16DP_MR][MXFP4X_BF16DP_PNT];
    int64_t g;
    int i, t;
    for (i = 0; i < mr; i++)
        for (t = 0; t < nt; t++)
            a[i][t] = c0 == 0 ? _mm512_setzero_ps()
                              : _mm512_load_ps(acc + (i * MXFP4X_BF16DP_PNT + t) * 16);
    for (g = c0; g < c1; g++) {
        __m512bh wv[MXFP4X_BF16DP_MR];
        for (i = 0; i < mr; i++)
            wv[i] = (__m512bh)_mm512_load_si512((const void *)(p0 + i * d_in + g * MXFP4X_GROUP));
        for (t = 0; t < nt; t++) {
            const __m512bh x =
                (__m512bh)_mm512_loadu_si512((const void *)(xs[t] + g * MXFP4X_GROUP));
            for (i = 0; i < mr; i++) a[i][t] = _mm512_dpbf16_ps(a[i][t], wv[i], x);
        }
    }
    if (c1 == G && mr == MXFP4X_BF16DP_MR && nt == MXFP4X_BF16DP_PNT) {
        mxfp4x_bf16dp_reduce_4x6(a, out, out_stride);
    } else if (c1 == G) {
        for (i = 0; i < mr; i++)
            for (t = 0; t < nt; t++) out[t * out_stride + i] = mxfp4x_hsum16_avx512(a[i][t]);
    } else {
        for (i = 0; i < mr; i++)
            for (t = 0; t < nt; t++)
                _mm512_store_ps(acc + (i * MXFP4X_BF16DP_PNT + t) * 16, a[i][t]);
    }
}

/* Blocks of 4 rows compiled apart, one per token count (1..6), their accumulators in
 * registers: a batch's last block of tokens (n_tok % 6 of them) through the inlined form
 * with a variable token count kept its accumulators on the stack. */
#define MXFP4X_BF16DP_PANEL_FULL(N)                                                         \
    MXFP4X_BF16DP_NOINLINE void mxfp4x_bf16dp_panel_full##N(                               \
        const uint16_t *p0, int64_t d_in, int64_t G, int64_t c0, int64_t c1,               \
        const uint16_t *const *xs, float *acc, float *out, int64_t out_stride) {           \
        mxfp4x_bf16dp_panel_block(p0, d_in, G, c0, c1, xs, MXFP4X_BF16DP_MR, N, acc, out,  \
                                  out_stride);                                             \
    }
MXFP4X_BF16DP_PANEL_FULL(1)
MXFP4X_BF16DP_PANEL_FULL(2)
MXFP4X_BF16DP_PANEL_FULL(3)
MXFP4X_BF16DP_PANEL_FULL(4)
MXFP4X_BF16DP_PANEL_FULL(5)
MXFP4X_BF16DP_PANEL_FULL(6)

typedef void (*mxfp4x_bf16dp_panel_fn)(const uint16_t *, int64_t, int64_t, int64_t, int64_t,
                                       const uint16_t *const *, float *, float *, int64_t);
static const mxfp4x_bf16dp_panel_fn mxfp4x_bf16dp_panel_full[MXFP4X_BF16DP_PNT + 1] = {
    NULL,
    mxfp4x_bf16dp_panel_full1,
    mxfp4x_bf16dp_panel_full2,
    mxfp4x_bf16dp_panel_full3,
    mxfp4x_bf16dp_panel_full4,
    mxfp4x_bf16dp_panel_full5,
    mxfp4x_bf16dp_panel_full6};

/* The panel path walks a row's chunks in slices of at most this many (KC), each slice over
 * every 4-row block of the tile before the next, for one block of 6 tokens: the slice of
 * the 6 tokens' latents (6 x KC x 64 bytes) stays in L1 while the rows' slices stream from
 * L2.  Whole rows at once, 4 rows and 6 tokens of gpt-oss's 2880 latents are 58 KB: over
 * a 48 KB L1, so the latents would come from L2 again for every row block. */
#ifndef MXFP4X_BF16DP_KC
#define MXFP4X_BF16DP_KC 64
#endif
/* ... but on an AMD Zen 4 (family 19h) whole rows, one slice: there the slices run
 * slower, their latents in L1 or not (docs/performance.md, "Tiles, tasks and panels").
 * MXFP4X_BF16DP_KC_ZEN4 = 0 means whole rows. */
#ifndef MXFP4X_BF16DP_KC_ZEN4
#define MXFP4X_BF16DP_KC_ZEN4 0
#endif

/* This CPU's slice (above), in chunks; 0: whole rows. */
static int64_t mxfp4x_bf16dp_kc(void) {
    return mxfp4x_cpu_amd_family() == 0x19 ? MXFP4X_BF16DP_KC_ZEN4 : MXFP4X_BF16DP_KC;
}

/* Float32 partials of the tile's row blocks between slices (64-byte aligned vectors). */
#define MXFP4X_BF16DP_ACC_FLOATS                                                            \
    ((MXFP4X_BF16DP_TILE_ROWS / MXFP4X_BF16DP_MR) * MXFP4X_BF16DP_MR * MXFP4X_BF16DP_PNT * 16)

/* Scratch bytes of mxfp4x_bf16dp_rows: a panel of one task's rows and the partials (both
 * 64-byte aligned). */
static int64_t mxfp4x_bf16dp_scratch_bytes(int64_t n_groups) {
    return MXFP4X_BF16DP_TILE_ROWS * n_groups * MXFP4X_GROUP * 2 +
           MXFP4X_BF16DP_ACC_FLOATS * 4 + 64;
}

/* The next tile's lines, prefetched into L2 a few at a time: its packed bytes, then its
 * scale bytes (where they are apart).  The next tile is rows [r1, r1 + TILE_ROWS) of this
 * call, or where the caller's next call starts (the hint, mxfp4x_rows).  Prefetches never
 * fault and no result depends on them. */
typedef struct {
    const char *p, *end, *ps, *pe;
} mxfp4x_bf16dp_pf;

static inline mxfp4x_bf16dp_pf mxfp4x_bf16dp_pf_tile(const mxfp4x_rows *w, int64_t r1,
                                                     int64_t row_end) {
    mxfp4x_bf16dp_pf c;
    const int here = r1 < row_end;
    const int64_t n = here ? (row_end - r1 < MXFP4X_BF16DP_TILE_ROWS ? row_end - r1
                                                                      : MXFP4X_BF16DP_TILE_ROWS)
                           : MXFP4X_BF16DP_TILE_ROWS;
    const uint8_t *b = here ? w->blocks + r1 * w->row_stride_blocks : w->next_blocks;
    const uint8_t *s = here ? w->scales + r1 * w->row_stride_scales : w->next_scales;
    c.p = (const char *)b;
    c.end = b ? c.p + n * w->row_stride_blocks : c.p;
    c.ps = (const char *)s;
    c.pe = s && w->group_stride_scales == 1 ? c.ps + n * w->row_stride_scales : c.ps;
    return c;
}

static inline int64_t mxfp4x_bf16dp_pf_count(const mxfp4x_bf16dp_pf *c) {
    return (int64_t)((c->end - c->p) + (c->pe - c->ps) + 127) / 64;
}

static inline void mxfp4x_bf16dp_pf_lines(mxfp4x_bf16dp_pf *c, int64_t n) {
    for (; n > 0 && c->p < c->end; n--, c->p += 64) MXFP4X_PREFETCH_L2(c->p);
    for (; n > 0 && c->ps < c->pe; n--, c->ps += 64) MXFP4X_PREFETCH_L2(c->ps);
}

#endif /* MXFP4X_BF16_AVX512BF16_PANEL_H */
