/* mxfp4x/emulate_avx512.h -- the AVX-512 kernels' source (avx512.h) on any x86-64.
 *
 * Built only with -DMXFP4X_EMULATE_AVX512 (setup.py: MXFP4X_EMULATE_AVX512=1), where
 * avx512.h includes this header instead of <immintrin.h> and its functions carry no
 * target attribute (config.h): every _mm512_* / _mm256_* / FMA intrinsic becomes
 * portable C from SIMDe (https://github.com/simd-everywhere/simde, MIT; Debian
 * libsimde-dev), compiled for the x86-64 baseline (SSE2).  The purpose is testing:
 * the same kernel source runs on AVX2-only and pre-AVX CPUs, and on an AVX-512 CPU
 * its results must be bit-identical to the native build (tests/platform/test_emulation.py).
 *
 * Include order.  <immintrin.h> comes first (avx2.h and config.h include it anyway):
 * SSE/SSE2 intrinsics and __m128 / __m128i stay native (no target needed on x86-64),
 * and SIMDe sees GCC's AVX-512 types and reuses them as simde__m512 (types.h).  Then
 * SIMDe with SIMDE_ENABLE_NATIVE_ALIASES: every intrinsic the build cannot use
 * natively (AVX, AVX2, FMA, AVX-512) gets a function-like macro of the native name,
 * which shadows GCC's target-restricted function for all code *after* this header.
 * avx2.h, included earlier by dispatch.h, keeps the native functions.
 *
 * Our shims (#undef SIMDe's alias, #define ours), each because SIMDe 0.7.4 lacks the
 * intrinsic or is not bit-exact for it:
 *
 *   _mm512_cvtepu8_epi32       missing in SIMDe 0.7.4 (vpmovzxbd, 16 bytes -> 16 x u32).
 *   _mm512_cvtepu8_epi64       missing too (vpmovzxbq, the low 8 bytes -> 8 x u64).
 *   _mm_fmadd_ss, _mm_fmadd_ps, _mm256_fmadd_ps, _mm512_fmadd_ps, and the fmsub,
 *   fnmadd, fnmsub forms of each
 *                              without native FMA, SIMDe computes a*b+c as a multiply
 *                              then an add (fma.h, avx512/fmadd.h): two roundings,
 *                              where vfmadd rounds once.  Ours: fmaf() per lane, which
 *                              C99/IEEE 754 require to round once (glibc: correctly
 *                              rounded in software, or the FMA instruction via ifunc).
 *                              Negation is exact, so fnmadd(a,b,c) = fmaf(-a, b, c) etc.
 *   _mm512_permutexvar_ps      avx512.h feeds whole bytes (0..255) as indices and relies
 *                              on vpermps reading index bits 3..0 only.  SIMDe's
 *                              portable path masks with 0x0F, but that is one path of
 *                              several chosen by the build's native ISA; ours masks
 *                              explicitly, whatever SIMDe's configuration.
 *
 * Every other intrinsic avx512.h uses is an exact SIMDe operation (loads, stores,
 * casts, extracts, set, shifts, and IEEE add/mul, with -ffp-contract=off so the
 * compiler fuses nothing); tests/platform/test_emulation.py lists them and fails on an
 * intrinsic that nobody has checked.  Not covered: NaN payloads (which NaN an FMA of
 * two NaNs returns depends on the instruction form the compiler picked, native or
 * not), and the MXCSR: the kernels run with FTZ/DAZ off (config.h), as fmaf assumes.
 */
#ifndef MXFP4X_EMULATE_AVX512_H
#define MXFP4X_EMULATE_AVX512_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#ifndef SIMDE_ENABLE_NATIVE_ALIASES
#define SIMDE_ENABLE_NATIVE_ALIASES
#endif
#if defined(__has_include)
#  if !__has_include(<simde/x86/avx512.h>)
#    error "MXFP4X_EMULATE_AVX512 needs the SIMDe headers (Debian/Ubuntu: apt-get install libsimde-dev; or the include path of a SIMDe checkout)"
#  endif
#endif
#include <simde/x86/avx512.h>

#if defined(SIMDE_X86_AVX512F_NATIVE) || defined(SIMDE_X86_FMA_NATIVE)
#  error "MXFP4X_EMULATE_AVX512: build without -mavx512f / -mfma / -march (SIMDe would use the native instructions and emulate nothing)"
#endif

#define MXFP4X_EMU static inline

/* vpmovzxbd: byte i of `a` zero-extended into 32-bit lane i. */
MXFP4X_EMU simde__m512i mxfp4x_emu_mm512_cvtepu8_epi32(simde__m128i a) {
    uint8_t b[16];
    int32_t r[16];
    int i;
    memcpy(b, &a, sizeof b);
    for (i = 0; i < 16; i++) r[i] = (int32_t)b[i];
    return simde_mm512_loadu_si512((const void *)r);
}
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) mxfp4x_emu_mm512_cvtepu8_epi32(a)

/* vpmovzxbq: byte i (< 8) of `a` zero-extended into 64-bit lane i. */
MXFP4X_EMU simde__m512i mxfp4x_emu_mm512_cvtepu8_epi64(simde__m128i a) {
    uint8_t b[16];
    int64_t r[8];
    int i;
    memcpy(b, &a, sizeof b);
    for (i = 0; i < 8; i++) r[i] = (int64_t)b[i];
    return simde_mm512_loadu_si512((const void *)r);
}
#undef _mm512_cvtepu8_epi64
#define _mm512_cvtepu8_epi64(a) mxfp4x_emu_mm512_cvtepu8_epi64(a)

/* vpermps zmm: lane i = a[idx[i] & 15] (the instruction ignores index bits 31..4). */
MXFP4X_EMU simde__m512 mxfp4x_emu_mm512_permutexvar_ps(simde__m512i idx, simde__m512 a) {
    int32_t ix[16];
    float t[16], r[16];
    int i;
    simde_mm512_storeu_si512((void *)ix, idx);
    simde_mm512_storeu_ps(t, a);
    for (i = 0; i < 16; i++) r[i] = t[ix[i] & 15];
    return simde_mm512_loadu_ps(r);
}
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps(idx, a) mxfp4x_emu_mm512_permutexvar_ps(idx, a)

/* The FMA family, one rounding per lane.  sa, sc: signs applied to a and c (exact). */
MXFP4X_EMU void mxfp4x_emu_fma_lanes(float *r, const float *a, const float *b,
                                     const float *c, int n, float sa, float sc) {
    int i;
    for (i = 0; i < n; i++) r[i] = fmaf(sa * a[i], b[i], sc * c[i]);
}

#define MXFP4X_EMU_FMA_VEC(name, vec, lanes, load, store, sa, sc)                      \
    MXFP4X_EMU vec mxfp4x_emu_##name(vec a, vec b, vec c) {                             \
        float fa[lanes], fb[lanes], fc[lanes], fr[lanes];                               \
        store(fa, a);                                                                   \
        store(fb, b);                                                                   \
        store(fc, c);                                                                   \
        mxfp4x_emu_fma_lanes(fr, fa, fb, fc, lanes, sa, sc);                            \
        return load(fr);                                                                \
    }
/* scalar forms: lane 0 fused, lanes 1..3 from a (as vfmadd*ss) */
#define MXFP4X_EMU_FMA_SS(name, sa, sc)                                                 \
    MXFP4X_EMU simde__m128 mxfp4x_emu_##name(simde__m128 a, simde__m128 b, simde__m128 c) { \
        const float r = fmaf(sa * simde_mm_cvtss_f32(a), simde_mm_cvtss_f32(b),         \
                             sc * simde_mm_cvtss_f32(c));                               \
        return simde_mm_move_ss(a, simde_mm_set_ss(r));                                 \
    }

MXFP4X_EMU_FMA_VEC(mm512_fmadd_ps, simde__m512, 16, simde_mm512_loadu_ps, simde_mm512_storeu_ps, 1.0f, 1.0f)
MXFP4X_EMU_FMA_VEC(mm512_fmsub_ps, simde__m512, 16, simde_mm512_loadu_ps, simde_mm512_storeu_ps, 1.0f, -1.0f)
MXFP4X_EMU_FMA_VEC(mm512_fnmadd_ps, simde__m512, 16, simde_mm512_loadu_ps, simde_mm512_storeu_ps, -1.0f, 1.0f)
MXFP4X_EMU_FMA_VEC(mm512_fnmsub_ps, simde__m512, 16, simde_mm512_loadu_ps, simde_mm512_storeu_ps, -1.0f, -1.0f)
MXFP4X_EMU_FMA_VEC(mm256_fmadd_ps, simde__m256, 8, simde_mm256_loadu_ps, simde_mm256_storeu_ps, 1.0f, 1.0f)
MXFP4X_EMU_FMA_VEC(mm256_fmsub_ps, simde__m256, 8, simde_mm256_loadu_ps, simde_mm256_storeu_ps, 1.0f, -1.0f)
MXFP4X_EMU_FMA_VEC(mm256_fnmadd_ps, simde__m256, 8, simde_mm256_loadu_ps, simde_mm256_storeu_ps, -1.0f, 1.0f)
MXFP4X_EMU_FMA_VEC(mm256_fnmsub_ps, simde__m256, 8, simde_mm256_loadu_ps, simde_mm256_storeu_ps, -1.0f, -1.0f)
MXFP4X_EMU_FMA_VEC(mm_fmadd_ps, simde__m128, 4, simde_mm_loadu_ps, simde_mm_storeu_ps, 1.0f, 1.0f)
MXFP4X_EMU_FMA_VEC(mm_fmsub_ps, simde__m128, 4, simde_mm_loadu_ps, simde_mm_storeu_ps, 1.0f, -1.0f)
MXFP4X_EMU_FMA_VEC(mm_fnmadd_ps, simde__m128, 4, simde_mm_loadu_ps, simde_mm_storeu_ps, -1.0f, 1.0f)
MXFP4X_EMU_FMA_VEC(mm_fnmsub_ps, simde__m128, 4, simde_mm_loadu_ps, simde_mm_storeu_ps, -1.0f, -1.0f)
MXFP4X_EMU_FMA_SS(mm_fmadd_ss, 1.0f, 1.0f)
MXFP4X_EMU_FMA_SS(mm_fmsub_ss, 1.0f, -1.0f)
MXFP4X_EMU_FMA_SS(mm_fnmadd_ss, -1.0f, 1.0f)
MXFP4X_EMU_FMA_SS(mm_fnmsub_ss, -1.0f, -1.0f)

#undef _mm512_fmadd_ps
#undef _mm512_fmsub_ps
#undef _mm512_fnmadd_ps
#undef _mm512_fnmsub_ps
#undef _mm256_fmadd_ps
#undef _mm256_fmsub_ps
#undef _mm256_fnmadd_ps
#undef _mm256_fnmsub_ps
#undef _mm_fmadd_ps
#undef _mm_fmsub_ps
#undef _mm_fnmadd_ps
#undef _mm_fnmsub_ps
#undef _mm_fmadd_ss
#undef _mm_fmsub_ss
#undef _mm_fnmadd_ss
#undef _mm_fnmsub_ss
#define _mm512_fmadd_ps(a, b, c) mxfp4x_emu_mm512_fmadd_ps(a, b, c)
#define _mm512_fmsub_ps(a, b, c) mxfp4x_emu_mm512_fmsub_ps(a, b, c)
#define _mm512_fnmadd_ps(a, b, c) mxfp4x_emu_mm512_fnmadd_ps(a, b, c)
#define _mm512_fnmsub_ps(a, b, c) mxfp4x_emu_mm512_fnmsub_ps(a, b, c)
#define _mm256_fmadd_ps(a, b, c) mxfp4x_emu_mm256_fmadd_ps(a, b, c)
#define _mm256_fmsub_ps(a, b, c) mxfp4x_emu_mm256_fmsub_ps(a, b, c)
#define _mm256_fnmadd_ps(a, b, c) mxfp4x_emu_mm256_fnmadd_ps(a, b, c)
#define _mm256_fnmsub_ps(a, b, c) mxfp4x_emu_mm256_fnmsub_ps(a, b, c)
#define _mm_fmadd_ps(a, b, c) mxfp4x_emu_mm_fmadd_ps(a, b, c)
#define _mm_fmsub_ps(a, b, c) mxfp4x_emu_mm_fmsub_ps(a, b, c)
#define _mm_fnmadd_ps(a, b, c) mxfp4x_emu_mm_fnmadd_ps(a, b, c)
#define _mm_fnmsub_ps(a, b, c) mxfp4x_emu_mm_fnmsub_ps(a, b, c)
#define _mm_fmadd_ss(a, b, c) mxfp4x_emu_mm_fmadd_ss(a, b, c)
#define _mm_fmsub_ss(a, b, c) mxfp4x_emu_mm_fmsub_ss(a, b, c)
#define _mm_fnmadd_ss(a, b, c) mxfp4x_emu_mm_fnmadd_ss(a, b, c)
#define _mm_fnmsub_ss(a, b, c) mxfp4x_emu_mm_fnmsub_ss(a, b, c)

#undef MXFP4X_EMU_FMA_VEC
#undef MXFP4X_EMU_FMA_SS

#endif /* MXFP4X_EMULATE_AVX512_H */
