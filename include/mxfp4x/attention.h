/* mxfp4x/attention.h -- the attention of a few query tokens over a key/value cache (a
 * decoding step), its query heads grouped by the key/value head they share, the softmax
 * with gpt-oss's sink logit and an additive mask, in one task per (sequence, key/value
 * head) that reads each cached key and value once.
 *
 * Every value is computed by the same float32 operations in the same order whatever the
 * path, the thread count or the sequence's batch (the build passes -ffp-contract=off; the
 * only fused operations are explicit fmas).  For a query row q (one head h, one token t)
 * and the keys j < tk of its key/value head h / (hq / hkv):
 *
 *     s_j = fl(fl(q . k_j) * scaling) + mask[j]   (q . k_j: a chain of fmas over d from 0)
 *     m   = max(max_j s_j, sink)                  (no sink: max_j s_j)
 *     e_j = exp(s_j - m),  z = sum_j e_j + exp(sink - m)
 *     out = (sum_j e_j v_j) / z                   (sum_j e_j v_j: a chain of fmas over j)
 *
 * z summed in 4 parts by j mod 4, then (z0 + z1) + (z2 + z3), then the sink's term; exp
 * is mxfp4x_expf (within 1 ulp).  Every operand is first made float32 (exact), the result
 * rounded once into the output's dtype.  A row whose keys are all masked out to -inf and
 * that has no sink gives NaN (as a softmax of -inf's does); a NaN in its scores or its
 * sink gives NaN.  Four paths, the same bits: x86 from AVX2 on (the rows in the lanes of
 * 8-float vectors), with AVX-512 the scores of two keys and the values' 16 columns to a
 * vector; AArch64's NEON (the rows in two 4-float vectors); plain C (fmaf) elsewhere. */
#ifndef MXFP4X_ATTENTION_H
#define MXFP4X_ATTENTION_H

#include "activation.h"

#if MXFP4X_HAVE_X86_SIMD
#  include <immintrin.h>
#endif
#if MXFP4X_HAVE_NEON
#  include <arm_neon.h>
#endif

#define MXFP4X_ATT_ROWS 8 /* query rows per pass over a head's keys and values: a vector */
#define MXFP4X_ATT_KEYS 8 /* keys scored together (independent chains) */

typedef struct {
    /* q (b, hq, tq, d), k and v (b, hkv, tk, d), the mask's element (s, h, t, j) at
     * s * m_sb + h * m_sh + t * m_st + j: strides in elements, the last dimension
     * contiguous; a mask's stride 0 broadcasts it. */
    const void *q, *k, *v, *mask, *sinks; /* mask, sinks (hq): NULL for none */
    int q_dtype, kv_dtype, mask_dtype, sinks_dtype, out_dtype;
    int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, m_sb, m_sh, m_st;
    int64_t b, hq, hkv, tq, tk, d;
    float scaling;
    void *out; /* (b, tq, hq, d) contiguous */
} mxfp4x_attention_args;

/* floats of one thread's scratch: the rows' queries (d x ROWS, and doubled), a block of
 * keys (KEYS x d, and twice as many interleaved), a value row's chunk, the scores (tk x
 * ROWS). */
MXFP4X_INLINE int64_t mxfp4x_attention_scratch(int64_t tk, int64_t d) {
    return 3 * d * MXFP4X_ATT_ROWS + 3 * MXFP4X_ATT_KEYS * d + MXFP4X_ACT_CHUNK +
           MXFP4X_ATT_ROWS * tk;
}

MXFP4X_INLINE size_t mxfp4x_att_size(int dtype) { return dtype == MXFP4X_DTYPE_F32 ? 4 : 2; }

/* One pass of a task: rows [r0, r1) of one (sequence, key/value head) task's g * tq query
 * rows, row r being head hk * g + r % g at token r / g, at most MXFP4X_ATT_ROWS of them;
 * they sit in the lanes of every loop over rows. */
typedef struct {
    int64_t s, hk, r0, nr, g;
    const char *kbase, *vbase;
    size_t kv_size;
    float *qt; /* qt[dd * ROWS + r]: the rows' queries, missing rows 0 */
    float *kf; /* kf[kb * d + dd]: KEYS keys */
    float *vf; /* a chunk of a value row */
    float *qq; /* qq[dd * 2 ROWS + 2 r + i] = qt[dd * ROWS + r] (the x86 AVX-512 path) */
    float *kp; /* 2 KEYS keys in pairs, interleaved (the x86 AVX-512 path) */
    float *sc; /* sc[j * ROWS + r]: the scores, then e_j */
    float sink[MXFP4X_ATT_ROWS], mx[MXFP4X_ATT_ROWS], z[MXFP4X_ATT_ROWS];
} mxfp4x_att_pass;

MXFP4X_INLINE int64_t mxfp4x_att_head(const mxfp4x_att_pass *w, int64_t r) {
    return w->hk * w->g + (w->r0 + r) % w->g;
}

MXFP4X_INLINE int64_t mxfp4x_att_token(const mxfp4x_att_pass *w, int64_t r) {
    return (w->r0 + r) / w->g;
}

MXFP4X_INLINE void mxfp4x_att_begin(const mxfp4x_attention_args *x, mxfp4x_att_pass *w,
                                    int64_t s, int64_t hk, int64_t r0, int64_t r1,
                                    float *scratch) {
    const int64_t d = x->d;
    const size_t q_size = mxfp4x_att_size(x->q_dtype);
    float row[MXFP4X_ACT_CHUNK];
    int64_t r, dd, i0, n;
    w->s = s, w->hk = hk, w->r0 = r0, w->nr = r1 - r0, w->g = x->hq / x->hkv;
    w->kv_size = mxfp4x_att_size(x->kv_dtype);
    w->kbase = (const char *)x->k + (size_t)(s * x->k_sb + hk * x->k_sh) * w->kv_size;
    w->vbase = (const char *)x->v + (size_t)(s * x->v_sb + hk * x->v_sh) * w->kv_size;
    w->qt = scratch;
    w->kf = w->qt + d * MXFP4X_ATT_ROWS;
    w->vf = w->kf + MXFP4X_ATT_KEYS * d;
    w->qq = w->vf + MXFP4X_ACT_CHUNK;
    w->kp = w->qq + 2 * d * MXFP4X_ATT_ROWS;
    w->sc = w->kp + 2 * MXFP4X_ATT_KEYS * d;
    for (dd = 0; dd < d * MXFP4X_ATT_ROWS; dd++) w->qt[dd] = 0.0f;
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) w->sink[r] = -INFINITY;
    for (r = 0; r < w->nr; r++) {
        const int64_t h = mxfp4x_att_head(w, r), t = mxfp4x_att_token(w, r);
        const char *qr = (const char *)x->q +
                         (size_t)(s * x->q_sb + h * x->q_sh + t * x->q_st) * q_size;
        for (i0 = 0; i0 < d; i0 += n) {
            n = d - i0 < MXFP4X_ACT_CHUNK ? d - i0 : MXFP4X_ACT_CHUNK;
            mxfp4x_act_load(qr, x->q_dtype, i0, 1, n, row);
            for (dd = 0; dd < n; dd++) w->qt[(i0 + dd) * MXFP4X_ATT_ROWS + r] = row[dd];
        }
        if (x->sinks) mxfp4x_act_load(x->sinks, x->sinks_dtype, h, 1, 1, &w->sink[r]);
    }
}

/* KEYS keys from j0 (nk of them, the rest 0) into kf as float32 */
MXFP4X_INLINE void mxfp4x_att_keys(const mxfp4x_attention_args *x, const mxfp4x_att_pass *w,
                                   int64_t j0, int64_t nk) {
    const int64_t d = x->d;
    int64_t kb, dd;
    for (kb = 0; kb < nk; kb++)
        mxfp4x_act_load(w->kbase + (size_t)((j0 + kb) * x->k_st) * w->kv_size, x->kv_dtype, 0, 1,
                        d, w->kf + kb * d);
    for (; kb < MXFP4X_ATT_KEYS; kb++)
        for (dd = 0; dd < d; dd++) w->kf[kb * d + dd] = 0.0f;
}

/* columns [c, c + n) of value row j into vf as float32 */
MXFP4X_INLINE void mxfp4x_att_value(const mxfp4x_attention_args *x, const mxfp4x_att_pass *w,
                                    int64_t j, int64_t c, int64_t n) {
    mxfp4x_act_load(w->vbase + (size_t)(j * x->v_st) * w->kv_size, x->kv_dtype, c, 1, n, w->vf);
}

/* the additive mask onto the scores */
/* the mask row of the pass's row r */
MXFP4X_INLINE const char *mxfp4x_att_mask_row(const mxfp4x_attention_args *x,
                                              const mxfp4x_att_pass *w, int64_t r) {
    return (const char *)x->mask +
           (size_t)(w->s * x->m_sb + mxfp4x_att_head(w, r) * x->m_sh +
                    mxfp4x_att_token(w, r) * x->m_st) *
               mxfp4x_att_size(x->mask_dtype);
}

/* the additive mask onto the scores; where every row of the pass reads one mask row (a
 * decoding step's mask, the same for every head) it is read once and added to the
 * key's scores of all rows together (rows past nr are never stored) */
MXFP4X_INLINE void mxfp4x_att_mask(const mxfp4x_attention_args *x, const mxfp4x_att_pass *w) {
    float row[MXFP4X_ACT_CHUNK];
    int64_t r, j, i0, n;
    int shared = 1;
    if (!x->mask) return;
    for (r = 1; r < w->nr; r++) shared &= mxfp4x_att_mask_row(x, w, r) == mxfp4x_att_mask_row(x, w, 0);
    if (shared) {
        const char *mr = mxfp4x_att_mask_row(x, w, 0);
        for (i0 = 0; i0 < x->tk; i0 += n) {
            n = x->tk - i0 < MXFP4X_ACT_CHUNK ? x->tk - i0 : MXFP4X_ACT_CHUNK;
            mxfp4x_act_load(mr, x->mask_dtype, i0, 1, n, row);
            for (j = 0; j < n; j++) {
                float *p = w->sc + (i0 + j) * MXFP4X_ATT_ROWS;
                for (r = 0; r < MXFP4X_ATT_ROWS; r++) p[r] = p[r] + row[j];
            }
        }
        return;
    }
    for (r = 0; r < w->nr; r++) {
        const char *mr = mxfp4x_att_mask_row(x, w, r);
        for (i0 = 0; i0 < x->tk; i0 += n) {
            n = x->tk - i0 < MXFP4X_ACT_CHUNK ? x->tk - i0 : MXFP4X_ACT_CHUNK;
            mxfp4x_act_load(mr, x->mask_dtype, i0, 1, n, row);
            for (j = 0; j < n; j++) {
                float *p = w->sc + (i0 + j) * MXFP4X_ATT_ROWS + r;
                *p = *p + row[j];
            }
        }
    }
}

MXFP4X_INLINE void mxfp4x_att_exp(float *a, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) a[i] = mxfp4x_expf(a[i]);
}

/* z from the parts of the sum, with the sink's term */
MXFP4X_INLINE void mxfp4x_att_z(const mxfp4x_attention_args *x, mxfp4x_att_pass *w,
                                float part[4][MXFP4X_ATT_ROWS]) {
    int r;
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) {
        w->z[r] = (part[0][r] + part[1][r]) + (part[2][r] + part[3][r]);
        if (x->sinks) w->z[r] = w->z[r] + mxfp4x_expf(w->sink[r] - w->mx[r]);
    }
}

/* row r's columns [c, c + n) of the output: o / z, rounded once */
MXFP4X_INLINE void mxfp4x_att_store(const mxfp4x_attention_args *x, const mxfp4x_att_pass *w,
                                    int64_t r, int64_t c, float *o, int64_t n) {
    const int64_t h = mxfp4x_att_head(w, r), t = mxfp4x_att_token(w, r);
    int64_t i;
    for (i = 0; i < n; i++) o[i] = o[i] / w->z[r];
    mxfp4x_act_store(o, n, x->out_dtype,
                     (char *)x->out + (size_t)(((w->s * x->tq + t) * x->hq + h) * x->d + c) *
                                          mxfp4x_att_size(x->out_dtype));
}

/* The plain C path (any compiler, any CPU). */
MXFP4X_INLINE void mxfp4x_att_rows_c(const mxfp4x_attention_args *x, int64_t s, int64_t hk,
                                     int64_t r0, int64_t r1, float *scratch) {
    const int64_t d = x->d, tk = x->tk;
    mxfp4x_att_pass w;
    float part[4][MXFP4X_ATT_ROWS], o[MXFP4X_ATT_ROWS][MXFP4X_ACT_CHUNK];
    int64_t r, dd, j, j0, kb, nk, c, nc, i;
    mxfp4x_att_begin(x, &w, s, hk, r0, r1, scratch);
    for (j0 = 0; j0 < tk; j0 += MXFP4X_ATT_KEYS) {
        nk = tk - j0 < MXFP4X_ATT_KEYS ? tk - j0 : MXFP4X_ATT_KEYS;
        mxfp4x_att_keys(x, &w, j0, nk);
        for (kb = 0; kb < nk; kb++)
            for (r = 0; r < MXFP4X_ATT_ROWS; r++) {
                float acc = 0.0f;
                for (dd = 0; dd < d; dd++)
                    acc = fmaf(w.qt[dd * MXFP4X_ATT_ROWS + r], w.kf[kb * d + dd], acc);
                w.sc[(j0 + kb) * MXFP4X_ATT_ROWS + r] = acc * x->scaling;
            }
    }
    mxfp4x_att_mask(x, &w);
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) w.mx[r] = w.sink[r];
    for (j = 0; j < tk; j++)
        for (r = 0; r < MXFP4X_ATT_ROWS; r++) {
            const float v = w.sc[j * MXFP4X_ATT_ROWS + r];
            w.mx[r] = v > w.mx[r] ? v : w.mx[r];
        }
    for (j = 0; j < tk; j++)
        for (r = 0; r < MXFP4X_ATT_ROWS; r++)
            w.sc[j * MXFP4X_ATT_ROWS + r] = w.sc[j * MXFP4X_ATT_ROWS + r] - w.mx[r];
    mxfp4x_att_exp(w.sc, tk * MXFP4X_ATT_ROWS);
    for (i = 0; i < 4; i++)
        for (r = 0; r < MXFP4X_ATT_ROWS; r++) part[i][r] = 0.0f;
    for (j = 0; j < tk; j++)
        for (r = 0; r < MXFP4X_ATT_ROWS; r++)
            part[j & 3][r] = part[j & 3][r] + w.sc[j * MXFP4X_ATT_ROWS + r];
    mxfp4x_att_z(x, &w, part);
    for (c = 0; c < d; c += MXFP4X_ACT_CHUNK) {
        nc = d - c < MXFP4X_ACT_CHUNK ? d - c : MXFP4X_ACT_CHUNK;
        for (r = 0; r < w.nr; r++)
            for (i = 0; i < nc; i++) o[r][i] = 0.0f;
        for (j = 0; j < tk; j++) {
            mxfp4x_att_value(x, &w, j, c, nc);
            for (r = 0; r < w.nr; r++) {
                const float e = w.sc[j * MXFP4X_ATT_ROWS + r];
                for (i = 0; i < nc; i++) o[r][i] = fmaf(e, w.vf[i], o[r][i]);
            }
        }
        for (r = 0; r < w.nr; r++) mxfp4x_att_store(x, &w, r, c, o[r], nc);
    }
}

#if MXFP4X_HAVE_X86_SIMD
/* The x86 path: 8 rows in a vector; AVX2 and FMA, or with AVX-512 the values 16 columns
 * to a vector. */
#  define MXFP4X_ATT_AVX2 static inline MXFP4X_TARGET_AVX2 MXFP4X_ALWAYS_INLINE
#  define MXFP4X_ATT_AVX512_NATIVE (!MXFP4X_EMULATED_AVX512)
#  define MXFP4X_TARGET_ATT512 MXFP4X_TARGET("avx512f,avx512vl,avx2,fma")
#  define MXFP4X_ATT_AVX512 static inline MXFP4X_TARGET_ATT512 MXFP4X_ALWAYS_INLINE

/* a bf16 row's 8 values from p as float32 */
#  define MXFP4X_ATT_BF16X8(p)                                                            \
    _mm256_castsi256_ps(                                                                   \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

/* key j's step of the ROWS chains: e_j (e[r] for row r) times its 8 value columns */
MXFP4X_ATT_AVX2 void mxfp4x_att_values_step_avx2(const float *e, __m256 v, __m256 *acc) {
    int r;
    for (r = 0; r < MXFP4X_ATT_ROWS; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(e + r), v, acc[r]);
}

/* 8 value columns from c for all rows: ROWS chains over j */
MXFP4X_ATT_AVX2 void mxfp4x_att_values_avx2(const mxfp4x_attention_args *x,
                                            mxfp4x_att_pass *w, int64_t c) {
    __m256 acc[MXFP4X_ATT_ROWS];
    float done[MXFP4X_ATT_ROWS][8];
    const int64_t nc = x->d - c < 8 ? x->d - c : 8;
    const int fast = nc == 8 && x->kv_dtype == MXFP4X_DTYPE_BF16;
    int64_t r, j, i;
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (i = nc; i < 8; i++) w->vf[i] = 0.0f;
    /* two loops, not one test per key: with the conversion's call in the loop body GCC
     * stores every chain to memory on every key */
    if (fast) {
        for (j = 0; j < x->tk; j++)
            mxfp4x_att_values_step_avx2(
                w->sc + j * MXFP4X_ATT_ROWS,
                MXFP4X_ATT_BF16X8(w->vbase + (size_t)(j * x->v_st + c) * 2), acc);
    } else {
        for (j = 0; j < x->tk; j++) {
            mxfp4x_att_value(x, w, j, c, nc);
            mxfp4x_att_values_step_avx2(w->sc + j * MXFP4X_ATT_ROWS, _mm256_loadu_ps(w->vf), acc);
        }
    }
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) /* to memory once: read below by a row count */
        _mm256_storeu_ps(done[r], acc[r]);
    for (r = 0; r < w->nr; r++) mxfp4x_att_store(x, w, r, c, done[r], nc);
}

#  if MXFP4X_ATT_AVX512_NATIVE
/* key j's step of the 2 x ROWS chains: e_j (e[r] for row r) times its 32 value columns */
MXFP4X_ATT_AVX512 void mxfp4x_att_values_step_avx512(const float *e, __m512 v0, __m512 v1,
                                                     __m512 *lo, __m512 *hi) {
    int r;
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) {
        const __m512 er = _mm512_set1_ps(e[r]);
        lo[r] = _mm512_fmadd_ps(er, v0, lo[r]);
        hi[r] = _mm512_fmadd_ps(er, v1, hi[r]);
    }
}

/* 32 value columns from c for all rows: 2 x ROWS chains over j */
MXFP4X_ATT_AVX512 void mxfp4x_att_values_avx512(const mxfp4x_attention_args *x,
                                                mxfp4x_att_pass *w, int64_t c) {
    __m512 lo[MXFP4X_ATT_ROWS], hi[MXFP4X_ATT_ROWS];
    float o[32];
    const int64_t nc = x->d - c < 32 ? x->d - c : 32;
    const int fast = nc == 32 && x->kv_dtype == MXFP4X_DTYPE_BF16;
    int64_t r, j, i;
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (i = nc; i < 32; i++) w->vf[i] = 0.0f;
    /* two loops, not one test per key: with the conversion's call in the loop body GCC
     * keeps one of the 16 chains in memory, a store and a load on every key */
    if (fast) {
        for (j = 0; j < x->tk; j++) {
            const char *p = w->vbase + (size_t)(j * x->v_st + c) * 2;
            const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
            const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32))), 16));
            mxfp4x_att_values_step_avx512(w->sc + j * MXFP4X_ATT_ROWS, v0, v1, lo, hi);
        }
    } else {
        for (j = 0; j < x->tk; j++) {
            mxfp4x_att_value(x, w, j, c, nc);
            mxfp4x_att_values_step_avx512(w->sc + j * MXFP4X_ATT_ROWS, _mm512_loadu_ps(w->vf),
                                          _mm512_loadu_ps(w->vf + 16), lo, hi);
        }
    }
    for (r = 0; r < w->nr; r++) {
        _mm512_storeu_ps(o, lo[r]);
        _mm512_storeu_ps(o + 16, hi[r]);
        mxfp4x_att_store(x, w, r, c, o, nc);
    }
}
#  endif

/* after the scores: the mask, the maxima, e_j, z; on 8-float vectors (one per key).  The
 * maximum as 4 partial ones (keys j mod 4, each from the sink) then taken together: the
 * same value as the plain C path's one chain (at most the sign of a zero differs, which
 * no s_j - m and no e_j sees); the sum's 4 parts in registers. */
#  define MXFP4X_ATT_SOFTMAX(SUFFIX, QUALIFIERS)                                          \
    QUALIFIERS void mxfp4x_att_softmax##SUFFIX(const mxfp4x_attention_args *x,             \
                                               mxfp4x_att_pass *w) {                       \
        const int64_t tk = x->tk;                                                          \
        float part[4][MXFP4X_ATT_ROWS];                                                    \
        __m256 mx, m4[4], p[4];                                                            \
        int64_t j, i;                                                                      \
        mxfp4x_att_mask(x, w);                                                             \
        mx = _mm256_loadu_ps(w->sink); /* v > mx ? v : mx, as the plain C path */          \
        for (i = 0; i < 4; i++) m4[i] = mx;                                                \
        for (j = 0; j + 4 <= tk; j += 4)                                                   \
            for (i = 0; i < 4; i++) {                                                      \
                const __m256 v = _mm256_loadu_ps(w->sc + (j + i) * MXFP4X_ATT_ROWS);       \
                m4[i] = _mm256_blendv_ps(m4[i], v, _mm256_cmp_ps(v, m4[i], _CMP_GT_OQ));   \
            }                                                                              \
        for (; j < tk; j++) {                                                              \
            const __m256 v = _mm256_loadu_ps(w->sc + j * MXFP4X_ATT_ROWS);                 \
            m4[j & 3] = _mm256_blendv_ps(m4[j & 3], v, _mm256_cmp_ps(v, m4[j & 3], _CMP_GT_OQ)); \
        }                                                                                  \
        for (i = 0; i < 4; i++)                                                            \
            mx = _mm256_blendv_ps(mx, m4[i], _mm256_cmp_ps(m4[i], mx, _CMP_GT_OQ));        \
        _mm256_storeu_ps(w->mx, mx);                                                       \
        for (j = 0; j < tk; j++)                                                           \
            _mm256_storeu_ps(w->sc + j * MXFP4X_ATT_ROWS,                                  \
                             _mm256_sub_ps(_mm256_loadu_ps(w->sc + j * MXFP4X_ATT_ROWS), mx)); \
        mxfp4x_att_exp(w->sc, tk * MXFP4X_ATT_ROWS);                                       \
        for (i = 0; i < 4; i++) p[i] = _mm256_setzero_ps();                                \
        for (j = 0; j + 4 <= tk; j += 4)                                                   \
            for (i = 0; i < 4; i++)                                                        \
                p[i] = _mm256_add_ps(p[i], _mm256_loadu_ps(w->sc + (j + i) * MXFP4X_ATT_ROWS)); \
        for (; j < tk; j++)                                                                \
            p[j & 3] = _mm256_add_ps(p[j & 3], _mm256_loadu_ps(w->sc + j * MXFP4X_ATT_ROWS)); \
        for (i = 0; i < 4; i++) _mm256_storeu_ps(part[i], p[i]);                           \
        mxfp4x_att_z(x, w, part);                                                          \
    }
MXFP4X_ATT_SOFTMAX(_avx2, MXFP4X_ATT_AVX2)
#  if MXFP4X_ATT_AVX512_NATIVE
MXFP4X_ATT_SOFTMAX(_avx512, MXFP4X_ATT_AVX512)
#  endif

/* the scores, KEYS keys at a time on 8-float vectors (one per key, rows in lanes) */
MXFP4X_ATT_AVX2 void mxfp4x_att_scores_avx2(const mxfp4x_attention_args *x,
                                            mxfp4x_att_pass *w) {
    const int64_t d = x->d, tk = x->tk;
    const __m256 scaling = _mm256_set1_ps(x->scaling);
    int64_t dd, j0, kb, nk;
    for (j0 = 0; j0 < tk; j0 += MXFP4X_ATT_KEYS) {
        __m256 acc[MXFP4X_ATT_KEYS];
        nk = tk - j0 < MXFP4X_ATT_KEYS ? tk - j0 : MXFP4X_ATT_KEYS;
        mxfp4x_att_keys(x, w, j0, nk);
        for (kb = 0; kb < MXFP4X_ATT_KEYS; kb++) acc[kb] = _mm256_setzero_ps();
        for (dd = 0; dd < d; dd++) {
            const __m256 q = _mm256_loadu_ps(w->qt + dd * MXFP4X_ATT_ROWS);
            for (kb = 0; kb < MXFP4X_ATT_KEYS; kb++)
                acc[kb] = _mm256_fmadd_ps(q, _mm256_broadcast_ss(w->kf + kb * d + dd), acc[kb]);
        }
        for (kb = 0; kb < MXFP4X_ATT_KEYS; kb++) /* all stored: kb < nk varies */
            _mm256_storeu_ps(w->kp + kb * MXFP4X_ATT_ROWS, _mm256_mul_ps(acc[kb], scaling));
        memcpy(w->sc + j0 * MXFP4X_ATT_ROWS, w->kp, sizeof(float) * MXFP4X_ATT_ROWS * nk);
    }
    mxfp4x_att_softmax_avx2(x, w);
}

#  if MXFP4X_ATT_AVX512_NATIVE
/* The scores of KEYS x 2 keys from j0 on 16-float vectors: lane 2r + i holds row r of
 * key j0 + 2p + i (pair p), the query doubled (qq[dd] = q[0][dd], q[0][dd], q[1][dd],
 * ...) times a pair's keys broadcast ({k_a[dd], k_b[dd]} as one 64-bit element), each
 * lane its own chain over d as on 8-float vectors. */
MXFP4X_ATT_AVX512 void mxfp4x_att_pairs_avx512(const mxfp4x_attention_args *x,
                                               mxfp4x_att_pass *w, const float *qq,
                                               float *kp, int64_t j0) {
    const int64_t d = x->d, nk = x->tk - j0 < 2 * MXFP4X_ATT_KEYS ? x->tk - j0
                                                                  : 2 * MXFP4X_ATT_KEYS;
    const __m512 scaling = _mm512_set1_ps(x->scaling);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512i split = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m512 acc[MXFP4X_ATT_KEYS];
    float sc[2 * MXFP4X_ATT_ROWS];
    int64_t p, dd, i, kb;
    /* the pairs' keys interleaved: kp[(p * d + dd) * 2 + i] */
    if (x->kv_dtype == MXFP4X_DTYPE_BF16 && d % 16 == 0 && nk == 2 * MXFP4X_ATT_KEYS) {
        for (p = 0; p < MXFP4X_ATT_KEYS; p++) {
            const char *a = w->kbase + (size_t)((j0 + 2 * p) * x->k_st) * 2;
            const char *b = a + (size_t)x->k_st * 2;
            for (dd = 0; dd < d; dd += 16) {
                const __m512 fa = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + dd * 2))), 16));
                const __m512 fb = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + dd * 2))), 16));
                _mm512_storeu_ps(kp + (p * d + dd) * 2, _mm512_permutex2var_ps(fa, lo, fb));
                _mm512_storeu_ps(kp + (p * d + dd) * 2 + 16, _mm512_permutex2var_ps(fa, hi, fb));
            }
        }
    } else {
        for (kb = 0; kb < 2 * MXFP4X_ATT_KEYS; kb += MXFP4X_ATT_KEYS) {
            const int64_t n = nk - kb < 0 ? 0 : nk - kb < MXFP4X_ATT_KEYS ? nk - kb
                                                                           : MXFP4X_ATT_KEYS;
            mxfp4x_att_keys(x, w, j0 + kb, n);
            for (i = 0; i < MXFP4X_ATT_KEYS; i++)
                for (dd = 0; dd < d; dd++)
                    kp[(((kb + i) / 2) * d + dd) * 2 + (kb + i) % 2] = w->kf[i * d + dd];
        }
    }
    for (p = 0; p < MXFP4X_ATT_KEYS; p++) acc[p] = _mm512_setzero_ps();
    for (dd = 0; dd < d; dd++) {
        const __m512 q = _mm512_loadu_ps(qq + dd * 16);
        for (p = 0; p < MXFP4X_ATT_KEYS; p++) {
            double pair;
            memcpy(&pair, kp + (p * d + dd) * 2, sizeof pair);
            acc[p] = _mm512_fmadd_ps(q, _mm512_castpd_ps(_mm512_set1_pd(pair)), acc[p]);
        }
    }
    for (p = 0; p < MXFP4X_ATT_KEYS; p++) {
        const __m512 v = _mm512_permutexvar_ps(split, _mm512_mul_ps(acc[p], scaling));
        if (2 * p + 2 <= nk) {
            _mm512_storeu_ps(w->sc + (j0 + 2 * p) * MXFP4X_ATT_ROWS, v);
        } else if (2 * p < nk) {
            _mm512_storeu_ps(sc, v);
            memcpy(w->sc + (j0 + 2 * p) * MXFP4X_ATT_ROWS, sc, sizeof(float) * MXFP4X_ATT_ROWS);
        }
    }
}
#  endif

MXFP4X_ATT_AVX2 void mxfp4x_att_rows_avx2(const mxfp4x_attention_args *x, int64_t s,
                                          int64_t hk, int64_t r0, int64_t r1, float *scratch) {
    mxfp4x_att_pass w;
    int64_t c;
    mxfp4x_att_begin(x, &w, s, hk, r0, r1, scratch);
    mxfp4x_att_scores_avx2(x, &w);
    for (c = 0; c < x->d; c += 8) mxfp4x_att_values_avx2(x, &w, c);
}

#  if MXFP4X_ATT_AVX512_NATIVE
MXFP4X_ATT_AVX512 void mxfp4x_att_rows_avx512(const mxfp4x_attention_args *x, int64_t s,
                                              int64_t hk, int64_t r0, int64_t r1,
                                              float *scratch) {
    mxfp4x_att_pass w;
    int64_t c;
    int64_t dd, j0, i;
    mxfp4x_att_begin(x, &w, s, hk, r0, r1, scratch);
    for (dd = 0; dd < x->d * MXFP4X_ATT_ROWS; dd++)
        for (i = 0; i < 2; i++) w.qq[dd * 2 + i] = w.qt[dd];
    for (j0 = 0; j0 < x->tk; j0 += 2 * MXFP4X_ATT_KEYS)
        mxfp4x_att_pairs_avx512(x, &w, w.qq, w.kp, j0);
    mxfp4x_att_softmax_avx512(x, &w);
    for (c = 0; c < x->d; c += 32) mxfp4x_att_values_avx512(x, &w, c);
}
#  endif
#endif

/* Task t of b * hkv * ceil(g * tq / ROWS): (sequence, key/value head, a pass's rows). */
MXFP4X_INLINE void mxfp4x_att_task(const mxfp4x_attention_args *x, int64_t t, int64_t *s,
                                   int64_t *hk, int64_t *r0, int64_t *r1) {
    const int64_t rows = x->hq / x->hkv * x->tq;
    const int64_t passes = (rows + MXFP4X_ATT_ROWS - 1) / MXFP4X_ATT_ROWS;
    *s = t / passes / x->hkv, *hk = t / passes % x->hkv, *r0 = t % passes * MXFP4X_ATT_ROWS;
    *r1 = rows - *r0 < MXFP4X_ATT_ROWS ? rows : *r0 + MXFP4X_ATT_ROWS;
}

static void mxfp4x_attention_c(const mxfp4x_attention_args *x, int64_t t0, int64_t t1,
                               float *scratch) {
    int64_t t, s, hk, r0, r1;
    for (t = t0; t < t1; t++) {
        mxfp4x_att_task(x, t, &s, &hk, &r0, &r1);
        mxfp4x_att_rows_c(x, s, hk, r0, r1, scratch);
    }
}

#if MXFP4X_HAVE_X86_SIMD
#  define MXFP4X_ATT_TASKS(SUFFIX, TARGET)                                                \
    static TARGET void mxfp4x_attention##SUFFIX(const mxfp4x_attention_args *x, int64_t t0, \
                                                int64_t t1, float *scratch) {              \
        int64_t t, s, hk, r0, r1;                                                          \
        for (t = t0; t < t1; t++) {                                                        \
            mxfp4x_att_task(x, t, &s, &hk, &r0, &r1);                                      \
            mxfp4x_att_rows##SUFFIX(x, s, hk, r0, r1, scratch);                            \
        }                                                                                  \
    }
MXFP4X_ATT_TASKS(_avx2, MXFP4X_TARGET_AVX2)
#  if MXFP4X_ATT_AVX512_NATIVE
MXFP4X_ATT_TASKS(_avx512, MXFP4X_TARGET_ATT512)
#  endif
#endif

#if MXFP4X_HAVE_NEON
/* The AArch64 path: 8 rows in two 4-float vectors (rows 0-3, 4-7), the AVX2 path's
 * loops on them; NEON is part of the architecture, so no target attribute. */
#  define MXFP4X_ATT_NEON static inline MXFP4X_ALWAYS_INLINE

/* the scores, KEYS keys at a time (two vectors per key, rows in lanes) */
MXFP4X_ATT_NEON void mxfp4x_att_scores_neon(const mxfp4x_attention_args *x,
                                            mxfp4x_att_pass *w) {
    const int64_t d = x->d, tk = x->tk;
    int64_t dd, j0, kb, nk;
    for (j0 = 0; j0 < tk; j0 += MXFP4X_ATT_KEYS) {
        float32x4_t lo[MXFP4X_ATT_KEYS], hi[MXFP4X_ATT_KEYS];
        nk = tk - j0 < MXFP4X_ATT_KEYS ? tk - j0 : MXFP4X_ATT_KEYS;
        mxfp4x_att_keys(x, w, j0, nk);
        for (kb = 0; kb < MXFP4X_ATT_KEYS; kb++) lo[kb] = hi[kb] = vdupq_n_f32(0.0f);
        for (dd = 0; dd < d; dd++) {
            const float32x4_t q0 = vld1q_f32(w->qt + dd * MXFP4X_ATT_ROWS);
            const float32x4_t q1 = vld1q_f32(w->qt + dd * MXFP4X_ATT_ROWS + 4);
            for (kb = 0; kb < MXFP4X_ATT_KEYS; kb++) {
                const float k = w->kf[kb * d + dd];
                lo[kb] = vfmaq_n_f32(lo[kb], q0, k);
                hi[kb] = vfmaq_n_f32(hi[kb], q1, k);
            }
        }
        for (kb = 0; kb < nk; kb++) {
            float *sc = w->sc + (j0 + kb) * MXFP4X_ATT_ROWS;
            vst1q_f32(sc, vmulq_n_f32(lo[kb], x->scaling));
            vst1q_f32(sc + 4, vmulq_n_f32(hi[kb], x->scaling));
        }
    }
}

/* after the scores: the mask, the maxima, e_j, z */
MXFP4X_ATT_NEON void mxfp4x_att_softmax_neon(const mxfp4x_attention_args *x,
                                             mxfp4x_att_pass *w) {
    const int64_t tk = x->tk;
    float part[4][MXFP4X_ATT_ROWS];
    float32x4_t mx[2], p[4][2];
    int64_t j, h;
    mxfp4x_att_mask(x, w);
    for (h = 0; h < 2; h++) mx[h] = vld1q_f32(w->sink + 4 * h);
    for (j = 0; j < tk; j++) /* v > mx ? v : mx, as the plain C path */
        for (h = 0; h < 2; h++) {
            const float32x4_t v = vld1q_f32(w->sc + j * MXFP4X_ATT_ROWS + 4 * h);
            mx[h] = vbslq_f32(vcgtq_f32(v, mx[h]), v, mx[h]);
        }
    for (h = 0; h < 2; h++) vst1q_f32(w->mx + 4 * h, mx[h]);
    for (j = 0; j < tk; j++)
        for (h = 0; h < 2; h++) {
            float *sc = w->sc + j * MXFP4X_ATT_ROWS + 4 * h;
            vst1q_f32(sc, vsubq_f32(vld1q_f32(sc), mx[h]));
        }
    mxfp4x_att_exp(w->sc, tk * MXFP4X_ATT_ROWS);
    for (j = 0; j < 4; j++) p[j][0] = p[j][1] = vdupq_n_f32(0.0f);
    for (j = 0; j < tk; j++)
        for (h = 0; h < 2; h++)
            p[j & 3][h] = vaddq_f32(p[j & 3][h], vld1q_f32(w->sc + j * MXFP4X_ATT_ROWS + 4 * h));
    for (j = 0; j < 4; j++)
        for (h = 0; h < 2; h++) vst1q_f32(part[j] + 4 * h, p[j][h]);
    mxfp4x_att_z(x, w, part);
}

/* 8 value columns from c for all rows: 2 x ROWS chains over j */
MXFP4X_ATT_NEON void mxfp4x_att_values_neon(const mxfp4x_attention_args *x,
                                            mxfp4x_att_pass *w, int64_t c) {
    float32x4_t lo[MXFP4X_ATT_ROWS], hi[MXFP4X_ATT_ROWS];
    float o[8];
    const int64_t nc = x->d - c < 8 ? x->d - c : 8;
    const int fast = nc == 8 && x->kv_dtype == MXFP4X_DTYPE_BF16;
    int64_t r, j, i;
    for (r = 0; r < MXFP4X_ATT_ROWS; r++) lo[r] = hi[r] = vdupq_n_f32(0.0f);
    for (i = nc; i < 8; i++) w->vf[i] = 0.0f;
    for (j = 0; j < x->tk; j++) {
        const float *e = w->sc + j * MXFP4X_ATT_ROWS;
        float32x4_t v0, v1;
        if (fast) {
            const uint16x8_t b = vld1q_u16((const uint16_t *)(const void *)(
                w->vbase + (size_t)(j * x->v_st + c) * 2));
            v0 = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
            v1 = vreinterpretq_f32_u32(vshll_high_n_u16(b, 16));
        } else {
            mxfp4x_att_value(x, w, j, c, nc);
            v0 = vld1q_f32(w->vf);
            v1 = vld1q_f32(w->vf + 4);
        }
        for (r = 0; r < MXFP4X_ATT_ROWS; r++) {
            lo[r] = vfmaq_n_f32(lo[r], v0, e[r]);
            hi[r] = vfmaq_n_f32(hi[r], v1, e[r]);
        }
    }
    for (r = 0; r < w->nr; r++) {
        vst1q_f32(o, lo[r]);
        vst1q_f32(o + 4, hi[r]);
        mxfp4x_att_store(x, w, r, c, o, nc);
    }
}

static void mxfp4x_attention_neon(const mxfp4x_attention_args *x, int64_t t0, int64_t t1,
                                  float *scratch) {
    mxfp4x_att_pass w;
    int64_t t, s, hk, r0, r1, c;
    for (t = t0; t < t1; t++) {
        mxfp4x_att_task(x, t, &s, &hk, &r0, &r1);
        mxfp4x_att_begin(x, &w, s, hk, r0, r1, scratch);
        mxfp4x_att_scores_neon(x, &w);
        mxfp4x_att_softmax_neon(x, &w);
        for (c = 0; c < x->d; c += 8) mxfp4x_att_values_neon(x, &w, c);
    }
}
#endif

/* tasks [t0, t1) on ISA isa (an MXFP4X_ISA_* this CPU runs): the x86 path from AVX2 on
 * (AVX-512's where the ISA has it), NEON's on AArch64, else plain C; the same bits every
 * way */
static void mxfp4x_attention(int isa, const mxfp4x_attention_args *x, int64_t t0, int64_t t1,
                             float *scratch) {
#if MXFP4X_HAVE_X86_SIMD
#  if MXFP4X_ATT_AVX512_NATIVE
    if (isa == MXFP4X_ISA_AVX512 || isa == MXFP4X_ISA_AMX || isa == MXFP4X_ISA_AVX512BF16) {
        mxfp4x_attention_avx512(x, t0, t1, scratch);
        return;
    }
#  endif
    /* (an emulated AVX-512 build runs its avx512 ISA on CPUs without AVX2: plain C) */
    if (isa == MXFP4X_ISA_AVX2) {
        mxfp4x_attention_avx2(x, t0, t1, scratch);
        return;
    }
#endif
#if MXFP4X_HAVE_NEON
    if (isa == MXFP4X_ISA_NEON) {
        mxfp4x_attention_neon(x, t0, t1, scratch);
        return;
    }
#endif
    (void)isa;
    mxfp4x_attention_c(x, t0, t1, scratch);
}

/* gpt-oss's rotary embedding of one token's n_heads heads of d bfloat16 values (bits), in
 * place: each head's halves x1 = x[0, d/2), x2 = x[d/2, d) turned by cos and sin (d/2
 * bfloat16 values each) in transformers' bfloat16 operations (its _apply_rotary_emb), each
 * product and each difference or sum a float32 operation rounded to bfloat16, as torch's
 * CPU operations on bfloat16 tensors compute them:
 *
 *     x1' = bf(bf(x1 cos) - bf(x2 sin)),   x2' = bf(bf(x2 cos) + bf(x1 sin))
 *
 * (a NaN becomes 0xFFFF, as torch's vectorised rounding gives). */
MXFP4X_INLINE uint16_t mxfp4x_rope_bf(float f) { return mxfp4x_bits_to_bf16(mxfp4x_f32_to_bits(f)); }

MXFP4X_INLINE void mxfp4x_rope_bf16(uint16_t *x, int64_t n_heads, int64_t d,
                                    const uint16_t *cos, const uint16_t *sin) {
    const int64_t half = d / 2;
    int64_t h, i;
    for (h = 0; h < n_heads; h++) {
        uint16_t *x1 = x + h * d, *x2 = x1 + half;
        for (i = 0; i < half; i++) {
            const float a = mxfp4x_bf16_to_f32(x1[i]), b = mxfp4x_bf16_to_f32(x2[i]);
            const float c = mxfp4x_bf16_to_f32(cos[i]), s = mxfp4x_bf16_to_f32(sin[i]);
            const float ac = mxfp4x_bf16_to_f32(mxfp4x_rope_bf(a * c));
            const float bs = mxfp4x_bf16_to_f32(mxfp4x_rope_bf(b * s));
            const float bc = mxfp4x_bf16_to_f32(mxfp4x_rope_bf(b * c));
            const float as = mxfp4x_bf16_to_f32(mxfp4x_rope_bf(a * s));
            x1[i] = mxfp4x_rope_bf(ac - bs);
            x2[i] = mxfp4x_rope_bf(bc + as);
        }
    }
}

/* tasks of a call */
MXFP4X_INLINE int64_t mxfp4x_attention_tasks(const mxfp4x_attention_args *x) {
    const int64_t rows = x->hq / x->hkv * x->tq;
    return x->b * x->hkv * ((rows + MXFP4X_ATT_ROWS - 1) / MXFP4X_ATT_ROWS);
}

#endif /* MXFP4X_ATTENTION_H */
