/* mxfp4x/bf16/unit.h -- the exact-path tests shared by the bf16 dot-product units (amx.h's
 * tdpbf16ps, avx512bf16.h's vdpbf16ps), which both read subnormal inputs as zero and flush
 * subnormal results: tables.h's MXFP4X_AMX_* bounds decide, per row and per token, what
 * the unit may take.  AVX-512F + BW, inlined into each unit's own target region. */
#ifndef MXFP4X_BF16_UNIT_H
#define MXFP4X_BF16_UNIT_H

#include "../mxfp4x.h"

#if MXFP4X_HAVE_AMX || MXFP4X_HAVE_AVX512BF16
#include <immintrin.h>

#define MXFP4X_BF16_UNIT_INLINE \
    static inline MXFP4X_TARGET("avx512f,avx512bw,avx2") MXFP4X_ALWAYS_INLINE

/* One group of one row, as both units take it: 16 bytes -> 32 bf16 words of the scaled
 * table of scale byte s (word 2k: the low nibble of byte k, word 2k + 1: its high nibble). */
MXFP4X_BF16_UNIT_INLINE __m512i mxfp4x_bf16_decode_group(const uint8_t *b, uint8_t s) {
    const __m512i t = _mm512_castsi256_si512(
        _mm256_load_si256((const __m256i *)mxfp4x_e2m1_scaled_bf16[s]));
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    /* (d | d << 12) & 0x000F000F: the low nibble in word 0, the high nibble in word 1 */
    const __m512i idx =
        _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F),
                                  0xA8);
    return _mm512_permutexvar_epi16(idx, t);
}

/* Row r's flags (tables.h's MXFP4X_BF16_SMALL / _LARGE): MXFP4X_BF16_LARGE for a scale
 * byte >= MXFP4X_AMX_MAX_SCALE (255, NaN, included), else MXFP4X_BF16_SMALL for a group
 * with a nonzero magnitude code under a scale byte < MXFP4X_AMX_MIN_SCALE (its weights
 * could be or become subnormal), else 0.  The scale bytes are scanned first (64 at a time
 * where they are contiguous), the groups' bytes only under a small scale. */
MXFP4X_BF16_UNIT_INLINE int mxfp4x_bf16_row_unsafe(const mxfp4x_rows *w, int64_t r) {
    const int64_t G = w->n_groups, gb = w->group_stride_blocks, gs = w->group_stride_scales;
    const uint8_t *b = w->blocks + r * w->row_stride_blocks;
    const uint8_t *s = w->scales + r * w->row_stride_scales;
    int small = 0;
    int64_t g;
    if (gs == 1) {
        const __m512i lim = _mm512_set1_epi8((char)MXFP4X_AMX_MIN_SCALE);
        const __m512i big = _mm512_set1_epi8((char)(MXFP4X_AMX_MAX_SCALE - 1));
        for (g = 0; g < G; g += 64) {
            const __mmask64 k = G - g >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (G - g)) - 1);
            const __m512i v = _mm512_maskz_loadu_epi8(k, s + g);
            if (_mm512_mask_cmpgt_epu8_mask(k, v, big)) return MXFP4X_BF16_LARGE;
            small |= _mm512_mask_cmplt_epu8_mask(k, v, lim) != 0;
        }
    } else {
        for (g = 0; g < G; g++) {
            if (s[g * gs] >= MXFP4X_AMX_MAX_SCALE) return MXFP4X_BF16_LARGE;
            small |= s[g * gs] < MXFP4X_AMX_MIN_SCALE;
        }
    }
    if (small)
        for (g = 0; g < G; g++)
            if (s[g * gs] < MXFP4X_AMX_MIN_SCALE &&
                !_mm_testz_si128(_mm_loadu_si128((const __m128i *)(b + g * gb)),
                                 _mm_set1_epi8(0x77)))
                return MXFP4X_BF16_SMALL;
    return 0;
}

/* Whether rows [r0, r1) are all safe by their scale bytes alone: every one in
 * [MXFP4X_AMX_MIN_SCALE, MXFP4X_AMX_MAX_SCALE), so mxfp4x_bf16_row_unsafe is 0 for each
 * (real checkpoints' scales lie there).  One pass over the rows' scale bytes where they lie
 * back to back (group stride 1, row stride G: the safetensors layout), 128 bytes at a time;
 * 0 (ask row by row) elsewhere or when a byte is outside.  At one token the row-by-row
 * test alone is a visible share of a call, and one wrapped test per byte (below) is
 * cheaper than a running min and max (docs/performance.md, "The bf16 units, AMX and
 * float64"). */
MXFP4X_BF16_UNIT_INLINE int mxfp4x_bf16_rows_safe(const mxfp4x_rows *w, int64_t r0,
                                                  int64_t r1) {
    const int64_t G = w->n_groups, n = (r1 - r0) * G;
    const uint8_t *s = w->scales + r0 * w->row_stride_scales;
    /* one test per byte: b - MIN (mod 256) <= MAX - 1 - MIN exactly when MIN <= b < MAX
     * (a byte under MIN wraps to 256 - MIN or more, over the bound); the largest such
     * difference kept in two independent maxima */
    const __m512i min = _mm512_set1_epi8((char)MXFP4X_AMX_MIN_SCALE);
    __m512i m0 = _mm512_setzero_si512(), m1 = m0;
    int64_t i;
    MXFP4X_STATIC_ASSERT(MXFP4X_AMX_MIN_SCALE < MXFP4X_AMX_MAX_SCALE &&
                             MXFP4X_AMX_MAX_SCALE <= 256, "rows_safe: one wrapped range test");
    if (w->group_stride_scales != 1 || w->row_stride_scales != G || n <= 0) return n <= 0;
    for (i = 0; i + 128 <= n; i += 128) {
        m0 = _mm512_max_epu8(m0, _mm512_sub_epi8(_mm512_loadu_si512((const void *)(s + i)), min));
        m1 = _mm512_max_epu8(
            m1, _mm512_sub_epi8(_mm512_loadu_si512((const void *)(s + i + 64)), min));
    }
    if (i + 64 <= n) {
        m0 = _mm512_max_epu8(m0, _mm512_sub_epi8(_mm512_loadu_si512((const void *)(s + i)), min));
        i += 64;
    }
    if (i < n) {
        const __mmask64 k = ((__mmask64)1 << (n - i)) - 1; /* n - i < 64 */
        m1 = _mm512_mask_max_epu8(m1, k, m1,
                                  _mm512_sub_epi8(_mm512_maskz_loadu_epi8(k, s + i), min));
    }
    return !_mm512_cmpgt_epu8_mask(
        _mm512_max_epu8(m0, m1),
        _mm512_set1_epi8((char)(MXFP4X_AMX_MAX_SCALE - 1 - MXFP4X_AMX_MIN_SCALE)));
}

/* The lanes of 32 bf16 latents (bits) the unit could flush: nonzero finite ones under
 * 2^-60 in magnitude (|bits| in 1 .. 0x217F, bf16 exponent field under 67, subnormals
 * included). */
MXFP4X_BF16_UNIT_INLINE __mmask32 mxfp4x_bf16_latents_small(__m512i v) {
    const __m512i a = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
    const __m512i lim = _mm512_set1_epi16((short)((MXFP4X_AMX_MIN_LATENT_EXP << 7) - 1));
    /* |bits| - 1 < limit - 1, unsigned: nonzero and under the limit */
    return _mm512_cmplt_epu16_mask(_mm512_sub_epi16(a, _mm512_set1_epi16(1)), lim);
}

/* ... and the ones that could overflow a product or a sum: at least 2^64 (exponent field
 * 191 or more, infinities and NaNs included). */
MXFP4X_BF16_UNIT_INLINE __mmask32 mxfp4x_bf16_latents_large(__m512i v) {
    const __m512i a = _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF));
    const __m512i huge = _mm512_set1_epi16((short)((MXFP4X_AMX_MAX_LATENT_EXP << 7) - 1));
    return _mm512_cmpgt_epu16_mask(a, huge);
}

/* A token's flags (tables.h) from the lanes of its latents found small and large. */
static inline uint8_t mxfp4x_bf16_token_flags(__mmask32 small, __mmask32 large) {
    return (uint8_t)((small ? MXFP4X_BF16_SMALL : 0) | (large ? MXFP4X_BF16_LARGE : 0));
}

#endif /* MXFP4X_HAVE_AMX || MXFP4X_HAVE_AVX512BF16 */
#endif /* MXFP4X_BF16_UNIT_H */
