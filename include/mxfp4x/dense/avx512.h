/* mxfp4x/dense/avx512.h -- the dense bf16 kernels of the avx512 entry (the dense product
 * of mxfp4x.h's mxfp4x_dense_bf16_fn), apart from its MXFP4 kernels.  Included by avx512.h
 * only, at its end, inside its target region (MXFP4X_AVX512_*); under
 * MXFP4X_EMULATE_AVX512 through SIMDe like the rest of avx512.h. */
#ifndef MXFP4X_DENSE_AVX512_H
#define MXFP4X_DENSE_AVX512_H

/* ---- dense bf16 rows x float32 or bf16 tokens (mxfp4x.h, mxfp4x_dense_bf16_fn) ----
 *
 * Two 16-lane accumulators per (row, token), e and o: chunk m of the row (32 elements,
 * the last one zero-filled) adds its even elements (32m + 2l in lane l) to e and its odd
 * ones (32m + 2l + 1) to o, m ascending, with FMA; then mxfp4x_hsum16_avx512(e + o).  A
 * bf16 weight widens exactly from one 64-byte load (the even ones by a 16-bit shift of each
 * 32-bit lane, the odd ones by masking the low half off); bf16 tokens widen the same way,
 * float32 tokens are split into even and odd halves by two vpermt2ps.  Any blocking of
 * rows and tokens gives the same bits.
 *
 * One token (bf16 tokens) as cpu.h's mxfp4x_dense_stream says: on an AMD Zen 5 one row at
 * a time (two chains, the far non-temporal prefetch; the aligned form below; two tokens
 * too); on a Zen 4 one row at a time with no software prefetch (the block form's loads:
 * the hardware's prefetchers follow the one stream); elsewhere, and with float32 tokens
 * (whose chunk does not stay in L1 under a row stream), blocks of 8 rows, which share the
 * widening or split of each token chunk, with the 1 KiB prefetch into L2.
 * docs/performance.md, "The dense bf16 kernel". */
#define MXFP4X_AVX512_DENSE_ODD_MASK ((int)0xFFFF0000u)

/* 32 bf16 weights or tokens at p: their even and odd elements as float32 */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_bf16x32_eo_avx512_v(__m512i v, __m512 *e, __m512 *o) {
    *e = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(MXFP4X_AVX512_DENSE_ODD_MASK)));
}
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_bf16x32_eo_avx512(const uint16_t *p, __m512 *e,
                                                         __m512 *o) {
    mxfp4x_bf16x32_eo_avx512_v(_mm512_loadu_si512((const void *)p), e, o);
}

/* 32 float32 tokens at p: their even and odd elements */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_f32x32_eo_avx512(const float *p, __m512 *e, __m512 *o) {
    const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i io = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *e = _mm512_permutex2var_ps(a, ie, b);
    *o = _mm512_permutex2var_ps(a, io, b);
}

/* Token chunk at element k of token c (xb16: bf16 tokens, a constant) */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_dense_x_eo_avx512(const void *x, int64_t off,
                                                         const int xb16, __m512 *e, __m512 *o) {
    if (xb16)
        mxfp4x_bf16x32_eo_avx512((const uint16_t *)x + off, e, o);
    else
        mxfp4x_f32x32_eo_avx512((const float *)x + off, e, o);
}

/* One block of mr rows x nt tokens (constants after inlining), every chunk; pf (cpu.h's
 * stream kinds): BLOCKS the T1 prefetch of each row's line pfd bytes ahead
 * (MXFP4X_DENSE_PREFETCH, or cpu.h's mxfp4x_dense_pf_near for blocks under 8 rows),
 * ROW_FAR the far non-temporal one (MXFP4X_DENSE_PREFETCH_FAR), ROW_PLAIN none. */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_dense_block_avx512(const uint16_t *w, int64_t rs,
                                                           int64_t d_in, const void *x,
                                                           int64_t xs, const int xb16,
                                                           const int mr, const int nt,
                                                           float *out, int64_t os,
                                                           const int pf, int64_t pfd) {
    __m512 e[8][4], o[8][4], xe[4], xo[4], we, wo; /* 8 x 1, 4 x 2 or 4 x 1, 1 x 1..4 */
    const int64_t body = d_in & ~(int64_t)31;
    int64_t k;
    const int64_t wrap = MXFP4X_DENSE_WRAP(mr, rs, d_in);
    int i, c;
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++) e[i][c] = o[i][c] = _mm512_setzero_ps();
    for (k = 0; k < body; k += 32) {
        const int64_t ahead = MXFP4X_DENSE_AHEAD(k, pfd, d_in, wrap);
        for (c = 0; c < nt; c++) mxfp4x_dense_x_eo_avx512(x, c * xs + k, xb16, &xe[c], &xo[c]);
        for (i = 0; i < mr; i++) {
            const uint16_t *p = w + i * rs + k;
            if (pf == MXFP4X_DENSE_ROW_FAR)
                _mm_prefetch((const char *)p + MXFP4X_DENSE_PREFETCH_FAR, _MM_HINT_NTA);
            else if (pf == MXFP4X_DENSE_BLOCKS)
                MXFP4X_PREFETCH_L2((const char *)p + ahead);
            mxfp4x_bf16x32_eo_avx512(p, &we, &wo);
            for (c = 0; c < nt; c++) {
                e[i][c] = _mm512_fmadd_ps(we, xe[c], e[i][c]);
                o[i][c] = _mm512_fmadd_ps(wo, xo[c], o[i][c]);
            }
        }
    }
    if (body < d_in) { /* the last chunk through zero-filled copies: its zero lanes add +0 */
        const int n = (int)(d_in - body);
        MXFP4X_ALIGN64 uint16_t wt[32];
        MXFP4X_ALIGN64 float xt[32];
        MXFP4X_ALIGN64 uint16_t xbt[32];
        for (c = 0; c < nt; c++) {
            if (xb16) {
                memset(xbt, 0, sizeof xbt);
                memcpy(xbt, (const uint16_t *)x + c * xs + body, (size_t)n * sizeof(uint16_t));
                mxfp4x_bf16x32_eo_avx512(xbt, &xe[c], &xo[c]);
            } else {
                memset(xt, 0, sizeof xt);
                memcpy(xt, (const float *)x + c * xs + body, (size_t)n * sizeof(float));
                mxfp4x_f32x32_eo_avx512(xt, &xe[c], &xo[c]);
            }
        }
        for (i = 0; i < mr; i++) {
            memset(wt, 0, sizeof wt);
            memcpy(wt, w + i * rs + body, (size_t)n * sizeof(uint16_t));
            mxfp4x_bf16x32_eo_avx512(wt, &we, &wo);
            for (c = 0; c < nt; c++) {
                e[i][c] = _mm512_fmadd_ps(we, xe[c], e[i][c]);
                o[i][c] = _mm512_fmadd_ps(wo, xo[c], o[i][c]);
            }
        }
    }
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++)
            out[c * os + i] = mxfp4x_hsum16_avx512(_mm512_add_ps(e[i][c], o[i][c]));
}

/* mr rows (1, or 4 at the same offset in their lines) x nt <= 2 tokens, the weights read
 * by 64-byte aligned loads: a row that starts inside a line (a checkpoint's tensors start
 * wherever its header and the tensors before them end) would split every 64-byte load
 * across two lines.  With the
 * row's first element at element `off` of its line, chunk m is the 32 elements from
 * element off of line m on: its 32-bit pairs start at pair off / 2 of lines m, m + 1,
 * picked by one vpermt2d (AVX512F); for an odd off the even elements are the high halves
 * of those pairs and the odd ones the low halves of the pairs one further on, a second
 * vpermt2d (`odd`, a constant).  The partial first and last lines come from zero-filled
 * copies, so nothing outside the row is read.  The same chunks as the unaligned form, so
 * the same bits.  Much faster than unaligned loads on Kimi K3's dense matrices as its
 * checkpoint maps them, 40 bytes into a line (docs/performance.md, "The dense bf16
 * kernel"). */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_dense_row_aligned_avx512(const uint16_t *w,
                                                                 int64_t rs, int64_t d_in,
                                                                 const void *x, int64_t xs,
                                                                 const int xb16, const int mr,
                                                                 const int nt, float *out,
                                                                 int64_t os, const int pf,
                                                                 int64_t pfd, const int odd) {
    const int off = (int)(((uintptr_t)w & 63) >> 1); /* the same for the mr rows */
    const int esz = xb16 ? 2 : 4;
    const int64_t end = off + d_in, n_lines = (end + 31) >> 5, full = end >> 5;
    const int64_t n_chunks = (d_in + 31) >> 5;
    const int64_t wrap = MXFP4X_DENSE_WRAP(mr, rs, d_in);
    const __m512i ia = _mm512_add_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(off >> 1));
    const __m512i ib = _mm512_add_epi32(ia, _mm512_set1_epi32(1));
    const __m512i hi = _mm512_set1_epi32(MXFP4X_AVX512_DENSE_ODD_MASK);
    MXFP4X_ALIGN64 uint16_t t[32];
    __m512 e[4][2], o[4][2], xe[2], xo[2], we, wo; /* mr x nt <= 4 x 2, or 1 x 2 */
    __m512i prev[4], cur, pa;
    int64_t m, j;
    int i, c;
    for (i = 0; i < mr; i++) {
        for (c = 0; c < nt; c++) e[i][c] = o[i][c] = _mm512_setzero_ps();
        memset(t, 0, sizeof t); /* line 0: the row's first elements from element off on */
        memcpy(t + off, w + i * rs,
               (size_t)(d_in < 32 - off ? d_in : 32 - off) * sizeof(uint16_t));
        prev[i] = _mm512_loadu_si512((const void *)t);
    }
#define MXFP4X_DENSE_JOIN(I)                                                               \
    pa = _mm512_permutex2var_epi32(prev[I], ia, cur);                                      \
    if (odd) {                                                                             \
        we = _mm512_castsi512_ps(_mm512_and_si512(pa, hi));                                \
        wo = _mm512_castsi512_ps(                                                          \
            _mm512_slli_epi32(_mm512_permutex2var_epi32(prev[I], ib, cur), 16));          \
    } else {                                                                               \
        mxfp4x_bf16x32_eo_avx512_v(pa, &we, &wo);                                          \
    }                                                                                      \
    for (c = 0; c < nt; c++) {                                                             \
        e[I][c] = _mm512_fmadd_ps(we, xe[c], e[I][c]);                                     \
        o[I][c] = _mm512_fmadd_ps(wo, xo[c], o[I][c]);                                     \
    }                                                                                      \
    prev[I] = cur;
    /* chunk m whole in lines m, m + 1: line m + 1 inside the row (off < 32, so its chunk
     * and the token chunk are whole too) */
    for (m = 0; m + 1 < full; m++) {
        const int64_t ahead = MXFP4X_DENSE_AHEAD(32 * (m + 1) - off, pfd, d_in, wrap);
        for (c = 0; c < nt; c++) mxfp4x_dense_x_eo_avx512(x, c * xs + 32 * m, xb16, &xe[c], &xo[c]);
        for (i = 0; i < mr; i++) {
            const uint16_t *line = w + (i * rs + 32 * (m + 1) - off); /* inside the row */
            if (pf == MXFP4X_DENSE_ROW_FAR)
                _mm_prefetch((const char *)line + MXFP4X_DENSE_PREFETCH_FAR, _MM_HINT_NTA);
            else if (pf == MXFP4X_DENSE_BLOCKS)
                MXFP4X_PREFETCH_L2((const char *)line + ahead);
            cur = _mm512_load_si512((const void *)line);
            MXFP4X_DENSE_JOIN(i)
        }
    }
    for (; m < n_chunks; m++) { /* the last chunks (line m + 1 >= full: partial or past the
                                 * row): lines and tokens through zero-filled copies */
        MXFP4X_ALIGN64 float xt[32];
        const size_t n = (size_t)(d_in - 32 * m < 32 ? d_in - 32 * m : 32);
        j = m + 1;
        for (c = 0; c < nt; c++) {
            memset(xt, 0, sizeof xt);
            memcpy(xt, (const char *)x + (c * xs + 32 * m) * esz, n * (size_t)esz);
            mxfp4x_dense_x_eo_avx512(xt, 0, xb16, &xe[c], &xo[c]);
        }
        for (i = 0; i < mr; i++) {
            if (j < n_lines) { /* j >= 1: the line's start is inside the row */
                memset(t, 0, sizeof t);
                memcpy(t, w + (i * rs + 32 * j - off), (size_t)(end - 32 * j) * sizeof(uint16_t));
                cur = _mm512_loadu_si512((const void *)t);
            } else {
                cur = _mm512_setzero_si512();
            }
            MXFP4X_DENSE_JOIN(i)
        }
    }
#undef MXFP4X_DENSE_JOIN
    for (i = 0; i < mr; i++)
        for (c = 0; c < nt; c++)
            out[c * os + i] = mxfp4x_hsum16_avx512(_mm512_add_ps(e[i][c], o[i][c]));
}

/* mr rows from wr (1, or 4 that share their offset in a line) x nt tokens (constants):
 * the aligned form where the rows start on an even byte and share that offset, else the
 * block form (an odd address: no whole elements to join). */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_dense_row_avx512(const uint16_t *wr, int64_t row_stride,
                                                         int64_t d_in, const void *x,
                                                         int64_t xs, const int xb16,
                                                         const int mr, const int nt,
                                                         float *out, int64_t os,
                                                         const int pf, int64_t pfd) {
    if (mr > 1 && (row_stride & 31)) /* rows at different offsets in their lines */
        mxfp4x_dense_block_avx512(wr, row_stride, d_in, x, xs, xb16, mr, nt, out, os, pf, pfd);
    else if (!((uintptr_t)wr & 3))
        mxfp4x_dense_row_aligned_avx512(wr, row_stride, d_in, x, xs, xb16, mr, nt, out, os,
                                        pf, pfd, 0);
    else if (!((uintptr_t)wr & 1))
        mxfp4x_dense_row_aligned_avx512(wr, row_stride, d_in, x, xs, xb16, mr, nt, out, os,
                                        pf, pfd, 1);
    else
        mxfp4x_dense_block_avx512(wr, row_stride, d_in, x, xs, xb16, mr, nt, out, os, pf, pfd);
}

/* Rows [row_start, row_end) x n_tok tokens, in groups of up to 4 tokens: one or two bf16
 * tokens one row at a time on an AMD Zen 5; one float32 token in blocks of 8 rows;
 * otherwise blocks of 4 rows x 2 tokens, for 3 or 4 tokens run twice over each block
 * while its rows are in cache (16 accumulators: 4 x 4 would need 32).  Two accumulators
 * per (row, token) cost three or four tokens a little against the one-token stream they
 * speed; of the blockings measured on a Zen 5 and a Zen 4, 4 x 2 reads fastest there
 * (docs/performance.md, "The dense bf16 kernel").  On a Zen 4 the blocks under 8 rows
 * prefetch 2 KiB ahead (mxfp4x_dense_pf_near). */
MXFP4X_AVX512_INLINE_ALWAYS void mxfp4x_dense_avx512_to(const uint16_t *w, int64_t row_stride,
                                                        int64_t row_start, int64_t row_end,
                                                        int64_t d_in, const void *x,
                                                        int64_t x_stride, int64_t n_tok,
                                                        float *out, int64_t out_stride,
                                                        const int xb16, const int pf) {
    const int esz = xb16 ? 2 : 4;
    const int64_t pfn = mxfp4x_dense_pf_near(); /* blocks under 8 rows: their distance */
    int64_t t, r;
    for (t = 0; t < n_tok;) {
        const int64_t left = n_tok - t;
        const int nt = left >= 4 ? 4 : left == 3 ? 3 : (int)left;
        const void *xt = (const char *)x + t * x_stride * esz;
        float *o0 = out + t * out_stride;
#define MXFP4X_AVX512_DENSE_RUN(M, N, PF, PFD)                                             \
    for (; r + (M) <= row_end; r += (M))                                                   \
        mxfp4x_dense_block_avx512(w + r * row_stride, row_stride, d_in, xt, x_stride, xb16,  \
                                  M, N, o0 + (r - row_start), out_stride, PF, PFD);
        r = row_start;
        if (nt == 1 && xb16 && pf == MXFP4X_DENSE_ROW_PLAIN) { /* an AMD Zen 4 */
            for (; r < row_end; r++)
                mxfp4x_dense_block_avx512(w + r * row_stride, row_stride, d_in, xt, x_stride,
                                          xb16, 1, 1, o0 + (r - row_start), out_stride,
                                          MXFP4X_DENSE_ROW_PLAIN, 0);
        } else if (nt <= 2 && xb16 && pf == MXFP4X_DENSE_ROW_FAR) { /* an AMD Zen 5 */
            for (; r < row_end; r++) {
                if (nt == 1)
                    mxfp4x_dense_row_avx512(w + r * row_stride, row_stride, d_in, xt, x_stride,
                                            xb16, 1, 1, o0 + (r - row_start), out_stride, pf,
                                            pfn);
                else
                    mxfp4x_dense_row_avx512(w + r * row_stride, row_stride, d_in, xt, x_stride,
                                            xb16, 1, 2, o0 + (r - row_start), out_stride, pf,
                                            pfn);
            }
        } else if (nt == 1) {
            MXFP4X_AVX512_DENSE_RUN(8, 1, 0, MXFP4X_DENSE_PREFETCH)
            MXFP4X_AVX512_DENSE_RUN(1, 1, 0, pfn)
        } else if (nt == 2) {
            MXFP4X_AVX512_DENSE_RUN(4, 2, 0, pfn)
            MXFP4X_AVX512_DENSE_RUN(1, 2, 0, pfn)
        } else { /* 3 or 4 tokens: each block of 4 rows for 2 tokens, then for the rest,
                  * while its rows are still in cache */
            for (; r + 4 <= row_end; r += 4) {
                const void *x2 = (const char *)xt + 2 * x_stride * esz;
                float *o2 = o0 + 2 * out_stride + (r - row_start);
                mxfp4x_dense_row_avx512(w + r * row_stride, row_stride, d_in, xt, x_stride,
                                        xb16, 4, 2, o0 + (r - row_start), out_stride, 0, pfn);
                if (nt == 4)
                    mxfp4x_dense_row_avx512(w + r * row_stride, row_stride, d_in, x2,
                                            x_stride, xb16, 4, 2, o2, out_stride, 0, pfn);
                else
                    mxfp4x_dense_row_avx512(w + r * row_stride, row_stride, d_in, x2,
                                            x_stride, xb16, 4, 1, o2, out_stride, 0, pfn);
            }
            if (nt == 4) {
                MXFP4X_AVX512_DENSE_RUN(1, 4, 0, pfn)
            } else {
                MXFP4X_AVX512_DENSE_RUN(1, 3, 0, pfn)
            }
        }
#undef MXFP4X_AVX512_DENSE_RUN
        t += nt;
    }
}

MXFP4X_AVX512_FN void mxfp4x_dense_bf16_avx512(const uint16_t *w, int64_t row_stride,
                                               int64_t row_start, int64_t row_end,
                                               int64_t d_in, const float *x, int64_t x_stride,
                                               int64_t n_tok, float *out,
                                               int64_t out_stride) {
    mxfp4x_dense_avx512_to(w, row_stride, row_start, row_end, d_in, x, x_stride, n_tok, out,
                           out_stride, 0, MXFP4X_DENSE_BLOCKS);
}

/* The same with bf16 tokens (their bits): the same bits as mxfp4x_dense_bf16_avx512 on the
 * tokens widened to float32. */
MXFP4X_AVX512_FN void mxfp4x_dense_bf16x_avx512(const uint16_t *w, int64_t row_stride,
                                                int64_t row_start, int64_t row_end,
                                                int64_t d_in, const uint16_t *x,
                                                int64_t x_stride, int64_t n_tok, float *out,
                                                int64_t out_stride) {
    const int stream = mxfp4x_dense_stream(); /* each kind its own compiled copy */
    if (stream == MXFP4X_DENSE_ROW_FAR)
        mxfp4x_dense_avx512_to(w, row_stride, row_start, row_end, d_in, x, x_stride, n_tok,
                               out, out_stride, 1, MXFP4X_DENSE_ROW_FAR);
    else if (stream == MXFP4X_DENSE_ROW_PLAIN)
        mxfp4x_dense_avx512_to(w, row_stride, row_start, row_end, d_in, x, x_stride, n_tok,
                               out, out_stride, 1, MXFP4X_DENSE_ROW_PLAIN);
    else
        mxfp4x_dense_avx512_to(w, row_stride, row_start, row_end, d_in, x, x_stride, n_tok,
                               out, out_stride, 1, MXFP4X_DENSE_BLOCKS);
}

#endif /* MXFP4X_DENSE_AVX512_H */
