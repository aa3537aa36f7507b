/* mxfp4x/dispatch.h -- the kernel table, in order of preference: a call that names no ISA
 * runs the first entry this CPU may run by default (cpu.h's mxfp4x_isa_default_mask: the
 * entries with bf16 units come first and are the default only where that rule says).  The driver
 * (mxfp4x/_core/cpu.pyx) owns the table: it picks one entry per call, outside its parallel
 * region, and calls through its pointers; the probes (mxfp4x/_core/probes.pyx) take their
 * entries from the driver (kernels_of in _core/cpu.pxd), so they run the driver's own kernels. */
#ifndef MXFP4X_DISPATCH_H
#define MXFP4X_DISPATCH_H

#include "mxfp4x.h"
#include "cpu.h"
#include "scalar.h"
#include "avx2.h"
#include "avx512.h"
#include "neon.h"
#include "amx.h"
#include "avx512bf16.h"

/* avx512's float32 kernels and their constants, shared by the avx512 and amx entries (all
 * but tile_rows: amx's tiles of rows are whole blocks of 4 x 16). */
#define MXFP4X_AVX512_FLOAT32_KERNELS                                                      \
    .layout_half = MXFP4X_LAYOUT_16, .panel_row_block = MXFP4X_AVX512_MR,                  \
    .gemv_max_tokens = MXFP4X_AVX512_GEMV_MAX_TOKENS,                                      \
    .panel_bytes = MXFP4X_AVX512_PANEL_BYTES, .gemv_f32 = mxfp4x_gemv_f32_avx512,          \
    .decode_f32 = mxfp4x_decode_f32_avx512, .panel_dot_f32 = mxfp4x_panel_dot_f32_avx512,  \
    .panel_scratch_floats = mxfp4x_panel_scratch_f32_avx512,                               \
    .axpy_rows_f32 = mxfp4x_axpy_rows_f32_avx512, .fma_loop = mxfp4x_fma_loop_avx512,      \
    .decode_f64 = mxfp4x_decode_f64_avx512, .panel_dot_f64 = mxfp4x_panel_dot_f64_avx512,  \
    .axpy_rows_f64 = mxfp4x_axpy_rows_f64_avx512,                                          \
    .dense_bf16 = mxfp4x_dense_bf16_avx512, .dense_bf16x = mxfp4x_dense_bf16x_avx512

/* Fields by name (mxfp4x.h says what each means): a reordered struct cannot shift a value
 * into the wrong field. */
static const mxfp4x_kernels mxfp4x_kernel_table[] = {
#if MXFP4X_HAVE_X86_SIMD
#if MXFP4X_HAVE_AMX
    /* avx512's kernels; bf16 latents of float32 calls on AMX tiles (amx.h).  Never the
     * default (cpu.h), so chosen only by MXFP4X_ISA=amx or isa="amx": faster than avx512
     * from 8 tokens per expert up, slower at 1-4 (docs/platforms.md). */
    {.isa = MXFP4X_ISA_AMX,
     .name = MXFP4X_ISA_NAME_AMX,
     MXFP4X_AVX512_FLOAT32_KERNELS,
     .tile_rows = MXFP4X_AMX_TILE_ROWS,
     .bf16_gather = mxfp4x_amx_gather,
     .bf16_rows = mxfp4x_amx_bf16_rows,
     .bf16_scratch_bytes = mxfp4x_amx_scratch_bytes,
     .bf16_gemv_max_tokens = mxfp4x_amx_gemv_max_tokens,
     .bf16_dot_loop = mxfp4x_amx_loop},
#endif
#if MXFP4X_HAVE_AVX512BF16
    /* avx512's kernels; bf16 latents of float32 calls on vdpbf16ps (avx512bf16.h).  The
     * default on AMD CPUs only (cpu.h): Zen 4 runs vdpbf16ps at the FMA's instruction rate
     * (twice its multiply-adds), an Intel Xeon at half that (its multiply-adds only). */
    {.isa = MXFP4X_ISA_AVX512BF16,
     .name = MXFP4X_ISA_NAME_AVX512BF16,
     MXFP4X_AVX512_FLOAT32_KERNELS,
     .tile_rows = MXFP4X_BF16DP_TILE_ROWS,
     .bf16_gather = mxfp4x_bf16dp_gather,
     .bf16_rows = mxfp4x_bf16dp_rows,
     .bf16_scratch_bytes = mxfp4x_bf16dp_scratch_bytes,
     .bf16_gemv_max_tokens = mxfp4x_bf16dp_gemv_max_tokens,
     .bf16_dot_loop = mxfp4x_bf16dp_loop,
     .dense_bf16_unit = mxfp4x_dense_bf16_unit},
#endif
    {.isa = MXFP4X_ISA_AVX512,
     .name = MXFP4X_ISA_NAME_AVX512,
     MXFP4X_AVX512_FLOAT32_KERNELS,
     .tile_rows = MXFP4X_AVX512_TILE_ROWS},
    {.isa = MXFP4X_ISA_AVX2,
     .name = MXFP4X_ISA_NAME_AVX2,
     .layout_half = MXFP4X_LAYOUT_4,
     .panel_row_block = MXFP4X_AVX2_MR,
     .gemv_max_tokens = MXFP4X_AVX2_GEMV_MAX_TOKENS,
     .tile_rows = MXFP4X_AVX2_TILE_ROWS,
     .panel_bytes = MXFP4X_AVX2_PANEL_BYTES,
     .gemv_f32 = mxfp4x_gemv_f32_avx2,
     .decode_f32 = mxfp4x_decode_f32_avx2,
     .panel_dot_f32 = mxfp4x_panel_dot_f32_avx2,
     .panel_scratch_floats = mxfp4x_panel_scratch_f32_avx2,
     .axpy_rows_f32 = mxfp4x_axpy_rows_f32_avx2,
     .decode_f64 = mxfp4x_decode_f64_avx2,
     .panel_dot_f64 = mxfp4x_panel_dot_f64_avx2,
     .axpy_rows_f64 = mxfp4x_axpy_rows_f64_avx2,
     .fma_loop = mxfp4x_fma_loop_avx2,
     .dense_bf16 = mxfp4x_dense_bf16_avx2},
#endif
#if MXFP4X_HAVE_NEON
    {.isa = MXFP4X_ISA_NEON,
     .name = MXFP4X_ISA_NAME_NEON,
     .layout_half = MXFP4X_LAYOUT_16,
     .panel_row_block = MXFP4X_NEON_MR,
     .gemv_max_tokens = MXFP4X_NEON_GEMV_MAX_TOKENS,
     .tile_rows = MXFP4X_NEON_TILE_ROWS,
     .panel_bytes = MXFP4X_NEON_PANEL_BYTES,
     .gemv_f32 = mxfp4x_gemv_f32_neon,
     .decode_f32 = mxfp4x_decode_f32_neon,
     .panel_dot_f32 = mxfp4x_panel_dot_f32_neon,
     .panel_scratch_floats = mxfp4x_panel_scratch_f32_neon,
     .axpy_rows_f32 = mxfp4x_axpy_rows_f32_neon,
     .decode_f64 = mxfp4x_decode_f64,
     .panel_dot_f64 = mxfp4x_panel_dot_f64,
     .axpy_rows_f64 = mxfp4x_axpy_rows_f64,
     .fma_loop = mxfp4x_fma_loop_neon,
     .dense_bf16 = mxfp4x_dense_bf16_neon},
#endif
    {.isa = MXFP4X_ISA_SCALAR,
     .name = MXFP4X_ISA_NAME_SCALAR,
     .layout_half = MXFP4X_LAYOUT_16,
     .panel_row_block = MXFP4X_SCALAR_MR,
     .gemv_max_tokens = MXFP4X_SCALAR_GEMV_MAX_TOKENS,
     .tile_rows = MXFP4X_SCALAR_TILE_ROWS,
     .panel_bytes = MXFP4X_SCALAR_PANEL_BYTES,
     .gemv_f32 = mxfp4x_gemv_f32_scalar,
     .decode_f32 = mxfp4x_decode_f32_scalar,
     .panel_dot_f32 = mxfp4x_panel_dot_f32_scalar,
     .panel_scratch_floats = mxfp4x_panel_scratch_f32_scalar,
     .axpy_rows_f32 = mxfp4x_axpy_rows_f32_scalar,
     .decode_f64 = mxfp4x_decode_f64,
     .panel_dot_f64 = mxfp4x_panel_dot_f64,
     .axpy_rows_f64 = mxfp4x_axpy_rows_f64,
     .fma_loop = mxfp4x_fma_loop_scalar,
     .dense_bf16 = mxfp4x_dense_bf16_scalar},
};

#define MXFP4X_N_KERNELS ((int)(sizeof(mxfp4x_kernel_table) / sizeof(mxfp4x_kernel_table[0])))

static int mxfp4x_n_kernels(void) { return MXFP4X_N_KERNELS; }

static const mxfp4x_kernels *mxfp4x_kernel_at(int i) {
    return (i >= 0 && i < MXFP4X_N_KERNELS) ? &mxfp4x_kernel_table[i] : NULL;
}

/* On an AMD Zen 5 (family 1Ah) and Zen 4 (family 19h; its Zen 3 siblings have no AVX-512)
 * the AVX-512 float32 gemv (4 tokens per decode in registers) runs faster than decode +
 * panel_dot (a Zen 4: or level) at every batch measured, so there it takes up to 256
 * tokens per expert (more than a long prefill's chunk gives an expert; the panel stays
 * reachable, and tested, above): docs/performance.md, "Few tokens and the path switches".
 * Elsewhere the entry's own gemv_max_tokens (measured on a Xeon for AVX-512). */
#ifndef MXFP4X_AVX512_GEMV_MAX_TOKENS_ZEN
#define MXFP4X_AVX512_GEMV_MAX_TOKENS_ZEN 256
#endif

/* The float32 gemv/panel switch of entry k on this CPU: gemv up to this many tokens per
 * expert (the driver and the tests read it here). */
static int mxfp4x_gemv_switch(const mxfp4x_kernels *k) {
#if MXFP4X_HAVE_X86_SIMD
    if (k->gemv_f32 == mxfp4x_gemv_f32_avx512 && mxfp4x_cpu_amd_zen4_or_5())
        return MXFP4X_AVX512_GEMV_MAX_TOKENS_ZEN;
#endif
    return k->gemv_max_tokens;
}

/* Whether this CPU (and OS) can run the table entry i. */
static int mxfp4x_kernel_runnable(int i) {
    const mxfp4x_kernels *k = mxfp4x_kernel_at(i);
    return k != NULL && ((mxfp4x_cpu_isas() >> k->isa) & 1);
}

/* The entry that runs when a call names no ISA: the first one the default rule allows
 * among ISAs `mask` (mxfp4x_isa_default_mask); -1 if none (never with a scalar entry). */
static int mxfp4x_kernel_default_in(int mask) {
    int i;
    for (i = 0; i < MXFP4X_N_KERNELS; i++)
        if ((mask >> mxfp4x_kernel_table[i].isa) & 1) return i;
    return -1;
}

static int mxfp4x_kernel_default(void) { return mxfp4x_kernel_default_in(mxfp4x_cpu_default_isas()); }

#include "threads.h" /* how the driver's tasks run: OpenMP, POSIX threads started per call, or serial */

#endif /* MXFP4X_DISPATCH_H */
