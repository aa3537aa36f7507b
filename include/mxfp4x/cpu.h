/* mxfp4x/cpu.h -- run-time CPU detection: CPUID *and* the OS check (XGETBV),
 * computed once and cached.  A CPU that reports AVX-512 under an OS that does
 * not save the ZMM registers must not run AVX-512 code. */
#ifndef MXFP4X_CPU_H
#define MXFP4X_CPU_H

#include "mxfp4x.h"

/* What detection reads; the decision below is a pure function of it (unit-tested
 * through mxfp4x._core.probes.isa_decision, including the macOS case no CI runs). */
typedef struct {
    int osxsave, avx, fma, avx2, avx512f;
    uint64_t xcr0;
    int darwin_avx512; /* macOS: sysctl hw.optional.avx512f (1/0); -1 elsewhere */
    int avx512bw, amx_tile, amx_bf16; /* CPUID.(7,0): EBX bit 30, EDX bits 24 and 22 */
    int amx_granted; /* Linux granted this process the tile data state (arch_prctl) */
    int avx512_bf16; /* CPUID.(7,1): EAX bit 5 */
} mxfp4x_cpu_facts;

/* Bit mask of the ISAs (1 << MXFP4X_ISA_*) a CPU and OS with these facts can run.
 * XCR0 bits 1, 2: SSE and AVX (YMM upper halves) state enabled by the OS; bits 5..7:
 * opmask, ZMM_Hi256, Hi16_ZMM state.  macOS enables the AVX-512 state lazily, on a
 * thread's first AVX-512 instruction, so XCR0 shows it off until then: there the
 * kernel's own sysctl answer is the OS check instead. */
static int mxfp4x_isa_decision(const mxfp4x_cpu_facts *f) {
    int mask = 1 << MXFP4X_ISA_SCALAR;
    int zmm_state;
    if (f->osxsave && f->avx && f->fma && f->avx2 && (f->xcr0 & 0x6) == 0x6)
        mask |= 1 << MXFP4X_ISA_AVX2;
    zmm_state = f->darwin_avx512 >= 0 ? f->darwin_avx512 == 1 : (f->xcr0 & 0xE6) == 0xE6;
    if ((mask & (1 << MXFP4X_ISA_AVX2)) && f->avx512f && zmm_state)
        mask |= 1 << MXFP4X_ISA_AVX512;
    /* AMX: AVX-512 (with BW, for the decode) and the tile state: XCR0 bits 17, 18
     * (XTILECFG, XTILEDATA) enabled by the OS and granted to this process */
    if ((mask & (1 << MXFP4X_ISA_AVX512)) && f->avx512bw && f->amx_tile && f->amx_bf16 &&
        f->amx_granted && (f->xcr0 & 0x60000) == 0x60000)
        mask |= 1 << MXFP4X_ISA_AMX;
    /* AVX512-BF16: AVX-512 with BW (the decode's word permutes) and vdpbf16ps; no state
     * beyond the ZMM registers' */
    if ((mask & (1 << MXFP4X_ISA_AVX512)) && f->avx512bw && f->avx512_bf16)
        mask |= 1 << MXFP4X_ISA_AVX512BF16;
    return mask;
}

/* Bit mask of the runnable ISAs (a mask from mxfp4x_isa_decision) that a call may run when
 * it names none: the default is the first of them in the kernel table (dispatch.h).  A
 * rule on CPUID facts, never a timing, so a host's default (and its bits) is known
 * before it runs:
 *   amx         never: slower than avx512 at 1-4 tokens per expert (docs/platforms.md);
 *   avx512bf16  on AMD only (CPUID.0 vendor "AuthenticAMD": Zen 4 and later): there
 *               vdpbf16ps issues at the FMA's instruction rate, twice its multiply-adds;
 *               Intel issues it at half that, slower than avx512's float32 FMAs. */
static int mxfp4x_isa_default_mask(int vendor_amd, int runnable) {
    int mask = runnable & ~(1 << MXFP4X_ISA_AMX);
    if (!vendor_amd) mask &= ~(1 << MXFP4X_ISA_AVX512BF16);
    return mask;
}

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

#if defined(__APPLE__)
#include <sys/sysctl.h>
static int mxfp4x_darwin_avx512(void) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname("hw.optional.avx512f", &v, &n, NULL, 0) == 0 && v ? 1 : 0;
}
#else
static int mxfp4x_darwin_avx512(void) { return -1; }
#endif

#if MXFP4X_HAVE_AMX
/* Ask Linux for the AMX tile data state: arch_prctl (x86-64 system call 158) with
 * ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18, once per process, for every
 * thread; 1 when granted.  The system call itself, so no libc feature macro decides
 * whether syscall() is declared. */
static int mxfp4x_amx_request(void) {
    long ret;
    __asm__ __volatile__("syscall"
                         : "=a"(ret)
                         : "a"(158L), "D"(0x1023L), "S"(18L)
                         : "rcx", "r11", "memory");
    return ret == 0;
}
#else
static int mxfp4x_amx_request(void) { return 0; }
#endif

static int mxfp4x_detect_isas(void) {
    uint32_t r[4];
    mxfp4x_cpu_facts f = {0, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0, 0};
    mxfp4x_cpuid(0, 0, r);
    if (r[0] >= 1) {
        const uint32_t max_leaf = r[0];
        mxfp4x_cpuid(1, 0, r);
        f.osxsave = (r[2] >> 27) & 1;
        f.avx = (r[2] >> 28) & 1;
        f.fma = (r[2] >> 12) & 1;
        if (max_leaf >= 7) {
            mxfp4x_cpuid(7, 0, r);
            f.avx2 = (r[1] >> 5) & 1;
            f.avx512f = (r[1] >> 16) & 1;
            f.avx512bw = (r[1] >> 30) & 1;
            f.amx_tile = (r[3] >> 24) & 1;
            f.amx_bf16 = (r[3] >> 22) & 1;
            if (f.amx_tile && f.amx_bf16) f.amx_granted = mxfp4x_amx_request();
            if (r[0] >= 1) { /* sub-leaf 1 exists */
                mxfp4x_cpuid(7, 1, r);
                f.avx512_bf16 = (r[0] >> 5) & 1;
            }
        }
        if (f.osxsave) f.xcr0 = mxfp4x_xgetbv0();
#ifdef MXFP4X_EMULATE_AMX /* (a test build) tiles in C: the tile facts and state as the CPU's */
        f.amx_tile = f.amx_bf16 = f.amx_granted = 1;
        f.xcr0 |= 0x60000;
#endif
        f.darwin_avx512 = mxfp4x_darwin_avx512();
    }
    return mxfp4x_isa_decision(&f);
}

/* CPUID.0's vendor string (EBX, EDX, ECX) is "AuthenticAMD". */
static int mxfp4x_detect_vendor_amd(void) {
    uint32_t r[4];
    mxfp4x_cpuid(0, 0, r);
    return r[1] == 0x68747541u && r[3] == 0x69746e65u && r[2] == 0x444d4163u;
}

/* An AMD CPU's family (CPUID.1 EAX: base family, plus the extended family when the base
 * is 0Fh: 19h Zen 3 / Zen 4, 1Ah Zen 5), 0 on any other CPU. */
static int mxfp4x_detect_amd_family(void) {
    uint32_t r[4];
    int family;
    if (!mxfp4x_detect_vendor_amd()) return 0;
    mxfp4x_cpuid(1, 0, r);
    family = (int)((r[0] >> 8) & 0xF);
    return family == 0xF ? family + (int)((r[0] >> 20) & 0xFF) : family;
}
#elif MXFP4X_HAVE_NEON
/* AArch64: Advanced SIMD is in the base architecture (and its registers are always
 * saved by the OS), so every aarch64 CPU runs the NEON kernels. */
static int mxfp4x_detect_isas(void) { return (1 << MXFP4X_ISA_SCALAR) | (1 << MXFP4X_ISA_NEON); }
static int mxfp4x_detect_vendor_amd(void) { return 0; }
static int mxfp4x_detect_amd_family(void) { return 0; }
#else
static int mxfp4x_detect_isas(void) { return 1 << MXFP4X_ISA_SCALAR; }
static int mxfp4x_detect_vendor_amd(void) { return 0; }
static int mxfp4x_detect_amd_family(void) { return 0; }
#endif

/* Optional CPU features no kernel uses yet (reported by backend_info()["cpu_features"]
 * for future variants): bit i of mxfp4x_cpu_features() is mxfp4x_feature_names[i].
 * AArch64 only: Linux asks the kernel's HWCAP words (getauxval; bit values from the
 * uapi header arch/arm64/include/uapi/asm/hwcap.h), macOS its sysctl
 * hw.optional.arm.FEAT_* (no SVE on Apple cores).  Elsewhere: none. */
#define MXFP4X_N_FEATURES 4
static const char *const mxfp4x_feature_names[MXFP4X_N_FEATURES] = {"asimddp", "bf16", "i8mm",
                                                                    "sve"};
#if MXFP4X_HAVE_NEON && defined(__linux__)
#include <sys/auxv.h>
#ifndef AT_HWCAP2
#define AT_HWCAP2 26
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1UL << 22)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1UL << 13)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1UL << 14)
#endif
static int mxfp4x_detect_features(void) {
    const unsigned long h1 = getauxval(AT_HWCAP), h2 = getauxval(AT_HWCAP2);
    return ((h1 & HWCAP_ASIMDDP) ? 1 : 0) | ((h2 & HWCAP2_BF16) ? 2 : 0) |
           ((h2 & HWCAP2_I8MM) ? 4 : 0) | ((h1 & HWCAP_SVE) ? 8 : 0);
}
#elif MXFP4X_HAVE_NEON && defined(__APPLE__)
#include <sys/sysctl.h>
static int mxfp4x_sysctl_flag(const char *name) {
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname(name, &v, &n, NULL, 0) == 0 && v ? 1 : 0;
}
static int mxfp4x_detect_features(void) {
    return mxfp4x_sysctl_flag("hw.optional.arm.FEAT_DotProd") |
           (mxfp4x_sysctl_flag("hw.optional.arm.FEAT_BF16") << 1) |
           (mxfp4x_sysctl_flag("hw.optional.arm.FEAT_I8MM") << 2);
}
#else
static int mxfp4x_detect_features(void) { return 0; }
#endif

static int mxfp4x_cpu_features(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v < 0) {
        v = mxfp4x_detect_features();
        cached = v;
    }
    return v;
}

static const char *mxfp4x_feature_name(int i) {
    return (i >= 0 && i < MXFP4X_N_FEATURES) ? mxfp4x_feature_names[i] : NULL;
}

/* Cached; the race on first use is benign (every thread computes the same value). */
static int mxfp4x_cpu_isas(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v < 0) {
        v = mxfp4x_detect_isas();
#if MXFP4X_HAVE_X86_SIMD && MXFP4X_EMULATED_AVX512
        v |= 1 << MXFP4X_ISA_AVX512; /* SIMDe-emulated: x86-64 baseline code, runs anywhere */
#endif
        cached = v;
    }
    return v;
}

/* mxfp4x_detect_amd_family, cached like mxfp4x_cpu_isas: kernels whose best switch
 * points differ by core (avx512bf16.h) ask it. */
static int mxfp4x_cpu_amd_family(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v < 0) {
        v = mxfp4x_detect_amd_family();
        cached = v;
    }
    return v;
}

/* An AMD Zen 4 (family 19h: its Zen 3 siblings have no AVX-512, so only Zen 4 reaches the
 * kernels that ask) or Zen 5 (1Ah): the cores where the gemv/panel switches of
 * avx512bf16.h and dispatch.h were measured to sit higher than the Xeon's. */
static inline int mxfp4x_cpu_amd_zen4_or_5(void) {
    const int family = mxfp4x_cpu_amd_family();
    return family == 0x19 || family == 0x1A;
}

/* Whether the AVX-512 gemv kernels prefetch the row block after next (prefetch.h) into L1:
 * on an AMD Zen 5 (family 1Ah), where that is faster; elsewhere into L2, the faster target
 * on a Zen 4 (Intel is unmeasured).  docs/performance.md, "Prefetch".  The kernels that
 * prefetch so are compiled twice, the hint a constant in each: a run-time test per line
 * made GCC duplicate the loops and spill their pointers, and gave the gain back.
 * -DMXFP4X_PF_L1=0 or 1 forces it (benchmarks/kernel_bench.c). */
static inline int mxfp4x_pf_into_l1(void) {
#ifdef MXFP4X_PF_L1
    return MXFP4X_PF_L1;
#else
    return mxfp4x_cpu_amd_family() == 0x1A;
#endif
}

/* How the AVX-512 dense bf16 kernel (avx512.h) streams one bf16 token's rows: */
enum {
    MXFP4X_DENSE_BLOCKS = 0,    /* blocks of 8 rows, each row's line 1 KiB ahead into L2 */
    MXFP4X_DENSE_ROW_FAR = 1,   /* a row at a time, the non-temporal prefetch
                                 * MXFP4X_DENSE_PREFETCH_FAR bytes ahead (and two tokens) */
    MXFP4X_DENSE_ROW_PLAIN = 2  /* a row at a time, no software prefetch: the hardware's
                                 * prefetchers follow the one sequential stream */
};
/* ... on this CPU: ROW_FAR on an AMD Zen 5 (family 1Ah), ROW_PLAIN on a Zen 4 (19h), where
 * each reads at about one thread's read bandwidth from 2 MiB pages; BLOCKS on an Intel
 * Xeon, where one row at a time is slower (docs/performance.md, "The dense bf16 kernel").
 * -DMXFP4X_DENSE_STREAM=0, 1 or 2 forces it. */
static inline int mxfp4x_dense_stream(void) {
#ifdef MXFP4X_DENSE_STREAM
    return MXFP4X_DENSE_STREAM;
#else
    const int family = mxfp4x_cpu_amd_family();
    return family == 0x1A ? MXFP4X_DENSE_ROW_FAR
                          : family == 0x19 ? MXFP4X_DENSE_ROW_PLAIN : MXFP4X_DENSE_BLOCKS;
#endif
}

/* The T1 prefetch distance of the AVX-512 dense kernel's blocks under 8 rows (two to four
 * tokens, avx512.h): MXFP4X_DENSE_PREFETCH_ZEN4 (2 KiB) on an AMD Zen 4 (family 19h), where
 * it reads two to four tokens faster (config.h); elsewhere MXFP4X_DENSE_PREFETCH (1 KiB;
 * 8-row blocks take that everywhere).  A run-time value, not a compiled variant: a third
 * copy of the kernels (a constant distance) built with -fwrapv, as the extension is,
 * spilled in the four-token blocks (docs/performance.md, "The dense bf16 kernel").
 * -DMXFP4X_DENSE_NEAR=N forces N. */
static inline int64_t mxfp4x_dense_pf_near(void) {
#ifdef MXFP4X_DENSE_NEAR
    return MXFP4X_DENSE_NEAR;
#else
    return mxfp4x_cpu_amd_family() == 0x19 ? MXFP4X_DENSE_PREFETCH_ZEN4 : MXFP4X_DENSE_PREFETCH;
#endif
}

/* The ISAs a call may run by default on this CPU (mxfp4x_isa_default_mask); cached like
 * mxfp4x_cpu_isas. */
static int mxfp4x_cpu_default_isas(void) {
    static volatile int cached = -1;
    int v = cached;
    if (v < 0) {
        v = mxfp4x_isa_default_mask(mxfp4x_detect_vendor_amd(), mxfp4x_cpu_isas());
        cached = v;
    }
    return v;
}

#endif /* MXFP4X_CPU_H */
