/* mxfp4x/emulate_amx.h -- the AMX entry (amx.h) on a CPU without AMX: its tile
 * instructions in portable C, its AVX-512 code native.
 *
 * Built only with -DMXFP4X_EMULATE_AMX: test builds, never shipped -- the C checker
 * (tests/kernels/test_c_kernels.py) and the extension of CI's AMX emulation lane
 * (MXFP4X_EMULATE_AMX=1 python setup.py build_ext).  amx.h then includes this
 * header after <immintrin.h>, compiles its functions for AVX-512 (F, BW) without the
 * amx-tile / amx-bf16 targets, and cpu.h reports the amx entry runnable wherever the
 * avx512 entry and AVX-512 BW are.  The purpose: the entry's logic -- the panel decode,
 * the tile shapes, partial row and token blocks, the exact-path scans, the register
 * gemv that replays the tiles' arithmetic, row ranges split at tiles -- checked bit for
 * bit on every AVX-512 host, not only on the Xeons that have the tiles.  On a host with
 * AMX the test also compares this build's digests with the native build's: the model
 * below against the hardware.
 *
 * The model of tdpbf16ps C += A . B (Intel SDM: A m x k pairs of bf16, B k x n pairs,
 * C m x n float32), as amx.h describes it (measured on a Xeon, bit for bit on 10^6 cells
 * of random operands) and its register gemv replays it: for each cell,
 *
 *     E = a[0] b[0] + a[2] b[2] + ... (the even elements of the k pairs),
 *     O = a[1] b[1] + a[3] b[3] + ... (the odd elements),
 *     each a float32 chain in pair order, one round-to-nearest-even per step (a bf16 x
 *     bf16 product is exact in float32: one fused multiply-add per step; C's rounding
 *     follows MXCSR, which the kernels' callers set to nearest-even, config.h's
 *     mxfp4x_fpenv_enter);
 *     C = C + (E + O).
 *
 * With the unit's own rules: bf16 inputs that are subnormal read as zero, and subnormal
 * results are flushed to zero (sign kept), whatever MXCSR says.  The kernels never give
 * the unit an operand where these rules change a stored result (amx.h: the exact path),
 * so they are modelled for fidelity, not relied on.  The tiles' configuration (rows,
 * bytes per row) is honoured; rows and columns outside it read as zero.  State is per
 * thread, as the tile registers are.
 */
#ifndef MXFP4X_EMULATE_AMX_H
#define MXFP4X_EMULATE_AMX_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include "mxfp4x.h"

typedef struct {
    uint8_t data[8][16][64];
    int rows[8], colsb[8];
} mxfp4x_emu_tiles;

static __thread mxfp4x_emu_tiles mxfp4x_emu_tile_state;

static float mxfp4x_emu_ftz(float v) {
    return fabsf(v) < 0x1p-126f ? copysignf(0.0f, v) : v;
}

/* a bf16 input as the unit reads it: subnormals as zero (sign kept) */
static float mxfp4x_emu_bf16_daz(uint16_t h) {
    return mxfp4x_bf16_to_f32((h & 0x7F80) ? h : (uint16_t)(h & 0x8000));
}

static void mxfp4x_emu_tile_loadconfig(const void *config) {
    const uint8_t *c = (const uint8_t *)config;
    int t;
    for (t = 0; t < 8; t++) { /* palette 1: colsb at byte 16 + 2t, rows at byte 48 + t */
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, 2);
        mxfp4x_emu_tile_state.colsb[t] = colsb > 64 ? 64 : colsb;
        mxfp4x_emu_tile_state.rows[t] = c[48 + t] > 16 ? 16 : c[48 + t];
    }
    memset(mxfp4x_emu_tile_state.data, 0, sizeof mxfp4x_emu_tile_state.data);
}

static void mxfp4x_emu_tile_release(void) {
    memset(&mxfp4x_emu_tile_state, 0, sizeof mxfp4x_emu_tile_state);
}

static void mxfp4x_emu_tile_zero(int t) {
    memset(mxfp4x_emu_tile_state.data[t], 0, sizeof mxfp4x_emu_tile_state.data[t]);
}

static void mxfp4x_emu_tile_loadd(int t, const void *base, int64_t stride) {
    const int rows = mxfp4x_emu_tile_state.rows[t], colsb = mxfp4x_emu_tile_state.colsb[t];
    int i;
    mxfp4x_emu_tile_zero(t);
    for (i = 0; i < rows; i++)
        memcpy(mxfp4x_emu_tile_state.data[t][i], (const uint8_t *)base + i * stride,
               (size_t)colsb);
}

static void mxfp4x_emu_tile_stored(int t, void *base, int64_t stride) {
    const int rows = mxfp4x_emu_tile_state.rows[t], colsb = mxfp4x_emu_tile_state.colsb[t];
    int i;
    for (i = 0; i < rows; i++)
        memcpy((uint8_t *)base + i * stride, mxfp4x_emu_tile_state.data[t][i], (size_t)colsb);
}

/* C (tile c) += A (tile a: rows x pairs) . B (tile b: pairs x columns), the model above */
static void mxfp4x_emu_tile_dpbf16ps(int c, int a, int b) {
    const mxfp4x_emu_tiles *s = &mxfp4x_emu_tile_state;
    const int m_rows = s->rows[c], n_cols = s->colsb[c] / 4, k_pairs = s->colsb[a] / 4;
    int m, n, k;
    for (m = 0; m < m_rows; m++)
        for (n = 0; n < n_cols; n++) {
            float e = 0.0f, o = 0.0f, acc;
            for (k = 0; k < k_pairs && k < s->rows[b]; k++) {
                uint16_t ap[2], bp[2];
                memcpy(ap, s->data[a][m] + 4 * k, 4);
                memcpy(bp, s->data[b][k] + 4 * n, 4);
                e = mxfp4x_emu_ftz(
                    fmaf(mxfp4x_emu_bf16_daz(ap[0]), mxfp4x_emu_bf16_daz(bp[0]), e));
                o = mxfp4x_emu_ftz(
                    fmaf(mxfp4x_emu_bf16_daz(ap[1]), mxfp4x_emu_bf16_daz(bp[1]), o));
            }
            memcpy(&acc, mxfp4x_emu_tile_state.data[c][m] + 4 * n, 4);
            acc = mxfp4x_emu_ftz(acc + mxfp4x_emu_ftz(e + o));
            memcpy(mxfp4x_emu_tile_state.data[c][m] + 4 * n, &acc, 4);
        }
}

/* the intrinsics' names (GCC's are macros or inline functions; ours shadow both for all
 * code after this header) */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) mxfp4x_emu_tile_loadconfig(config)
#define _tile_release() mxfp4x_emu_tile_release()
#define _tile_zero(t) mxfp4x_emu_tile_zero(t)
#define _tile_loadd(t, base, stride) \
    mxfp4x_emu_tile_loadd((t), (const void *)(base), (int64_t)(stride))
#define _tile_stored(t, base, stride) \
    mxfp4x_emu_tile_stored((t), (void *)(base), (int64_t)(stride))
#define _tile_dpbf16ps(c, a, b) mxfp4x_emu_tile_dpbf16ps((c), (a), (b))

#endif /* MXFP4X_EMULATE_AMX_H */
