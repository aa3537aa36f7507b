/* mxfp4x/config.h -- compiler and architecture detection, target-region macros.
 *
 * The shipped build uses no global -m<isa> / -march flags.  Every SIMD function
 * carries its own target attribute (MXFP4X_TARGET_*), so the same object file
 * runs on any CPU of the architecture and only the variant chosen at run time
 * (see cpu.h, dispatch.h) ever executes ISA-specific instructions.
 */
#ifndef MXFP4X_CONFIG_H
#define MXFP4X_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64) || defined(_M_AMD64)
#  define MXFP4X_ARCH_X86_64 1
#else
#  define MXFP4X_ARCH_X86_64 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#  define MXFP4X_GNUC 1
#else
#  define MXFP4X_GNUC 0
#endif

/* SIMD variants are compiled where the compiler can emit them inside a target
 * region: GCC >= 5 / clang with target attributes, or MSVC (which accepts AVX
 * intrinsics anywhere without /arch flags). */
#if MXFP4X_ARCH_X86_64 && (MXFP4X_GNUC || defined(_MSC_VER)) && !defined(MXFP4X_NO_SIMD)
#  define MXFP4X_HAVE_X86_SIMD 1
#else
#  define MXFP4X_HAVE_X86_SIMD 0
#endif

/* AMX (amx.h): Linux on x86-64 (the kernel grants the tile state per process,
 * arch_prctl ARCH_REQ_XCOMP_PERM), GCC >= 11 or clang >= 12 (the AMX intrinsics inside a
 * target region); never in the SIMDe emulation build.  MXFP4X_EMULATE_AMX (test builds:
 * the C checker, CI's AMX emulation lane; emulate_amx.h): the tile instructions in C, on
 * any GCC or clang. */
#if MXFP4X_HAVE_X86_SIMD && MXFP4X_GNUC && defined(__linux__) && \
    !defined(MXFP4X_EMULATE_AVX512) && !defined(MXFP4X_NO_AMX) && \
    ((defined(__clang__) && __clang_major__ >= 12) || \
     (!defined(__clang__) && __GNUC__ >= 11))
#  define MXFP4X_HAVE_AMX 1
#elif MXFP4X_HAVE_X86_SIMD && MXFP4X_GNUC && defined(MXFP4X_EMULATE_AMX) && \
    !defined(MXFP4X_EMULATE_AVX512) && !defined(MXFP4X_NO_AMX)
#  define MXFP4X_HAVE_AMX 1
#else
#  define MXFP4X_HAVE_AMX 0
#endif

/* AVX512-BF16 (avx512bf16.h): GCC >= 10 or clang >= 9 (vdpbf16ps inside a target region);
 * never in the SIMDe emulation build. */
#if MXFP4X_HAVE_X86_SIMD && MXFP4X_GNUC && !defined(MXFP4X_EMULATE_AVX512) && \
    !defined(MXFP4X_NO_AVX512BF16) && \
    ((defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10))
#  define MXFP4X_HAVE_AVX512BF16 1
#else
#  define MXFP4X_HAVE_AVX512BF16 0
#endif

/* AArch64 Advanced SIMD (neon.h): part of the base architecture, so no target region
 * and no run-time check.  Little-endian only (the decode reinterprets byte lanes as
 * float lanes), GCC or clang (Apple clang included). */
#if (defined(__aarch64__) || defined(__arm64__)) && !defined(__AARCH64EB__) && MXFP4X_GNUC && \
    !defined(MXFP4X_NO_SIMD)
#  define MXFP4X_HAVE_NEON 1
#else
#  define MXFP4X_HAVE_NEON 0
#endif

#if MXFP4X_GNUC
#  define MXFP4X_ALWAYS_INLINE __attribute__((always_inline))
#  define MXFP4X_TARGET(spec) __attribute__((target(spec)))
#  define MXFP4X_RESTRICT __restrict__
#  define MXFP4X_INLINE static inline __attribute__((always_inline))
#  define MXFP4X_UNUSED __attribute__((unused))
#else
#  define MXFP4X_ALWAYS_INLINE
#  define MXFP4X_TARGET(spec)
#  define MXFP4X_RESTRICT __restrict
#  define MXFP4X_INLINE static __forceinline
#  define MXFP4X_UNUSED
#endif

#define MXFP4X_TARGET_AVX2 MXFP4X_TARGET("avx2,fma")
/* MXFP4X_EMULATE_AVX512 (a test build, setup.py): the AVX-512 kernels compiled
 * through SIMDe for the x86-64 baseline (emulate_avx512.h), so no target region. */
#ifdef MXFP4X_EMULATE_AVX512
#  define MXFP4X_TARGET_AVX512
#  define MXFP4X_EMULATED_AVX512 1
#else
#  define MXFP4X_TARGET_AVX512 MXFP4X_TARGET("avx512f,avx2,fma")
#  define MXFP4X_EMULATED_AVX512 0
#endif

/* MXFP4X_EMULATE_AMX (a test build, setup.py or the C checker): the amx entry's tile
 * instructions in C (emulate_amx.h), its AVX-512 code native. */
#if defined(MXFP4X_EMULATE_AMX) && MXFP4X_HAVE_AMX
#  define MXFP4X_EMULATED_AMX 1
#else
#  define MXFP4X_EMULATED_AMX 0
#endif

/* 64-byte alignment of a static table (one cache line, one zmm load): before the
 * declaration, where both GCC/Clang attributes and MSVC's __declspec may stand. */
#if MXFP4X_GNUC
#  define MXFP4X_ALIGN64 __attribute__((aligned(64)))
#elif defined(_MSC_VER)
#  define MXFP4X_ALIGN64 __declspec(align(64))
#else
#  define MXFP4X_ALIGN64
#endif

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#  define MXFP4X_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#else
#  define MXFP4X_CAT_(a, b) a##b
#  define MXFP4X_CAT(a, b) MXFP4X_CAT_(a, b)
#  define MXFP4X_STATIC_ASSERT(cond, msg) \
       typedef char MXFP4X_CAT(mxfp4x_static_assert_, __LINE__)[(cond) ? 1 : -1]
#endif

/* Prefetch one cache line (a hint: never faults, so a line past a row's end is
 * harmless). */
#if MXFP4X_ARCH_X86_64
#include <xmmintrin.h>
#define MXFP4X_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define MXFP4X_PREFETCH(p) ((void)(p))
#endif
/* The same into L2 only (T1): the gemv kernels' next row block (prefetch.h). */
#if MXFP4X_ARCH_X86_64
#define MXFP4X_PREFETCH_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#else
#define MXFP4X_PREFETCH_L2(p) ((void)(p))
#endif
/* The dense bf16 kernels' prefetch distance along each row: the best of those measured
 * on a Xeon at one token (docs/performance.md, "The dense bf16 kernel"). */
#ifndef MXFP4X_DENSE_PREFETCH
#define MXFP4X_DENSE_PREFETCH 1024
#endif
/* ... and where cpu.h's mxfp4x_dense_stream says ROW_FAR, with the non-temporal hint this far
 * ahead (one row streamed at a time, avx512.h): on an AMD Zen 5 8 KiB reads faster than
 * 4 (docs/performance.md, "The dense bf16 kernel"). */
#ifndef MXFP4X_DENSE_PREFETCH_FAR
#define MXFP4X_DENSE_PREFETCH_FAR 8192
#endif
/* ... and on an AMD Zen 4 (cpu.h's mxfp4x_dense_pf_near) blocks of fewer than 8 rows (two to
 * four tokens) this far ahead, the same 8 KiB in flight as 8 rows at 1 KiB: the best of
 * the distances measured there (docs/performance.md, "The dense bf16 kernel"). */
#ifndef MXFP4X_DENSE_PREFETCH_ZEN4
#define MXFP4X_DENSE_PREFETCH_ZEN4 2048
#endif

/* Where a row's line that far ahead (any distance above) would pass the row's end, the
 * prefetch goes as far into the same row of the next block (mr rows on): this many bytes
 * further.  Past the end it would fall in the next row of the same block, already being
 * read, so every block would begin on rows nobody had fetched (docs/performance.md, "The
 * dense bf16 kernel").  Prefetches never fault: the last block's go past its rows
 * harmlessly. */
#define MXFP4X_DENSE_WRAP(mr, rs, d_in) ((((int64_t)(mr)) * (rs) - (d_in)) * 2)
/* The bytes from element `at` of a row to the line prefetched for it: pfd, or pfd + wrap
 * where at + pfd bytes would pass the row's d_in elements. */
#define MXFP4X_DENSE_AHEAD(at, pfd, d_in, wrap) \
    ((pfd) + (2 * (int64_t)(at) + (pfd) >= 2 * (int64_t)(d_in) ? (wrap) : 0))

/* Floating-point environment of a kernel thread: flush-to-zero off (a process may
 * have turned it on, e.g. torch.set_flush_denormal(True); it would flush the 2^-127
 * scale and subnormal latents) and rounding to nearest even (a thread may have set
 * another mode with fesetround; the pool's threads would then round differently from
 * the caller's, and the bits would depend on the thread count), restored on exit.
 *   x86-64:  MXCSR.FTZ (bit 15), MXCSR.DAZ (bit 6) and MXCSR.RC (bits 13-14);
 *   AArch64: FPCR.FZ (bit 24; Arm ARM, FPCR) and FPCR.FIZ (bit 0, FEAT_AFP: flushes
 *            inputs even with FZ = 0; RES0 where FEAT_AFP is absent, so clearing it is
 *            always allowed) -- FZ16 (bit 19) only affects half-precision arithmetic,
 *            which the kernels never do -- and FPCR.RMode (bits 22-23). */
#define MXFP4X_MXCSR_FTZ 0x8000u
#define MXFP4X_MXCSR_DAZ 0x0040u
#define MXFP4X_MXCSR_RC 0x6000u
#define MXFP4X_FPCR_CLEAR ((1ull << 24) | 1ull | (3ull << 22))
#if MXFP4X_ARCH_X86_64
typedef unsigned int mxfp4x_fpenv;
static mxfp4x_fpenv mxfp4x_fpenv_enter(void) {
    const unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved & ~(MXFP4X_MXCSR_FTZ | MXFP4X_MXCSR_DAZ | MXFP4X_MXCSR_RC));
    return saved;
}
static void mxfp4x_fpenv_exit(mxfp4x_fpenv saved) { _mm_setcsr(saved); }
#elif (defined(__aarch64__) || defined(_M_ARM64)) && MXFP4X_GNUC
typedef unsigned long long mxfp4x_fpenv;
static mxfp4x_fpenv mxfp4x_fpenv_enter(void) {
    unsigned long long saved;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved) : : "memory");
    if (saved & MXFP4X_FPCR_CLEAR) {
        const unsigned long long cleared = saved & ~MXFP4X_FPCR_CLEAR;
        __asm__ __volatile__("msr fpcr, %0" : : "r"(cleared) : "memory");
    }
    return saved;
}
static void mxfp4x_fpenv_exit(mxfp4x_fpenv saved) {
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved) : "memory");
}
#elif defined(_M_ARM64)
#include <intrin.h>
typedef unsigned long long mxfp4x_fpenv;
static mxfp4x_fpenv mxfp4x_fpenv_enter(void) {
    const unsigned long long saved = (unsigned long long)_ReadStatusReg(ARM64_FPCR);
    _WriteStatusReg(ARM64_FPCR, (__int64)(saved & ~MXFP4X_FPCR_CLEAR));
    return saved;
}
static void mxfp4x_fpenv_exit(mxfp4x_fpenv saved) { _WriteStatusReg(ARM64_FPCR, (__int64)saved); }
#else
/* Other architectures: no flush-to-zero control known to the build; the FTZ test
 * (tests/determinism/test_reliability.py) reports it if torch.set_flush_denormal works here. */
typedef unsigned int mxfp4x_fpenv;
static mxfp4x_fpenv mxfp4x_fpenv_enter(void) { return 0; }
static void mxfp4x_fpenv_exit(mxfp4x_fpenv saved) { (void)saved; }
#endif

/* Build facts the tests check against the shipping rules (no fast-math, no global
 * ISA flags), read from the compiler's own predefined macros. */
#if defined(__FAST_MATH__) || defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#  define MXFP4X_BUILT_FAST_MATH 1
#else
#  define MXFP4X_BUILT_FAST_MATH 0
#endif
#if defined(__AVX__) || defined(__AVX2__) || defined(__AVX512F__) || defined(__FMA__)
#  define MXFP4X_BUILT_GLOBAL_ISA 1 /* -mavx*, -march=haswell/native...: not shippable */
#else
#  define MXFP4X_BUILT_GLOBAL_ISA 0
#endif
#ifndef MXFP4X_BUILD_CFLAGS
#  define MXFP4X_BUILD_CFLAGS "unknown"
#endif

#endif /* MXFP4X_CONFIG_H */
