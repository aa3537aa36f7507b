/* mxfp4x/format.h -- the format: group constants, the ISA enum and names, operand
 * dtypes, the nibble arrangements, the row descriptor and the kernel layouts.
 *
 * Format (OCP Microscaling Formats (MX) v1.0, sections 5.3 (E8M0) and 5.3.3
 * (FP4 E2M1)):
 *
 *   one group = 32 elements = 16 bytes + 1 scale byte s
 *   value(element) = E2M1[code] * 2^(s - 127);  s = 255 is NaN.
 *
 * Two arrangements of a group's 16 bytes (the row descriptor names one, "nibbles"):
 *
 *   pairs  (gpt-oss safetensors; scales in a tensor of their own):
 *     byte j:  [ hi nibble | lo nibble ]      element 2j   = lo = b & 0xF
 *                 bit 7..4    bit 3..0        element 2j+1 = hi = b >> 4
 *   halves (llama.cpp GGUF block_mxfp4 { uint8_t e; uint8_t qs[16]; }, 17 bytes, the
 *           scale byte first, read in place):
 *     byte j:  element j = lo = b & 0xF,  element j+16 = hi = b >> 4
 *
 * A kernel never looks at the arrangement: it processes a group's 16 bytes in chunks
 * of `half` bytes, the chunk's low nibbles then its high nibbles ("layout" of half-size
 * `half`: half = 16 for scalar, AVX-512, NEON and the float64 path; half = 4 for AVX2).
 * Byte b, nibble n (0 low, 1 high) of a group thus lands at position
 *   (b / half) * 2 half + n * half + b % half
 * and the arrangement says which element that is.  Latent rows are permuted once per
 * call into the kernel's order for the call's arrangement (mxfp4x_prepare_x_*, through
 * mxfp4x_layout_pos), so a kernel never has to interleave nibbles again.
 */
#ifndef MXFP4X_FORMAT_H
#define MXFP4X_FORMAT_H

#include <string.h>
#include "config.h"

#define MXFP4X_GROUP 32            /* elements per scale group (OCP MX k = 32) */
#define MXFP4X_GROUP_BYTES 16      /* packed bytes per group */
#define MXFP4X_GGUF_BLOCK_BYTES 17 /* a GGUF block_mxfp4: the scale byte, then 16 bytes */
#define MXFP4X_E8M0_BIAS 127
#define MXFP4X_E8M0_NAN 255

MXFP4X_STATIC_ASSERT(MXFP4X_GROUP == 2 * MXFP4X_GROUP_BYTES, "two E2M1 codes per byte");
MXFP4X_STATIC_ASSERT(sizeof(float) == 4 && sizeof(double) == 8, "IEEE binary32/binary64 expected");
MXFP4X_STATIC_ASSERT(sizeof(int64_t) == 8, "64-bit offsets");

/* Instruction sets, in the order of preference of dispatch.h. */
enum {
    MXFP4X_ISA_SCALAR = 0,
    MXFP4X_ISA_AVX2 = 1,
    MXFP4X_ISA_AVX512 = 2,
    MXFP4X_ISA_NEON = 3, /* AArch64 Advanced SIMD */
    MXFP4X_ISA_AMX = 4,  /* AVX-512 + AMX-BF16: avx512's kernels, bf16 latents on tiles */
    MXFP4X_ISA_AVX512BF16 = 5, /* AVX-512 + AVX512-BF16: avx512's, bf16 latents on vdpbf16ps */
    MXFP4X_ISA_COUNT = 6
};

/* Their names: the lowercase strings of MXFP4X_ISA, backend_info(), test ids and benchmark
 * groups.  Stated here once; the kernel table (dispatch.h) and the CPU decision's report
 * (cpu.h's bits, named for every ISA, compiled or not) both read them. */
#define MXFP4X_ISA_NAME_SCALAR "scalar"
#define MXFP4X_ISA_NAME_AVX2 "avx2"
#define MXFP4X_ISA_NAME_AVX512 "avx512"
#define MXFP4X_ISA_NAME_NEON "neon"
#define MXFP4X_ISA_NAME_AMX "amx"
#define MXFP4X_ISA_NAME_AVX512BF16 "avx512bf16"
static const char *const mxfp4x_isa_names[MXFP4X_ISA_COUNT] = {
    [MXFP4X_ISA_SCALAR] = MXFP4X_ISA_NAME_SCALAR,
    [MXFP4X_ISA_AVX2] = MXFP4X_ISA_NAME_AVX2,
    [MXFP4X_ISA_AVX512] = MXFP4X_ISA_NAME_AVX512,
    [MXFP4X_ISA_NEON] = MXFP4X_ISA_NAME_NEON,
    [MXFP4X_ISA_AMX] = MXFP4X_ISA_NAME_AMX,
    [MXFP4X_ISA_AVX512BF16] = MXFP4X_ISA_NAME_AVX512BF16,
};

/* The name of ISA `isa` (an MXFP4X_ISA_* value), NULL outside the enum. */
static const char *mxfp4x_isa_name(int isa) {
    return (isa >= 0 && isa < MXFP4X_ISA_COUNT) ? mxfp4x_isa_names[isa] : NULL;
}

/* Layouts (see the top of this file): the `half` of each kernel's layout. */
#define MXFP4X_LAYOUT_16 16
#define MXFP4X_LAYOUT_4 4

/* Operand dtypes (latents: any; everything else: the compute dtype F32 or F64). */
enum {
    MXFP4X_DTYPE_F32 = 0,
    MXFP4X_DTYPE_F64 = 1,
    MXFP4X_DTYPE_BF16 = 2,
    MXFP4X_DTYPE_F16 = 3
};

/* The arrangement of a group's nibbles (see the top of this file). */
enum {
    MXFP4X_NIBBLES_PAIRS = 0,  /* byte j: elements 2j (low), 2j+1 (high): gpt-oss */
    MXFP4X_NIBBLES_HALVES = 1  /* byte j: elements j (low), j+16 (high): GGUF */
};

/* One expert's weights as the kernels see them: row r of W_e is n_groups groups; group
 * g of row r has its 16 bytes at blocks + r * row_stride_blocks + g * group_stride_blocks
 * and its scale byte at scales[r * row_stride_scales + g * group_stride_scales].
 * Separate tensors (gpt-oss safetensors): group strides 16 and 1.  GGUF blocks: both
 * group strides 17, scales = the first block, blocks = scales + 1.  `nibbles` names the
 * arrangement; the kernels read only the strides (every row of one call has the same
 * arrangement: the latents are prepared for it).  Strides are 64-bit: expert tensors
 * pass 2^31 bytes.
 *
 * next_blocks / next_scales: a prefetch hint, NULL when unknown -- where the caller's next
 * kernel call starts reading (its first row block, fetched with this call's strides).  The
 * gemv kernels fetch it during their last row block, so the call after this one does not
 * start on a cold stream; prefetches never fault, nothing ever reads through the hint,
 * and no result depends on it.
 * pf_far: a prefetch hint too, 1 when the caller's next call is of one token as well: the
 * one-token gemv then fetches two row blocks ahead instead of one (avx512.h).  0 by
 * default. */
typedef struct {
    const uint8_t *blocks;
    const uint8_t *scales;
    int64_t row_stride_blocks;
    int64_t row_stride_scales;
    int64_t n_groups;
    int64_t group_stride_blocks;
    int64_t group_stride_scales;
    int nibbles; /* MXFP4X_NIBBLES_* */
    const uint8_t *next_blocks;
    const uint8_t *next_scales;
    int pf_far;
} mxfp4x_rows;

/* The descriptor of rows with these strides and arrangement, no prefetch hints: the one
 * initializer of mxfp4x_rows_split and mxfp4x_rows_gguf. */
MXFP4X_INLINE mxfp4x_rows mxfp4x_rows_make(const uint8_t *blocks, const uint8_t *scales,
                                            int64_t row_stride_blocks,
                                            int64_t row_stride_scales, int64_t n_groups,
                                            int64_t group_stride_blocks,
                                            int64_t group_stride_scales, int nibbles) {
    mxfp4x_rows w;
    w.blocks = blocks;
    w.scales = scales;
    w.row_stride_blocks = row_stride_blocks;
    w.row_stride_scales = row_stride_scales;
    w.n_groups = n_groups;
    w.group_stride_blocks = group_stride_blocks;
    w.group_stride_scales = group_stride_scales;
    w.nibbles = nibbles;
    w.next_blocks = NULL;
    w.next_scales = NULL;
    w.pf_far = 0;
    return w;
}

/* Rows with packed bytes and scales in separate arrays (gpt-oss safetensors). */
MXFP4X_INLINE mxfp4x_rows mxfp4x_rows_split(const uint8_t *blocks, const uint8_t *scales,
                                             int64_t row_stride_blocks,
                                             int64_t row_stride_scales, int64_t n_groups) {
    return mxfp4x_rows_make(blocks, scales, row_stride_blocks, row_stride_scales, n_groups,
                            MXFP4X_GROUP_BYTES, 1, MXFP4X_NIBBLES_PAIRS);
}

/* Rows of GGUF block_mxfp4 blocks read in place: row r's blocks start at
 * base + r * row_stride. */
MXFP4X_INLINE mxfp4x_rows mxfp4x_rows_gguf(const uint8_t *base, int64_t row_stride,
                                            int64_t n_groups) {
    return mxfp4x_rows_make(base + 1, base, row_stride, row_stride, n_groups,
                            MXFP4X_GGUF_BLOCK_BYTES, MXFP4X_GGUF_BLOCK_BYTES,
                            MXFP4X_NIBBLES_HALVES);
}


/* Where natural element i of a row sits in a kernel layout of half-size `half` for
 * the arrangement `nibbles`: element i is byte b, nibble n of its group (pairs: b = j/2,
 * n = j&1; halves: b = j%16, n = j/16, j = i%32), and a kernel processes the group's
 * bytes in chunks of `half`, low nibbles then high nibbles.  The only statement of the
 * layouts: preparing latents and undoing the transposed product's order both go
 * through it.  (Pairs: blocks of 2*half elements, the `half` even ones then the `half`
 * odd ones; halves with half = 16: the natural order itself.) */
MXFP4X_INLINE int64_t mxfp4x_layout_pos(int64_t i, int half, int nibbles) {
    const int64_t j = i % MXFP4X_GROUP;
    const int64_t b = nibbles == MXFP4X_NIBBLES_HALVES ? j % MXFP4X_GROUP_BYTES : j >> 1;
    const int64_t n = nibbles == MXFP4X_NIBBLES_HALVES ? j / MXFP4X_GROUP_BYTES : j & 1;
    return (i - j) + (b / half) * 2 * half + n * half + b % half;
}

#endif /* MXFP4X_FORMAT_H */
