/* mxfp4x/tables.h -- the decode tables: E2M1 codes, E8M0 scales, and every code times
 * every scale (float32 bits, their bytes, bfloat16), built by the compiler; the bf16
 * units' range conditions. */
#ifndef MXFP4X_TABLES_H
#define MXFP4X_TABLES_H

#include "format.h"

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
 * bf16/unit.h's tests): a value the unit could flush (MXFP4X_BF16_SMALL) takes
 * vdpbf16ps's arithmetic in float32 FMAs, which keep subnormals (avx512bf16.h; amx.h
 * too); one that could overflow a float32 product or sum (MXFP4X_BF16_LARGE, with or
 * without SMALL) a float64 exact path. */
#define MXFP4X_BF16_SMALL 1
#define MXFP4X_BF16_LARGE 2

#endif /* MXFP4X_TABLES_H */
