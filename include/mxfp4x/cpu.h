/* mxfp4x/cpu.h -- run-time CPU detection: CPUID *and* the OS check (XGETBV),
 * computed once and cached.  A CPU that reports AVX-512 under an OS that does
 * not save the ZMM registers must not run AVX-512 code. */
#ifndef MXFP4X_CPU_H
#define MXFP4X_CPU_H

#include "mxfp4x.h"

#if MXFP4X_HAVE_X86_SIMD
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static void mxfp4x_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    int v[4];
    __cpuidex(v, (int)leaf, (int)sub);
    r[0] = (uint32_t)v[0]; r[1] = (uint32_t)v[1]; r[2] = (uint32_t)v[2]; r[3] = (uint32_t)v[3];
}
static uint64_t mxfp4x_xgetbv0(void) { return (uint64_t)_xgetbv(0); }
#else
#include <cpuid.h>
static void mxfp4x_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    r[0] = r[1] = r[2] = r[3] = 0;
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}
/* Raw opcode-free inline asm: no target attribute needed to execute it. */
static uint64_t mxfp4x_xgetbv0(void) {
    uint32_t eax, edx;
    __asm__ __volatile__("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}
#endif

/* Bit mask of the ISAs (1 << MXFP4X_ISA_*) this CPU and OS can run. */
static int mxfp4x_detect_isas(void) {
    uint32_t r[4];
    int mask = 1 << MXFP4X_ISA_SCALAR;
    uint32_t max_leaf;
    int osxsave, avx, fma, avx2 = 0, avx512f = 0;
    uint64_t xcr0 = 0;

    mxfp4x_cpuid(0, 0, r);
    max_leaf = r[0];
    if (max_leaf < 1) return mask;
    mxfp4x_cpuid(1, 0, r);
    osxsave = (r[2] >> 27) & 1;
    avx = (r[2] >> 28) & 1;
    fma = (r[2] >> 12) & 1;
    if (max_leaf >= 7) {
        mxfp4x_cpuid(7, 0, r);
        avx2 = (r[1] >> 5) & 1;
        avx512f = (r[1] >> 16) & 1;
    }
    if (osxsave) xcr0 = mxfp4x_xgetbv0();
    /* XCR0: bit 1 SSE, bit 2 AVX (YMM high halves) state. */
    if (osxsave && avx && fma && avx2 && (xcr0 & 0x6) == 0x6) mask |= 1 << MXFP4X_ISA_AVX2;
    /* plus bits 5..7: opmask, ZMM_Hi256, Hi16_ZMM state. */
    if ((mask & (1 << MXFP4X_ISA_AVX2)) && avx512f && (xcr0 & 0xE6) == 0xE6)
        mask |= 1 << MXFP4X_ISA_AVX512;
    return mask;
}
#else
static int mxfp4x_detect_isas(void) { return 1 << MXFP4X_ISA_SCALAR; }
#endif

/* Cached; the race on first use is benign (every thread computes the same value). */
static int mxfp4x_cpu_isas(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v < 0) {
        v = mxfp4x_detect_isas();
        cached = v;
    }
    return v;
}

#endif /* MXFP4X_CPU_H */
