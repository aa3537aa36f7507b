/* mxfp4x/bf16/avx512bf16_off_unit.h -- avx512bf16's paths off the unit: the exact float64
 * dot product, and vdpbf16ps's arithmetic in float32 FMAs (subnormals kept), 4 rows x 4
 * tokens at a time.  Part of avx512bf16.h, included there inside its target region: it
 * uses that header's macros and what it defines before the include. */
#ifndef MXFP4X_BF16_AVX512BF16_OFF_UNIT_H
#define MXFP4X_BF16_AVX512BF16_OFF_UNIT_H

/* The exact path of row r and one token (x: its latents in the pairing, d_in words),
 * summed in pair order. */
static float mxfp4x_bf16dp_exact_dot(const mxfp4x_rows *w, int64_t r, const uint16_t *x) {
    const uint8_t *b = w->blocks + r * w->row_stride_blocks;
    const uint8_t *s = w->scales + r * w->row_stride_scales;
    const int paired = mxfp4x_bf16dp_paired(w->nibbles);
    double acc = 0.0;
    int64_t g;
    int k;
    for (g = 0; g < w->n_groups; g++) {
        const uint8_t *q = b + g * w->group_stride_blocks;
        const double sc = mxfp4x_e8m0_f64(s[g * w->group_stride_scales]);
        for (k = 0; k < 16; k++) {
            const uint16_t lo = x[mxfp4x_bf16dp_xpos(g, k, w->n_groups, paired, 0)];
            const uint16_t hi = x[mxfp4x_bf16dp_xpos(g, k, w->n_groups, paired, 1)];
            acc += ((double)mxfp4x_e2m1_f32[q[k] & 0xF] * sc) * (double)mxfp4x_bf16_to_f32(lo);
            acc += ((double)mxfp4x_e2m1_f32[q[k] >> 4] * sc) * (double)mxfp4x_bf16_to_f32(hi);
        }
    }
    return (float)acc;
}

/* The unit's arithmetic in float32 FMAs (subnormals kept), for one chunk of one row and
 * one token: lane i adds the odd product W[2i + 1] X[2i + 1], then the even one W[2i]
 * X[2i], each rounded -- what vdpbf16ps does with operands and results that are not
 * subnormal.  Both products are exact in float32 (bf16 times a scaled E2M1 value), so
 * each FMA is the unit's add.  The words widen to floats in place: the odd word of a
 * dword is its top half, the even one its bottom half shifted up. */
#define MXFP4X_BF16DP_F32_ODD(v)                                                           \
    _mm512_castsi512_ps(_mm512_and_si512((v), _mm512_set1_epi32((int)0xFFFF0000)))
#define MXFP4X_BF16DP_F32_EVEN(v) _mm512_castsi512_ps(_mm512_slli_epi32((v), 16))

/* Rows [r, r + mr) x tokens xs[0 .. nt) (mr, nt <= 4, constants where inlined) by the
 * unit's arithmetic in float32: outs[c][r - r0 + i] = row r + i . token c.  Every row's
 * chunks in the unit's order (decode2 for pairs rows, then the one-group decode), each
 * decoded once for the nt tokens; then hsum16, whose bits the unit's reductions give. */
MXFP4X_BF16DP_INLINE void mxfp4x_bf16dp_f32_block(const mxfp4x_rows *w, int64_t r, int mr,
                                                  int64_t row_end, const uint16_t *const *xs,
                                                  int nt, float *const *outs, int64_t at) {
    const int64_t G = w->n_groups, sb = w->row_stride_blocks, ss = w->row_stride_scales;
    const int64_t gb = w->group_stride_blocks, gs = w->group_stride_scales;
    __m512 a[MXFP4X_BF16DP_MR][MXFP4X_BF16DP_NT], we[MXFP4X_BF16DP_MR], wo[MXFP4X_BF16DP_MR];
    __m512i hi[MXFP4X_BF16DP_MR];
    int64_t g = 0;
    int i, t;
    mxfp4x_pf_cursor pf = mxfp4x_pf_next_block_to(w, r, mr, row_end, 0);
    for (i = 0; i < mr; i++)
        for (t = 0; t < nt; t++) a[i][t] = _mm512_setzero_ps();
/* the chunk at word offset `off` of each token against we, wo */
#define MXFP4X_BF16DP_F32_TOKENS(off)                                                     \
    for (t = 0; t < nt; t++) {                                                             \
        const __m512i xv = _mm512_loadu_si512((const void *)(xs[t] + (off)));              \
        const __m512 xe = MXFP4X_BF16DP_F32_EVEN(xv), xo = MXFP4X_BF16DP_F32_ODD(xv);      \
        for (i = 0; i < mr; i++)                                                           \
            a[i][t] = _mm512_fmadd_ps(we[i], xe, _mm512_fmadd_ps(wo[i], xo, a[i][t]));     \
    }
    if (mxfp4x_bf16dp_paired(w->nibbles))
        for (; g + 2 <= G; g += 2) { /* chunks g (the pair's lo) and g + 1 (its hi) */
            MXFP4X_PF_STEP(pf, g);
            MXFP4X_PF_STEP(pf, g + 1);
            for (i = 0; i < mr; i++) {
                const uint8_t *sc = w->scales + (r + i) * ss + g * gs;
                __m512i lo;
                mxfp4x_bf16dp_decode2(w->blocks + (r + i) * sb + g * gb, sc[0], sc[gs], &lo,
                                      &hi[i]);
                we[i] = MXFP4X_BF16DP_F32_EVEN(lo);
                wo[i] = MXFP4X_BF16DP_F32_ODD(lo);
            }
            MXFP4X_BF16DP_F32_TOKENS(g * MXFP4X_GROUP)
            for (i = 0; i < mr; i++) {
                we[i] = MXFP4X_BF16DP_F32_EVEN(hi[i]);
                wo[i] = MXFP4X_BF16DP_F32_ODD(hi[i]);
            }
            MXFP4X_BF16DP_F32_TOKENS((g + 1) * MXFP4X_GROUP)
        }
    for (; g < G; g++) { /* one group per chunk */
        MXFP4X_PF_STEP(pf, g);
        for (i = 0; i < mr; i++) {
            const __m512i v = mxfp4x_bf16_decode_group(w->blocks + (r + i) * sb + g * gb,
                                                   w->scales[(r + i) * ss + g * gs]);
            we[i] = MXFP4X_BF16DP_F32_EVEN(v);
            wo[i] = MXFP4X_BF16DP_F32_ODD(v);
        }
        MXFP4X_BF16DP_F32_TOKENS(g * MXFP4X_GROUP)
    }
#undef MXFP4X_BF16DP_F32_TOKENS
    for (i = 0; i < mr; i++)
        for (t = 0; t < nt; t++) outs[t][at + i] = mxfp4x_hsum16_avx512(a[i][t]);
}

/* Full blocks (4 rows x 4 tokens, and x 1 token) compiled apart, their accumulators in
 * registers; the edges through the inlined form. */
MXFP4X_BF16DP_NOINLINE void mxfp4x_bf16dp_f32_full(const mxfp4x_rows *w, int64_t r,
                                                   int64_t row_end, const uint16_t *const *xs,
                                                   float *const *outs, int64_t at) {
    mxfp4x_bf16dp_f32_block(w, r, MXFP4X_BF16DP_MR, row_end, xs, MXFP4X_BF16DP_NT, outs, at);
}
MXFP4X_BF16DP_NOINLINE void mxfp4x_bf16dp_f32_full1(const mxfp4x_rows *w, int64_t r,
                                                    int64_t row_end, const uint16_t *const *xs,
                                                    float *const *outs, int64_t at) {
    mxfp4x_bf16dp_f32_block(w, r, MXFP4X_BF16DP_MR, row_end, xs, 1, outs, at);
}
MXFP4X_BF16DP_NOINLINE void mxfp4x_bf16dp_f32_edge(const mxfp4x_rows *w, int64_t r, int mr,
                                                   int64_t row_end, const uint16_t *const *xs,
                                                   int nt, float *const *outs, int64_t at) {
    mxfp4x_bf16dp_f32_block(w, r, mr, row_end, xs, nt, outs, at);
}

/* Rows [r0, r1) . the tokens xs[0 .. n) off the unit, outs[c][r - r0] = row r . token
 * c: the float32 path above, 4 rows x 4 tokens at a time, or with `large` the float64
 * exact path (where a product or a sum could overflow in float32). */
MXFP4X_BF16DP_NOINLINE void mxfp4x_bf16dp_off_unit(const mxfp4x_rows *w, int64_t r0,
                                                   int64_t r1, const uint16_t *const *xs,
                                                   int n, int large, float *const *outs) {
    int64_t r;
    int t, nt;
    for (t = 0; t < n; t += nt) {
        nt = n - t < MXFP4X_BF16DP_NT ? n - t : MXFP4X_BF16DP_NT;
        for (r = r0; r < r1; r += MXFP4X_BF16DP_MR) {
            const int mr = r1 - r < MXFP4X_BF16DP_MR ? (int)(r1 - r) : MXFP4X_BF16DP_MR;
            int c, i;
            if (large) {
                for (c = 0; c < nt; c++)
                    for (i = 0; i < mr; i++)
                        outs[t + c][r - r0 + i] = mxfp4x_bf16dp_exact_dot(w, r + i, xs[t + c]);
            } else if (mr == MXFP4X_BF16DP_MR && nt == MXFP4X_BF16DP_NT) {
                mxfp4x_bf16dp_f32_full(w, r, r1, xs + t, outs + t, r - r0);
            } else if (mr == MXFP4X_BF16DP_MR && nt == 1) {
                mxfp4x_bf16dp_f32_full1(w, r, r1, xs + t, outs + t, r - r0);
            } else {
                mxfp4x_bf16dp_f32_edge(w, r, mr, r1, xs + t, nt, outs + t, r - r0);
            }
        }
    }
}

#endif /* MXFP4X_BF16_AVX512BF16_OFF_UNIT_H */
