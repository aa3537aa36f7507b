/* mxfp4x/mxfp4x.h -- public C API: format constants, the E2M1 and E8M0 tables,
 * the ISA enum, the row descriptor and the kernel signatures.
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
#ifndef MXFP4X_H
#define MXFP4X_H

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

/* E2M1 code -> value (OCP MX v1.0, table of FP4 E2M1 values; bit 3 is the sign). */
static const float mxfp4x_e2m1_f32[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* E8M0 scale byte -> float32, bit-exact: s = 1..254 is the normal 2^(s-127)
 * (bits s << 23); s = 0 is 2^-127, the float32 subnormal 0x00400000, which
 * must survive (no FTZ/DAZ anywhere); s = 255 is NaN (OCP MX v1.0, 5.4.1). */
#define MXFP4X_E8M0_BITS(s) ((uint32_t)(s) << 23)
#define MXFP4X_E8M0_ROW(b)                                                                  \
    MXFP4X_E8M0_BITS(b + 0), MXFP4X_E8M0_BITS(b + 1), MXFP4X_E8M0_BITS(b + 2),              \
        MXFP4X_E8M0_BITS(b + 3), MXFP4X_E8M0_BITS(b + 4), MXFP4X_E8M0_BITS(b + 5),          \
        MXFP4X_E8M0_BITS(b + 6), MXFP4X_E8M0_BITS(b + 7), MXFP4X_E8M0_BITS(b + 8),          \
        MXFP4X_E8M0_BITS(b + 9), MXFP4X_E8M0_BITS(b + 10), MXFP4X_E8M0_BITS(b + 11),        \
        MXFP4X_E8M0_BITS(b + 12), MXFP4X_E8M0_BITS(b + 13), MXFP4X_E8M0_BITS(b + 14),       \
        MXFP4X_E8M0_BITS(b + 15)
static const union {
    uint32_t u[256];
    float f[256];
} mxfp4x_e8m0_table = {{
    0x00400000u, MXFP4X_E8M0_BITS(1), MXFP4X_E8M0_BITS(2), MXFP4X_E8M0_BITS(3),
    MXFP4X_E8M0_BITS(4), MXFP4X_E8M0_BITS(5), MXFP4X_E8M0_BITS(6), MXFP4X_E8M0_BITS(7),
    MXFP4X_E8M0_BITS(8), MXFP4X_E8M0_BITS(9), MXFP4X_E8M0_BITS(10), MXFP4X_E8M0_BITS(11),
    MXFP4X_E8M0_BITS(12), MXFP4X_E8M0_BITS(13), MXFP4X_E8M0_BITS(14), MXFP4X_E8M0_BITS(15),
    MXFP4X_E8M0_ROW(16), MXFP4X_E8M0_ROW(32), MXFP4X_E8M0_ROW(48), MXFP4X_E8M0_ROW(64),
    MXFP4X_E8M0_ROW(80), MXFP4X_E8M0_ROW(96), MXFP4X_E8M0_ROW(112), MXFP4X_E8M0_ROW(128),
    MXFP4X_E8M0_ROW(144), MXFP4X_E8M0_ROW(160), MXFP4X_E8M0_ROW(176), MXFP4X_E8M0_ROW(192),
    MXFP4X_E8M0_ROW(208), MXFP4X_E8M0_ROW(224),
    MXFP4X_E8M0_BITS(240), MXFP4X_E8M0_BITS(241), MXFP4X_E8M0_BITS(242), MXFP4X_E8M0_BITS(243),
    MXFP4X_E8M0_BITS(244), MXFP4X_E8M0_BITS(245), MXFP4X_E8M0_BITS(246), MXFP4X_E8M0_BITS(247),
    MXFP4X_E8M0_BITS(248), MXFP4X_E8M0_BITS(249), MXFP4X_E8M0_BITS(250), MXFP4X_E8M0_BITS(251),
    MXFP4X_E8M0_BITS(252), MXFP4X_E8M0_BITS(253), MXFP4X_E8M0_BITS(254), 0x7FC00000u}};

MXFP4X_INLINE float mxfp4x_e8m0_f32(uint8_t s) { return mxfp4x_e8m0_table.f[s]; }

/* float64 twin: every E8M0 value is a normal binary64 number (or NaN). */
MXFP4X_INLINE double mxfp4x_e8m0_f64(uint8_t s) { return (double)mxfp4x_e8m0_table.f[s]; }

/* The decode constants of an entry whose decode needs none (generic/interface.h). */
typedef struct {
    char unused;
} mxfp4x_no_tables;

MXFP4X_INLINE mxfp4x_no_tables mxfp4x_no_tables_load(void) {
    mxfp4x_no_tables t = {0};
    return t;
}

/* The E2M1 table times every E8M0 scale, as float32 bits: mxfp4x_e2m1_scaled.u[s][c] is
 * the bits of e2m1[c] * 2^(s - 127) rounded to float32 once, i.e. exactly what one
 * float32 multiply of the two gives (the kernels' "table times scale"): exact while the
 * product is a float32 (normal or subnormal: s = 0 and 0.5 give 2^-128), +-inf past
 * FLT_MAX (s >= 253 for the larger codes: 1.5 * 2^128 and up round to inf), +-0 for the
 * zero codes, and the quiet NaN 0x7FC00000 for every code at s = 255 (a float32 multiply
 * by NaN returns the NaN operand).  Integer constant expressions only, so the table is
 * built by the compiler, identical on every platform (the C checker's decode check runs
 * every byte under every scale byte through it, bit for bit against the definition).  A
 * kernel loads a group's scaled table in one 64-byte load instead of multiplying the
 * table by the scale. */
/* biased exponent of |code| c (1..7) times 2^(s - 127): |c| = 2^(e-1) (1 + f/2), e = c >> 1,
 * f = c & 1, except c = 1 = 2^-1 (e = 0, no fraction) */
#define MXFP4X_SC_EXP(s, c) ((int)(s) - 1 + ((c) >> 1))
#define MXFP4X_SC_FRAC(c) ((c) == 1 ? 0u : (uint32_t)((c) & 1))
#define MXFP4X_SC_MAG(s, c)                                                                 \
    ((c) == 0 ? 0u                                                                          \
     : MXFP4X_SC_EXP(s, c) >= 255 ? 0x7F800000u                                             \
     : MXFP4X_SC_EXP(s, c) >= 1   ? ((uint32_t)MXFP4X_SC_EXP(s, c) << 23) |                  \
                                      (MXFP4X_SC_FRAC(c) << 22)                             \
                                  : (2u + MXFP4X_SC_FRAC(c)) << (MXFP4X_SC_EXP(s, c) + 21))
#define MXFP4X_SC_BITS(s, code)                                                             \
    ((s) == MXFP4X_E8M0_NAN ? 0x7FC00000u                                                   \
                            : (((uint32_t)(code) & 8u) << 28) | MXFP4X_SC_MAG(s, (code) & 7))
/* A table over (scale byte s, code c) of F(s, c): 16 codes per row, 16 rows per call. */
#define MXFP4X_SC_ROW_OF(F, s)                                                              \
    {F(s, 0),  F(s, 1),  F(s, 2),  F(s, 3),  F(s, 4),  F(s, 5),  F(s, 6),  F(s, 7),         \
     F(s, 8),  F(s, 9),  F(s, 10), F(s, 11), F(s, 12), F(s, 13), F(s, 14), F(s, 15)}
#define MXFP4X_SC_16_OF(F, b)                                                               \
    MXFP4X_SC_ROW_OF(F, (b) + 0), MXFP4X_SC_ROW_OF(F, (b) + 1), MXFP4X_SC_ROW_OF(F, (b) + 2), \
        MXFP4X_SC_ROW_OF(F, (b) + 3), MXFP4X_SC_ROW_OF(F, (b) + 4),                         \
        MXFP4X_SC_ROW_OF(F, (b) + 5), MXFP4X_SC_ROW_OF(F, (b) + 6),                         \
        MXFP4X_SC_ROW_OF(F, (b) + 7), MXFP4X_SC_ROW_OF(F, (b) + 8),                         \
        MXFP4X_SC_ROW_OF(F, (b) + 9), MXFP4X_SC_ROW_OF(F, (b) + 10),                        \
        MXFP4X_SC_ROW_OF(F, (b) + 11), MXFP4X_SC_ROW_OF(F, (b) + 12),                       \
        MXFP4X_SC_ROW_OF(F, (b) + 13), MXFP4X_SC_ROW_OF(F, (b) + 14),                       \
        MXFP4X_SC_ROW_OF(F, (b) + 15)
#define MXFP4X_SC_ALL_OF(F)                                                                 \
    {MXFP4X_SC_16_OF(F, 0),   MXFP4X_SC_16_OF(F, 16),  MXFP4X_SC_16_OF(F, 32),               \
     MXFP4X_SC_16_OF(F, 48),  MXFP4X_SC_16_OF(F, 64),  MXFP4X_SC_16_OF(F, 80),               \
     MXFP4X_SC_16_OF(F, 96),  MXFP4X_SC_16_OF(F, 112), MXFP4X_SC_16_OF(F, 128),              \
     MXFP4X_SC_16_OF(F, 144), MXFP4X_SC_16_OF(F, 160), MXFP4X_SC_16_OF(F, 176),              \
     MXFP4X_SC_16_OF(F, 192), MXFP4X_SC_16_OF(F, 208), MXFP4X_SC_16_OF(F, 224),              \
     MXFP4X_SC_16_OF(F, 240)}
MXFP4X_ALIGN64 static const union {
    uint32_t u[256][16];
    float f[256][16];
} mxfp4x_e2m1_scaled = {MXFP4X_SC_ALL_OF(MXFP4X_SC_BITS)};

/* Bits 31..24 and 23..16 of the same values: every entry's low 16 bits are zero
 * (E2M1 has one mantissa bit; the subnormals of s = 0 and 1 sit at bit 20 and up), so
 * two 16-entry byte lookups (vpshufb, tbl) build the scaled float32 exactly. */
#define MXFP4X_SC_B3(s, c) ((uint8_t)(MXFP4X_SC_BITS(s, c) >> 24))
#define MXFP4X_SC_B2(s, c) ((uint8_t)((MXFP4X_SC_BITS(s, c) >> 16) & 0xFFu))
static const uint8_t mxfp4x_e2m1_scaled_b3[256][16] = MXFP4X_SC_ALL_OF(MXFP4X_SC_B3);
static const uint8_t mxfp4x_e2m1_scaled_b2[256][16] = MXFP4X_SC_ALL_OF(MXFP4X_SC_B2);

/* The same values as bfloat16 bits (the top half of each: the low 16 bits are zero), for
 * the AMX decode (amx.h): a bfloat16 exactly where the float32 is normal; s = 0 and 1
 * give bf16 subnormals, which tdpbf16ps would read as zero (amx.h sends those groups to
 * its exact path). */
#define MXFP4X_SC_BF16(s, c) ((uint16_t)(MXFP4X_SC_BITS(s, c) >> 16))
MXFP4X_ALIGN64 static const uint16_t mxfp4x_e2m1_scaled_bf16[256][16] =
    MXFP4X_SC_ALL_OF(MXFP4X_SC_BF16);
/* amx.h's conditions for tdpbf16ps to see no subnormal: scale bytes of groups with a
 * nonzero code >= 69 (nonzero weights >= 2^-59) and nonzero finite latents >= 2^-60
 * (bf16 exponent field >= 67); and for nothing to overflow (so that its few-token
 * emulation, which takes the scale out of each group's sums, gives its bits): every
 * scale byte < 160 (weights < 2^35; 255 is NaN) and every latent < 2^64 in magnitude
 * (exponent field < 191: infinities and NaNs included). */
#define MXFP4X_AMX_MIN_SCALE 69
#define MXFP4X_AMX_MIN_LATENT_EXP 67
#define MXFP4X_AMX_MAX_SCALE 160
#define MXFP4X_AMX_MAX_LATENT_EXP 191
/* What a row or a token outside them needs instead of the unit (0: the unit takes it;
 * bf16_unit.h's tests): a value the unit could flush (MXFP4X_BF16_SMALL) takes
 * vdpbf16ps's arithmetic in float32 FMAs, which keep subnormals (avx512bf16.h; amx.h
 * too); one that could overflow a float32 product or sum (MXFP4X_BF16_LARGE, with or
 * without SMALL) a float64 exact path. */
#define MXFP4X_BF16_SMALL 1
#define MXFP4X_BF16_LARGE 2

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

/* Rows with packed bytes and scales in separate arrays (gpt-oss safetensors). */
MXFP4X_INLINE mxfp4x_rows mxfp4x_rows_split(const uint8_t *blocks, const uint8_t *scales,
                                             int64_t row_stride_blocks,
                                             int64_t row_stride_scales, int64_t n_groups) {
    mxfp4x_rows w;
    w.blocks = blocks;
    w.scales = scales;
    w.row_stride_blocks = row_stride_blocks;
    w.row_stride_scales = row_stride_scales;
    w.n_groups = n_groups;
    w.group_stride_blocks = MXFP4X_GROUP_BYTES;
    w.group_stride_scales = 1;
    w.nibbles = MXFP4X_NIBBLES_PAIRS;
    w.next_blocks = NULL;
    w.next_scales = NULL;
    w.pf_far = 0;
    return w;
}

/* Rows of GGUF block_mxfp4 blocks read in place: row r's blocks start at
 * base + r * row_stride. */
MXFP4X_INLINE mxfp4x_rows mxfp4x_rows_gguf(const uint8_t *base, int64_t row_stride,
                                            int64_t n_groups) {
    mxfp4x_rows w;
    w.blocks = base + 1;
    w.scales = base;
    w.row_stride_blocks = row_stride;
    w.row_stride_scales = row_stride;
    w.n_groups = n_groups;
    w.group_stride_blocks = MXFP4X_GGUF_BLOCK_BYTES;
    w.group_stride_scales = MXFP4X_GGUF_BLOCK_BYTES;
    w.nibbles = MXFP4X_NIBBLES_HALVES;
    w.next_blocks = NULL;
    w.next_scales = NULL;
    w.pf_far = 0;
    return w;
}

/* ---- streaming the next row block in while the current one is computed ----
 *
 * A gemv call reads blocks of 4 rows; while it computes one, it prefetches the one after
 * next (MXFP4X_PF_AHEAD below) into L2 one line per group (two every eighth group: a GGUF
 * block of 4 rows is 68 bytes per group), in address order, and that block's scale bytes
 * (a separate array) into L1 at once.  On an Intel Xeon with AVX-512 the lines in address
 * order, and the next call's first block (next_blocks) fetched too, each streamed faster
 * than one line per row every 4 groups (docs/performance.md, "Prefetch").
 * The AVX-512 kernels are compiled twice, `l1` a constant in each: their lines go into L1
 * on the cores where that measured faster (mxfp4x_pf_into_l1 in cpu.h: AMD Zen 5).
 * The AVX-512 one-token gemv reads blocks of 8 rows and fetches the next block (8 rows
 * ahead, as here), or with mxfp4x_rows.pf_far the one after, two lines per group
 * (avx512.h). */
typedef struct {
    const char *p, *end;
    int l1; /* fetch into L1 (T0) rather than L2 (T1) */
} mxfp4x_pf_cursor;

/* How far ahead, in blocks: the block after next.  On an AMD EPYC Zen 5 one block of
 * gpt-oss rows ahead (5.8 KB) arrives too late, and three are no better than two; avx2
 * (bound by its decode) and GGUF rows are level (docs/performance.md, "Prefetch"). */
#ifndef MXFP4X_PF_AHEAD
#define MXFP4X_PF_AHEAD 2
#endif

/* The block AHEAD blocks after rows [r, r + m) of a call ending at row_end: rows
 * [r + AHEAD m, r + (AHEAD + 1) m), or where it falls in the next call's rows (from the
 * hint) when those are not all in this call. */
MXFP4X_INLINE mxfp4x_pf_cursor mxfp4x_pf_block_ahead(const mxfp4x_rows *w, int64_t r, int m,
                                                     int64_t row_end, int ahead) {
    mxfp4x_pf_cursor c;
    const int64_t at = r + (int64_t)ahead * m;         /* the block to fetch */
    const int64_t past = at > row_end ? at - row_end : 0; /* its rows into the next call */
    const int here = at + m <= row_end;
    const uint8_t *b =
        here ? w->blocks + at * w->row_stride_blocks
             : (w->next_blocks ? w->next_blocks + past * w->row_stride_blocks : NULL);
    const uint8_t *s =
        here ? w->scales + at * w->row_stride_scales
             : (w->next_scales ? w->next_scales + past * w->row_stride_scales : NULL);
    c.p = (const char *)b;
    c.end = b ? (const char *)b + m * w->row_stride_blocks : (const char *)b;
    c.l1 = 0;
    if (s && w->group_stride_scales == 1) { /* scales apart: their lines now, into L1 */
        const char *q = (const char *)s, *e = q + m * w->row_stride_scales;
        for (; q < e; q += 64) MXFP4X_PREFETCH(q);
        MXFP4X_PREFETCH(e - 1);
    }
    return c;
}

MXFP4X_INLINE mxfp4x_pf_cursor mxfp4x_pf_next_block(const mxfp4x_rows *w, int64_t r, int m,
                                                    int64_t row_end) {
    return mxfp4x_pf_block_ahead(w, r, m, row_end, MXFP4X_PF_AHEAD);
}

/* The same, its lines into L1 if `l1` (a constant where the kernel is inlined). */
MXFP4X_INLINE mxfp4x_pf_cursor mxfp4x_pf_next_block_to(const mxfp4x_rows *w, int64_t r, int m,
                                                       int64_t row_end, int l1) {
    mxfp4x_pf_cursor c = mxfp4x_pf_block_ahead(w, r, m, row_end, MXFP4X_PF_AHEAD);
    c.l1 = l1;
    return c;
}

/* One step per group (g): the next line, and a second one every eighth group. */
#define MXFP4X_PF_LINE(c)                                                                  \
    do {                                                                                   \
        if ((c).l1)                                                                        \
            MXFP4X_PREFETCH((c).p);                                                        \
        else                                                                               \
            MXFP4X_PREFETCH_L2((c).p);                                                     \
        (c).p += 64;                                                                       \
    } while (0)
#define MXFP4X_PF_STEP(c, g)                                                               \
    do {                                                                                   \
        if ((c).p < (c).end) MXFP4X_PF_LINE(c);                                            \
        if (((g) & 7) == 7 && (c).p < (c).end) MXFP4X_PF_LINE(c);                          \
    } while (0)

/* Kernel signatures (one implementation per ISA, see dispatch.h).
 *
 * All three compute, for every (row, token) pair, the same dot product with
 * the same operations in the same order, so a result does not depend on which
 * of them produced it (batch invariance):
 *
 *   gemv:      out[t * out_stride + r - row_start] = W[r] . x[x_rows[t]]
 *              fused, weights decoded in registers (for one or a few tokens)
 *   decode:    panel[(r - row_start) * d_in + i] = W[r][i] (the ISA's layout)
 *   panel_dot: out[t * out_stride + r] = panel[r] . x[x_rows[t]]; `scratch` holds
 *              panel_scratch_floats(n_rows) floats (the ISA's own blocking)
 */
typedef void (*mxfp4x_gemv_f32_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                   const float *x, int64_t x_stride, const int64_t *x_rows,
                                   int64_t n_tok, float *out, int64_t out_stride);
typedef void (*mxfp4x_decode_f32_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                     float *panel);
typedef void (*mxfp4x_panel_dot_f32_fn)(const float *panel, int64_t n_rows, int64_t n_groups,
                                        const float *x, int64_t x_stride, const int64_t *x_rows,
                                        int64_t n_tok, float *out, int64_t out_stride,
                                        float *scratch);
typedef int64_t (*mxfp4x_scratch_fn)(int64_t n_rows);

/* The ISA's float32 multiply-add peak, for the roofline: `iters` rounds of independent
 * register-resident multiply-adds; returns their result (so nothing is optimised away)
 * and sets *flops to the floating-point operations done. */
typedef float (*mxfp4x_fma_loop_fn)(int64_t iters, float seed, int64_t *flops);

/* Transposed product (gradient of the latents): dst[j] += sum_r coef[r] * panel[r][j],
 * r ascending for every j (one multiply-add per term, as the ISA does them). */
typedef void (*mxfp4x_axpy_rows_f32_fn)(const float *panel, int64_t n_rows, int64_t width,
                                        const float *coef, float *dst);

/* The float64 path (float64 latents): decode, panel_dot and axpy_rows as above in binary64,
 * with one arithmetic for every ISA (scalar.h states it), so the entries' forms differ in
 * speed only and a float64 result's bits do not depend on the ISA. */
typedef void (*mxfp4x_decode_f64_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                     double *panel);
typedef void (*mxfp4x_panel_dot_f64_fn)(const double *panel, int64_t n_rows, int64_t n_groups,
                                        const double *x, int64_t x_stride,
                                        const int64_t *x_rows, int64_t n_tok, double *out,
                                        int64_t out_stride);
typedef void (*mxfp4x_axpy_rows_f64_fn)(const double *panel, int64_t n_rows, int64_t width,
                                        const double *coef, double *dst);

/* Dense bfloat16 rows times float32 tokens (the dense projections around the experts,
 * which checkpoints ship in bf16): for r in [row_start, row_end), t < n_tok,
 *   out[t * out_stride + r - row_start] = sum_i W[r][i] * x[t * x_stride + i]
 * W[r] at w + r * row_stride (uint16 bf16 bits, d_in of them).  Each bf16 weight widens
 * to float32 exactly (a shift); products and sums in float32, in each ISA's lanes and
 * reduction tree, the same for every (row, token) whatever n_tok or the row range: the
 * bits depend on neither the batch nor the thread split. */
typedef void (*mxfp4x_dense_bf16_fn)(const uint16_t *w, int64_t row_stride, int64_t row_start,
                                     int64_t row_end, int64_t d_in, const float *x,
                                     int64_t x_stride, int64_t n_tok, float *out,
                                     int64_t out_stride);
/* The same with bf16 tokens (x: their uint16 bits): the same bits as the entry's
 * dense_bf16 on the tokens widened to float32. */
typedef void (*mxfp4x_dense_bf16x_fn)(const uint16_t *w, int64_t row_stride,
                                      int64_t row_start, int64_t row_end, int64_t d_in,
                                      const uint16_t *x, int64_t x_stride, int64_t n_tok,
                                      float *out, int64_t out_stride);

/* bfloat16 latents on a bf16 dot-product unit (amx.h): gather n pairs' latents (token
 * rows src[i] of x, bf16 bits) into the unit's blocks at dst (n * d_in elements, 64 bytes
 * of slack after), flagging in unsafe[i] a token the unit could not take exactly; then
 * out[t * out_stride + r - row_start] = W[r] . x_t for the gathered tokens. */
typedef void (*mxfp4x_bf16_gather_fn)(const uint16_t *x, int64_t x_stride, const int64_t *src,
                                      int64_t n, int64_t n_groups, int nibbles, uint16_t *dst,
                                      uint8_t *unsafe);
typedef void (*mxfp4x_bf16_rows_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                    const uint16_t *xt, const uint8_t *unsafe, int64_t n_tok,
                                    float *out, int64_t out_stride, void *scratch);
typedef int64_t (*mxfp4x_bf16_scratch_fn)(int64_t n_groups);
typedef int (*mxfp4x_count_fn)(void);

/* The driver uses gemv for experts with at most gemv_max_tokens tokens in a call (a
 * per-ISA crossover, measured: each ISA's header, docs/performance.md; dispatch.h's
 * mxfp4x_gemv_switch may move it for a core), and decode + panel_dot above it (where the panel's store and
 * reload pay off). */

typedef struct {
    int isa;
    const char *name;
    int layout_half;     /* element order inside a group, see mxfp4x_layout_pos */
    int panel_row_block; /* panel_dot's rows per register block: panels hold a multiple */
    int gemv_max_tokens; /* gemv up to this many tokens per expert, panels above */
    int tile_rows;       /* output rows of W per forward task (a multiple of the blocks;
                            the driver may take up to 4 tiles per task, _cpu.pyx) */
    int64_t panel_bytes; /* decoded rows a thread holds at once (float32 panel) */
    mxfp4x_gemv_f32_fn gemv_f32;
    mxfp4x_decode_f32_fn decode_f32;
    mxfp4x_panel_dot_f32_fn panel_dot_f32;
    mxfp4x_scratch_fn panel_scratch_floats; /* floats of panel_dot scratch for n_rows */
    mxfp4x_axpy_rows_f32_fn axpy_rows_f32;
    mxfp4x_decode_f64_fn decode_f64;       /* the float64 path (same bits on every entry) */
    mxfp4x_panel_dot_f64_fn panel_dot_f64;
    mxfp4x_axpy_rows_f64_fn axpy_rows_f64;
    mxfp4x_fma_loop_fn fma_loop;          /* roofline only */
    mxfp4x_dense_bf16_fn dense_bf16;      /* dense bf16 rows x float32 tokens */
    mxfp4x_dense_bf16x_fn dense_bf16x;    /* ... x bf16 tokens (NULL: widen them to
                                             float32 for dense_bf16) */
    /* bf16 latents of a float32 forward call (NULL: converted to float32 for gemv_f32 /
     * panel_dot_f32): the gather of an expert's tokens and the rows' product (amx.h) */
    mxfp4x_bf16_gather_fn bf16_gather;
    mxfp4x_bf16_rows_fn bf16_rows;
    mxfp4x_bf16_scratch_fn bf16_scratch_bytes;
    /* bf16_rows' own switch on this CPU: registers up to this many tokens per expert */
    mxfp4x_count_fn bf16_gemv_max_tokens;
    /* roofline only: the bf16 unit's multiply-add peak, as fma_loop (NULL: not measured;
     * the float32 peak stands in) */
    mxfp4x_fma_loop_fn bf16_dot_loop;
} mxfp4x_kernels;

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

/* ---- one call of the CPU driver, described once ------------------------------
 *
 * Built from tensors in one place (mxfp4x/_cpu_impl.py through the Call type of
 * mxfp4x/_cpu.pyx), checked in one place (_cpu.pyx, _check_call), and read by
 * the one driver skeleton.  Modes are named fields, never inferred from shapes.
 */

/* The experts: expert e's rows are rows[e] (stacked or one tensor each: any
 * mix of base pointers and strides), all of one arrangement (rows[e].nibbles). */
typedef struct {
    int64_t n_experts, d_out, n_groups;
    const mxfp4x_rows *rows;
} mxfp4x_experts;

enum { MXFP4X_FORWARD = 0, MXFP4X_TRANSPOSED = 1 };          /* product */
enum { MXFP4X_ROWS_PER_TOKEN = 0, MXFP4X_ROWS_PER_SLOT = 1 }; /* rows of an operand */

/* For every pair p = t * top_k + k with e = selected[p] and w = mix ? mix[p] : 1:
 *
 *   FORWARD     src: latents (rows, d_in) of src_dtype; dst: (rows, d_out) of dst_dtype.
 *               mix given:  dst[t]  = start[t] + sum of w * (W_e src[row_src(p)])
 *                           start: init (n_tokens, d_out) of init_dtype, or (init NULL)
 *                           dst's own values
 *               mix NULL:   dst[p]   = W_e src[row_src(p)]         (per-slot outputs)
 *   TRANSPOSED  src: gradient (rows, d_out) of src_dtype; dst: (rows, d_in) of dst_dtype:
 *                           dst[row_dst(p)] = sum over its pairs of w * (W_e^T src[row_src(p)])
 *
 * Every sum is taken in compute and rounded once into dst_dtype, which is compute or,
 * with float32 compute, bfloat16 or float16 (a forward call then has init wherever it
 * has mix); init_dtype and a transposed call's src_dtype convert exactly into compute.
 * Rows in natural element order.  row_src(p) = p if src_rows is PER_SLOT else t, and
 * likewise row_dst.  mix is given exactly when the d_out side is per token (the
 * products are summed over the slots there). */
typedef struct {
    int product;                    /* MXFP4X_FORWARD or MXFP4X_TRANSPOSED */
    int compute;                    /* MXFP4X_DTYPE_F32 or _F64: accumulation */
    const mxfp4x_kernels *kernels;  /* the ISA this call runs (its float64 kernels for
                                       float64 compute) */
    int n_threads;
    mxfp4x_experts experts;
    int64_t n_tokens, top_k;
    const int64_t *selected;        /* (n_tokens, top_k); ids checked while routing */
    const void *mix;                /* (n_tokens, top_k) of compute, or NULL */
    const void *src;
    int src_dtype;                  /* MXFP4X_DTYPE_*: any for FORWARD, exact otherwise */
    int src_rows;                   /* MXFP4X_ROWS_* */
    void *dst;
    int dst_rows;                   /* MXFP4X_ROWS_* */
    int dst_dtype;                  /* compute; with float32 compute: or BF16, F16 */
    const void *init;               /* FORWARD with mix: the start of each sum, or NULL */
    int init_dtype;                 /* MXFP4X_DTYPE_* of init */
} mxfp4x_call;

/* ---- 16-bit float conversions (exact; used once per call on the latents) ---- */

MXFP4X_INLINE float mxfp4x_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bfloat16 is the top half of a binary32. */
MXFP4X_INLINE float mxfp4x_bf16_to_f32(uint16_t h) { return mxfp4x_bits_to_f32((uint32_t)h << 16); }

/* IEEE binary16 -> binary32, exact for every number (subnormals, infinities); a NaN keeps
 * its sign and payload and becomes quiet, as F16C's vcvtph2ps (torch's conversion) makes
 * it.  A subnormal half is man * 2^-24, an exact float product.  Every case computed and
 * one chosen by masks: a loop of it vectorises (a ?: chain stayed a branch). */
MXFP4X_INLINE float mxfp4x_f16_to_f32(uint16_t h) {
    const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const float subf = (float)(int32_t)man * 5.9604644775390625e-8f; /* 2^-24 */
    const uint32_t is_sub = 0u - (uint32_t)(exp == 0), is_max = 0u - (uint32_t)(exp == 0x1Fu);
    const uint32_t quiet = is_max & (0u - (uint32_t)(man != 0)) & 0x400000u; /* a NaN */
    const uint32_t normal = ((exp + 112u + (is_max & 112u)) << 23) | (man << 13) | quiet;
    uint32_t sub;
    memcpy(&sub, &subf, sizeof sub);
    return mxfp4x_bits_to_f32(sign | (is_sub & sub) | (~is_sub & normal));
}

MXFP4X_INLINE uint32_t mxfp4x_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* binary32 bits -> bfloat16 bits, rounded to nearest, ties to even (infinities kept,
 * overflow to infinity); every NaN -> 0xFFFF, as torch's vectorised CPU conversion gives
 * on x86. */
MXFP4X_INLINE uint16_t mxfp4x_bits_to_bf16(uint32_t u) {
    return (u & 0x7FFFFFFFu) > 0x7F800000u
               ? (uint16_t)0xFFFFu
               : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* binary32 -> IEEE binary16 bits, rounded to nearest, ties to even, subnormals included;
 * a NaN keeps its sign and its top 10 payload bits and becomes quiet (as F16C's vcvtps2ph,
 * which torch's CPU conversion uses).  Every case computed, one chosen by masks: a loop
 * of it vectorises. */
MXFP4X_INLINE uint16_t mxfp4x_f32_to_f16(float f) {
    const uint32_t u = mxfp4x_f32_to_bits(f);
    const int32_t a = (int32_t)(u & 0x7FFFFFFFu); /* |f|'s bits: signed compares suffice */
    const uint32_t sign = (u >> 16) & 0x8000u;
    /* under 2^-14: a count of 2^-24 units.  0.5 + |f| in binary32 has ulp 2^-24, so the
     * float addition rounds |f| to the nearest count, ties to even, exactly once. */
    const uint32_t sub = mxfp4x_f32_to_bits(mxfp4x_bits_to_f32((uint32_t)a) + 0.5f) -
                         0x3F000000u;
    /* exponent bias 127 -> 15, then 23 -> 10 mantissa bits, rounded */
    const uint32_t normal =
        ((uint32_t)a - 0x38000000u + 0xFFFu + (((uint32_t)a >> 13) & 1u)) >> 13;
    const uint32_t nan = 0x7E00u | (((uint32_t)a >> 13) & 0x3FFu);
    const uint32_t m_nan = 0u - (uint32_t)(a > 0x7F800000);
    const uint32_t m_inf = 0u - (uint32_t)(a >= 0x477FF000); /* 65520 and up: infinity */
    const uint32_t m_sub = 0u - (uint32_t)(a < 0x38800000);
    uint32_t r = (m_sub & sub) | (~m_sub & normal);
    r = (m_inf & 0x7C00u) | (~m_inf & r);
    r = (m_nan & nan) | (~m_nan & r);
    return (uint16_t)(sign | r);
}

/* Lines of bytes [off, off + len) of n rows `stride` bytes apart into L2 (a hint): the
 * slices of token rows a driver task starts its sums from and rounds them into, touched
 * after the task's first dot products, which hide the wait for them. */
MXFP4X_INLINE void mxfp4x_prefetch_slices(const void *base, int64_t stride, int64_t n,
                                          int64_t off, int64_t len) {
    int64_t i, b;
    for (i = 0; i < n && len > 0; i++) {
        const char *row = (const char *)base + i * stride + off;
        for (b = 0; b < len; b += 64) MXFP4X_PREFETCH_L2(row + b);
        MXFP4X_PREFETCH_L2(row + len - 1);
    }
}

/* n float32 sums rounded once into dtype dst_dtype (MXFP4X_DTYPE_BF16 or _F16). */
MXFP4X_INLINE void mxfp4x_store_f16s(const float *src, int64_t n, int dst_dtype, uint16_t *dst) {
    int64_t i;
    if (dst_dtype == MXFP4X_DTYPE_BF16) /* on the bit patterns: a vectorised loop */
        for (i = 0; i < n; i++) dst[i] = mxfp4x_bits_to_bf16(((const uint32_t *)src)[i]);
    else
        for (i = 0; i < n; i++) dst[i] = mxfp4x_f32_to_f16(src[i]);
}

#endif /* MXFP4X_H */
