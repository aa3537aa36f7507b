/* tests/c/check_kernels.c -- the kernel table of this build, checked at the C level.
 *
 * Generic over include/mxfp4x/dispatch.h: whatever entries the build compiled
 * (scalar, avx2, avx512 on x86-64; neon, scalar on aarch64; ...) are checked, so the
 * same file runs natively, cross-compiled for aarch64 under qemu-aarch64
 * (tests/kernels/test_c_kernels.py) and in any other configuration of the headers.
 *
 * Per ISA (every runnable entry, or those named on the command line):
 *   decode          all 256 bytes x 256 scale bytes, bit for bit against the definition
 *                   (E2M1 x 2^(s-127), NaN for s = 255), through the entry's layout
 *   gemv            against a float64 reference, within the documented bound
 *                   (mxfp4x/_core/reference.py error_bound, float32 accumulation)
 *   panel_dot       decode + panel_dot, the same
 *   batch           bit-identity of every (row, token): one-token gemv calls, one
 *                   several-token call, two calls on split row ranges (thread split),
 *                   decode + panel_dot
 *   axpy_rows       against float64, within the bound; a column sub-range has the
 *                   same bits (vector body and tails agree)
 *   fz              flush-to-zero set by the caller (MXCSR FTZ|DAZ on x86-64, FPCR.FZ
 *                   on AArch64): under mxfp4x_fpenv_enter the scale byte 0 (2^-127)
 *                   still decodes and multiplies exactly; _exit restores the caller's
 *                   register bit for bit
 *   fma_loop        runs, counts its flops, returns a finite value (so does
 *                   bf16_dot_loop, where the entry has one)
 *   dense_bf16      dense bf16 rows x float32 tokens: against float64 within the bound;
 *                   one-token calls, the several-token call and split row ranges bit
 *                   for bit; widths off every lane count, zero and subnormal weights
 *   bf16            (entries with a bf16 unit: amx, avx512bf16) bf16 latents gathered
 *                   and multiplied by bf16_rows: against float64 within the bound, with
 *                   subnormal, tiny and huge latents and scale bytes 0, 1, 68, 69, 159,
 *                   160, 254, 255 among the rows (off the unit); every token alone,
 *                   the whole batch, counts each side of the unit's switch, 5 tokens
 *                   over last tiles of 2 and 3 rows, and tile-aligned split row ranges,
 *                   bit for bit; avx512bf16: every token forced off the unit gives the
 *                   same bits (its float32 path replays the unit where nothing is
 *                   subnormal) (gguf_bf16: GGUF blocks); a failure names which
 *   f64             the float64 path's decode_f64 (every byte x every scale byte, both
 *                   arrangements), panel_dot_f64 (1..7 tokens through permuted rows, row
 *                   counts off every block, padded strides, latents with 53-bit
 *                   significands) and axpy_rows_f64 (widths off the vector body): the
 *                   bits of scalar.h's kernels, which every entry must give
 *   attention       attention.h's path for the entry's ISA (AVX2, AVX-512, NEON or plain
 *                   C): the plain C path's bits and within the float32 bound of float64,
 *                   in float32, bf16 and f16, at head sizes and key counts off every
 *                   vector, grouped heads, the cache read through views, masked rows
 *   gguf_*          decode, gemv, panel_dot and batch again on llama.cpp's GGUF blocks
 *                   (17 bytes per group, the scale byte first; byte j holds elements j
 *                   and j+16), read in place: gguf_decode, gguf_gemv, gguf_panel,
 *                   gguf_batch
 * Cases: odd sizes (0..90 groups, chunk-crossing widths, row counts off every block
 * size, row_start > 0), 1..70 tokens through permuted rows, padded row / latent /
 * output strides; fixed seeds.
 *
 * Output: one line per (isa, check): "<isa> <check> <digest> ok|FAIL [detail]", the
 * digest a 64-bit FNV-1a of the output bits of the check's fixed-seed cases (NaN
 * hashed as one canonical NaN), so two builds of one ISA compare bit for bit; decode
 * digests are in natural element order and so equal across ISAs.  Lines starting
 * with '#' are information.  Exit status 1 on any failure, 2 on a usage error.
 *
 * Usage:  check_kernels [--list] [ISA...]
 *   --list   print "<name> runnable|not-runnable" per compiled entry, nothing else
 * Build:  cc -O2 -std=c11 -ffp-contract=off -Iinclude tests/c/check_kernels.c -lm
 *         (no -march, no fast-math: the SIMD code sits behind target attributes);
 *         with -DMXFP4X_EMULATE_AMX the amx entry runs on any AVX-512 (F, BW) CPU, its
 *         tile instructions in C (include/mxfp4x/emulate_amx.h)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mxfp4x/attention.h"
#include "mxfp4x/dispatch.h"

static int failures = 0;

/* ---- deterministic inputs: splitmix64 ------------------------------------------- */

static uint64_t rng_state;

static void seed(uint64_t s) { rng_state = s * 0x9E3779B97F4A7C15ull + 1; }

static uint64_t next_u64(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A float in (-2, 2) with a full 24-bit significand (exact integer arithmetic, so
 * every platform draws the same bits). */
static float next_float(void) {
    const int32_t m = (int32_t)(next_u64() >> 40) - (1 << 23);
    return (float)m / (float)(1 << 22);
}

/* ---- digest ------------------------------------------------------------------------ */

typedef struct {
    uint64_t h;
} digest;

static void digest_init(digest *d) { d->h = 0xCBF29CE484222325ull; }

static void digest_u32(digest *d, uint32_t v) {
    int i;
    for (i = 0; i < 4; i++) {
        d->h ^= (v >> (8 * i)) & 0xFFu;
        d->h *= 0x100000001B3ull;
    }
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static void digest_f32(digest *d, float f) {
    digest_u32(d, f != f ? 0x7FC00000u : f32_bits(f));
}

static void report(const char *isa, const char *check, const digest *d, int ok,
                   const char *detail) {
    printf("%-7s %-10s %016llx %s%s%s\n", isa, check, (unsigned long long)d->h,
           ok ? "ok" : "FAIL", detail && *detail ? " " : "", detail ? detail : "");
    if (!ok) failures++;
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* ---- the definition ---------------------------------------------------------------- */

/* Element i (natural order) of row r, as the spec defines it: in the pairs arrangement
 * byte j of a group holds elements 2j (low nibble) and 2j+1 (high); in the halves (GGUF)
 * one elements j (low) and j+16 (high).  Written from the spec, not from
 * mxfp4x_layout_pos. */
static double weight_ref(const mxfp4x_rows *w, int64_t r, int64_t i) {
    const int64_t g = i / MXFP4X_GROUP, j = i % MXFP4X_GROUP;
    const int halves = w->nibbles == MXFP4X_NIBBLES_HALVES;
    const uint8_t b = w->blocks[r * w->row_stride_blocks + g * w->group_stride_blocks +
                                (halves ? j % 16 : j / 2)];
    const int high = halves ? j >= 16 : (int)(j & 1);
    const int code = high ? b >> 4 : b & 0xF;
    const uint8_t s = w->scales[r * w->row_stride_scales + g * w->group_stride_scales];
    if (s == MXFP4X_E8M0_NAN) return NAN;
    return ldexp((double)mxfp4x_e2m1_f32[code], (int)s - MXFP4X_E8M0_BIAS);
}

/* The check's name for an arrangement: "decode" or "gguf_decode", ... */
static const char *named(const char *check, const char *gguf_check, int nibbles) {
    return nibbles == MXFP4X_NIBBLES_HALVES ? gguf_check : check;
}

/* mxfp4x/_core/reference.py error_bound(magnitude, n_terms, "float32"). */
static double error_bound(double magnitude, int64_t n_terms) {
    const double u = ldexp(1.0, -24), n = (double)n_terms;
    return n * u / (1 - n * u) * magnitude + n * ldexp(1.0, -150);
}

/* ---- decode: every byte x every scale byte, bit for bit ------------------------- */

static void check_decode(const mxfp4x_kernels *k, int nibbles) {
    /* row s: 16 groups holding the bytes 0..255 in order, all with scale byte s (GGUF:
     * each group a 17-byte block, the scale byte first) */
    const int64_t G = 16, d_in = G * MXFP4X_GROUP;
    const int gguf = nibbles == MXFP4X_NIBBLES_HALVES;
    const int64_t row_bytes = G * (gguf ? MXFP4X_GGUF_BLOCK_BYTES : MXFP4X_GROUP_BYTES);
    uint8_t *blocks = xcalloc(256 * row_bytes, 1), *scales = xcalloc(256 * G, 1);
    float *panel = xcalloc(256 * d_in, sizeof(float));
    mxfp4x_rows rows;
    digest d;
    int64_t s, i, g, bad = 0;
    char detail[160] = "";
    for (s = 0; s < 256; s++) {
        for (g = 0; g < G; g++) {
            uint8_t *blk = blocks + s * row_bytes + g * (gguf ? MXFP4X_GGUF_BLOCK_BYTES : 16);
            if (gguf) *blk++ = (uint8_t)s;
            for (i = 0; i < 16; i++) blk[i] = (uint8_t)(16 * g + i);
        }
        for (i = 0; i < G; i++) scales[s * G + i] = (uint8_t)s;
    }
    rows = gguf ? mxfp4x_rows_gguf(blocks, row_bytes, G)
                : mxfp4x_rows_split(blocks, scales, row_bytes, G, G);
    k->decode_f32(&rows, 0, 256, panel);
    digest_init(&d);
    for (s = 0; s < 256; s++)
        for (i = 0; i < d_in; i++) {
            const float got = panel[s * d_in + mxfp4x_layout_pos(i, k->layout_half, nibbles)];
            const double want = weight_ref(&rows, s, i);
            const int ok = want != want ? got != got : f32_bits(got) == f32_bits((float)want);
            const int64_t j = i % 32;
            digest_f32(&d, got);
            if (!ok && bad++ == 0)
                snprintf(detail, sizeof detail, "first mismatch: scale %d byte %d %s: got %a, "
                         "want %a", (int)s, (int)((i / 32) * 16 + (gguf ? j % 16 : j / 2)),
                         (gguf ? j >= 16 : j & 1) ? "hi" : "lo", (double)got, want);
    }
    if (bad) snprintf(detail + strlen(detail), sizeof detail - strlen(detail), " (%lld bad)",
                      (long long)bad);
    report(k->name, named("decode", "gguf_decode", nibbles), &d, bad == 0, detail);
    free(blocks);
    free(scales);
    free(panel);
}

/* ---- gemv / panel_dot / batch invariance --------------------------------------------- */

typedef struct {
    int64_t n_rows, row_start, n_groups, n_tok;
} mv_case;

static const mv_case mv_cases[] = {
    {1, 0, 1, 1},   {5, 1, 3, 2},   {13, 2, 17, 3},  {50, 3, 5, 70}, {9, 0, 40, 9},
    {37, 5, 2, 33}, {6, 0, 16, 4},  {64, 0, 3, 5},   {4, 0, 0, 5},   {48, 0, 90, 12},
    {11, 4, 7, 1},  {23, 0, 1, 64}, {3, 0, 33, 7},  {14, 0, 5, 13}, {12, 1, 0, 3},
};
#define N_MV_CASES ((int)(sizeof mv_cases / sizeof mv_cases[0]))

typedef struct {
    digest gemv, panel, batch;
    int gemv_ok, panel_ok, batch_ok;
    double gemv_worst, panel_worst;
    char gemv_why[200], panel_why[200], batch_why[200];
} mv_result;

static void compare_bound(const float *got, const double *ref, const double *mag,
                          int64_t n_terms, int64_t n_tok, int64_t n_out, int64_t out_stride,
                          digest *d, int *ok, double *worst, char *why, const char *what,
                          int case_no) {
    int64_t t, r;
    for (t = 0; t < n_tok; t++)
        for (r = 0; r < n_out; r++) {
            const float g = got[t * out_stride + r];
            const double want = ref[t * n_out + r];
            const double bound = error_bound(mag[t * n_out + r], n_terms);
            const double err = fabs((double)g - want);
            digest_f32(d, g);
            if (bound > 0 && err / bound > *worst) *worst = err / bound;
            if (!(err <= bound) && *ok) {
                *ok = 0;
                snprintf(why, 200, "case %d %s row %lld token %lld: got %.9g want %.17g "
                         "bound %.3g", case_no, what, (long long)r, (long long)t, (double)g,
                         want, bound);
            }
        }
}

static void compare_bits(const float *a, const float *b, int64_t n_tok, int64_t n_out,
                         int64_t out_stride, digest *d, int *ok, char *why, const char *what,
                         int case_no) {
    int64_t t, r;
    for (t = 0; t < n_tok; t++)
        for (r = 0; r < n_out; r++) {
            const uint32_t x = f32_bits(a[t * out_stride + r]);
            const uint32_t y = f32_bits(b[t * out_stride + r]);
            digest_u32(d, y);
            if (x != y && *ok) {
                *ok = 0;
                snprintf(why, 200, "case %d %s row %lld token %lld: %08x vs gemv %08x",
                         case_no, what, (long long)r, (long long)t, (unsigned)y, (unsigned)x);
            }
        }
}

static void run_mv_case(const mxfp4x_kernels *k, int case_no, int nibbles, mv_result *res) {
    const mv_case *c = &mv_cases[case_no];
    const int gguf = nibbles == MXFP4X_NIBBLES_HALVES;
    const int64_t G = c->n_groups, d_in = G * MXFP4X_GROUP;
    const int64_t n_rows = c->n_rows, row_start = c->row_start, row_end = c->n_rows;
    const int64_t n_out = row_end - row_start, n_tok = c->n_tok;
    /* padded rows; GGUF: one buffer of 17-byte blocks (sb bytes per row) */
    const int64_t sb = G * (gguf ? MXFP4X_GGUF_BLOCK_BYTES : MXFP4X_GROUP_BYTES) + 16 * 3 + 5;
    const int64_t ss = G + 7;
    const int64_t n_x = n_tok + 5, x_stride = d_in + 12, out_stride = n_out + 3;
    uint8_t *blocks = xcalloc(n_rows * sb, 1), *scales = xcalloc(n_rows * ss, 1);
    float *x_nat = xcalloc(n_x * d_in, sizeof(float));
    float *x = xcalloc(n_x * x_stride, sizeof(float));
    int64_t *x_rows = xcalloc(n_tok, sizeof(int64_t));
    double *ref = xcalloc(n_tok * n_out, sizeof(double));
    double *mag = xcalloc(n_tok * n_out, sizeof(double));
    double *w_nat = xcalloc(n_out * d_in, sizeof(double));
    float *out_multi = xcalloc(n_tok * out_stride, sizeof(float));
    float *out_one = xcalloc(n_tok * out_stride, sizeof(float));
    float *out_split = xcalloc(n_tok * out_stride, sizeof(float));
    float *out_panel = xcalloc(n_tok * out_stride, sizeof(float));
    float *panel = xcalloc(n_out * d_in, sizeof(float));
    float *scratch = xcalloc((size_t)k->panel_scratch_floats(n_out) + 1, sizeof(float));
    mxfp4x_rows rows, hinted;
    int64_t r, t, i;
    const int64_t mid = row_start + n_out / 2 + (n_out > 2 ? 1 : 0);

    seed(1000 + (uint64_t)case_no + (gguf ? 500 : 0));
    for (i = 0; i < n_rows * sb; i++) blocks[i] = (uint8_t)next_u64();
    for (i = 0; i < n_rows * ss; i++) {
        const uint64_t u = next_u64();
        /* mostly moderate scales; now and then 0 (2^-127, subnormal weights) */
        scales[i] = (u & 63) == 0 ? 0 : (uint8_t)(118 + (u >> 8) % 17);
    }
    if (gguf) { /* the scale bytes inside the blocks */
        for (r = 0; r < n_rows; r++)
            for (i = 0; i < G; i++)
                blocks[r * sb + i * MXFP4X_GGUF_BLOCK_BYTES] = scales[r * ss + i];
        rows = mxfp4x_rows_gguf(blocks, sb, G);
    } else {
        rows = mxfp4x_rows_split(blocks, scales, sb, ss, G);
    }
    for (i = 0; i < n_x * d_in; i++) x_nat[i] = next_float();
    for (t = 0; t < n_x; t++)
        for (i = 0; i < d_in; i++)
            x[t * x_stride + mxfp4x_layout_pos(i, k->layout_half, nibbles)] =
                x_nat[t * d_in + i];
    for (t = 0; t < n_tok; t++) x_rows[t] = (t * 7 + 3) % n_x;
    for (i = 0; i < n_tok * out_stride; i++)
        out_multi[i] = out_one[i] = out_split[i] = out_panel[i] = -1.0f;

    /* the float64 reference and the magnitude sum |W||x| */
    for (r = row_start; r < row_end; r++)
        for (i = 0; i < d_in; i++)
            w_nat[(r - row_start) * d_in + i] = weight_ref(&rows, r, i);
    for (t = 0; t < n_tok; t++)
        for (r = 0; r < n_out; r++) {
            const float *xt = x_nat + x_rows[t] * d_in;
            double s = 0, m = 0;
            for (i = 0; i < d_in; i++) {
                s += w_nat[r * d_in + i] * xt[i];
                m += fabs(w_nat[r * d_in + i] * xt[i]);
            }
            ref[t * n_out + r] = s;
            mag[t * n_out + r] = m;
        }

    /* several tokens in one call; one call per token; two row ranges (a thread split) */
    k->gemv_f32(&rows, row_start, row_end, x, x_stride, x_rows, n_tok, out_multi, out_stride);
    /* ... each with the prefetch hints (mxfp4x_rows.next_*, pf_far), which change no bit */
    hinted = rows;
    hinted.next_blocks = rows.blocks + (n_rows - 1) * sb;
    hinted.next_scales = rows.scales + (n_rows - 1) * ss;
    hinted.pf_far = 1;
    for (t = 0; t < n_tok; t++)
        k->gemv_f32(t % 2 ? &hinted : &rows, row_start, row_end, x, x_stride, x_rows + t, 1,
                    out_one + t * out_stride, out_stride);
    hinted.pf_far = 0;
    k->gemv_f32(&hinted, row_start, mid, x, x_stride, x_rows, n_tok, out_split, out_stride);
    k->gemv_f32(&hinted, mid, row_end, x, x_stride, x_rows, n_tok,
                out_split + (mid - row_start), out_stride);
    /* decode + panel_dot */
    k->decode_f32(&rows, row_start, row_end, panel);
    k->panel_dot_f32(panel, n_out, G, x, x_stride, x_rows, n_tok, out_panel, out_stride,
                     scratch);

    compare_bound(out_multi, ref, mag, d_in, n_tok, n_out, out_stride, &res->gemv,
                  &res->gemv_ok, &res->gemv_worst, res->gemv_why, "gemv", case_no);
    compare_bound(out_panel, ref, mag, d_in, n_tok, n_out, out_stride, &res->panel,
                  &res->panel_ok, &res->panel_worst, res->panel_why, "panel_dot", case_no);
    compare_bits(out_multi, out_one, n_tok, n_out, out_stride, &res->batch, &res->batch_ok,
                 res->batch_why, "one-token gemv", case_no);
    compare_bits(out_multi, out_split, n_tok, n_out, out_stride, &res->batch, &res->batch_ok,
                 res->batch_why, "split-rows gemv", case_no);
    compare_bits(out_multi, out_panel, n_tok, n_out, out_stride, &res->batch, &res->batch_ok,
                 res->batch_why, "panel_dot", case_no);

    free(blocks); free(scales); free(x_nat); free(x); free(x_rows); free(ref); free(mag);
    free(w_nat); free(out_multi); free(out_one); free(out_split); free(out_panel);
    free(panel); free(scratch);
}

static void check_mv(const mxfp4x_kernels *k, int nibbles) {
    mv_result res;
    int i;
    char detail[260];
    memset(&res, 0, sizeof res);
    digest_init(&res.gemv);
    digest_init(&res.panel);
    digest_init(&res.batch);
    res.gemv_ok = res.panel_ok = res.batch_ok = 1;
    for (i = 0; i < N_MV_CASES; i++) run_mv_case(k, i, nibbles, &res);
    snprintf(detail, sizeof detail, "worst err/bound %.3g%s%s", res.gemv_worst,
             *res.gemv_why ? " " : "", res.gemv_why);
    report(k->name, named("gemv", "gguf_gemv", nibbles), &res.gemv, res.gemv_ok, detail);
    snprintf(detail, sizeof detail, "worst err/bound %.3g%s%s", res.panel_worst,
             *res.panel_why ? " " : "", res.panel_why);
    report(k->name, named("panel_dot", "gguf_panel", nibbles), &res.panel, res.panel_ok,
           detail);
    report(k->name, named("batch", "gguf_batch", nibbles), &res.batch, res.batch_ok,
           res.batch_why);
}

/* ---- axpy_rows ---------------------------------------------------------------------- */

static void check_axpy(const mxfp4x_kernels *k) {
    static const int64_t cases[][2] = {{1, 1},  {3, 5},   {32, 256}, {7, 87},
                                       {17, 133}, {0, 10}, {9, 151},  {2, 64}};
    const int n_cases = (int)(sizeof cases / sizeof cases[0]);
    digest d;
    int ok = 1, ci;
    double worst = 0;
    char why[200] = "", detail[260];
    digest_init(&d);
    for (ci = 0; ci < n_cases; ci++) {
        const int64_t n_rows = cases[ci][0], width = cases[ci][1], off = 1;
        const int64_t sub = width - off;
        float *panel = xcalloc(n_rows * width, sizeof(float));
        float *sub_panel = xcalloc(n_rows * sub, sizeof(float));
        float *coef = xcalloc(n_rows, sizeof(float));
        float *dst = xcalloc(width, sizeof(float)), *dst0 = xcalloc(width, sizeof(float));
        float *dst_sub = xcalloc(sub, sizeof(float));
        int64_t r, j;
        seed(5000 + (uint64_t)ci);
        for (j = 0; j < n_rows * width; j++) panel[j] = next_float();
        for (r = 0; r < n_rows; r++) coef[r] = next_float();
        for (j = 0; j < width; j++) dst[j] = dst0[j] = next_float();
        for (r = 0; r < n_rows; r++)
            for (j = 0; j < sub; j++) sub_panel[r * sub + j] = panel[r * width + off + j];
        for (j = 0; j < sub; j++) dst_sub[j] = dst0[off + j];
        k->axpy_rows_f32(panel, n_rows, width, coef, dst);
        k->axpy_rows_f32(sub_panel, n_rows, sub, coef, dst_sub);
        for (j = 0; j < width; j++) {
            double s = dst0[j], m = fabs((double)dst0[j]), err, bound;
            for (r = 0; r < n_rows; r++) {
                s += (double)coef[r] * panel[r * width + j];
                m += fabs((double)coef[r] * panel[r * width + j]);
            }
            err = fabs((double)dst[j] - s);
            bound = error_bound(m, n_rows + 1);
            digest_f32(&d, dst[j]);
            if (bound > 0 && err / bound > worst) worst = err / bound;
            if (!(err <= bound) && ok) {
                ok = 0;
                snprintf(why, sizeof why, "case %d column %lld: got %.9g want %.17g", ci,
                         (long long)j, (double)dst[j], s);
            }
            if (j >= off && f32_bits(dst_sub[j - off]) != f32_bits(dst[j]) && ok) {
                ok = 0;
                snprintf(why, sizeof why, "case %d column %lld: %08x at offset %lld, %08x in "
                         "the full call", ci, (long long)j, (unsigned)f32_bits(dst_sub[j - off]),
                         (long long)off, (unsigned)f32_bits(dst[j]));
            }
        }
        free(panel); free(sub_panel); free(coef); free(dst); free(dst0); free(dst_sub);
    }
    snprintf(detail, sizeof detail, "worst err/bound %.3g%s%s", worst, *why ? " " : "", why);
    report(k->name, "axpy_rows", &d, ok, detail);
}

/* ---- the float64 path: the entry's kernels against scalar.h's, bit for bit -------- */

static double next_double(void) { /* in (-2, 2), a full 53-bit significand */
    const int64_t m = (int64_t)(next_u64() >> 10) - ((int64_t)1 << 53);
    return (double)m / (double)((int64_t)1 << 52);
}

static void digest_f64(digest *d, double v) {
    uint64_t u;
    memcpy(&u, &v, 8);
    if (v != v) u = 0x7FF8000000000000ull;
    digest_u32(d, (uint32_t)u);
    digest_u32(d, (uint32_t)(u >> 32));
}

/* The first of n doubles whose bits differ, or -1. */
static int64_t f64_mismatch(const double *a, const double *b, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++)
        if (memcmp(a + i, b + i, 8) != 0) return i;
    return -1;
}

static void check_f64(const mxfp4x_kernels *k) {
    digest d;
    int ok = 1, nib, ci;
    char why[200] = "";
    digest_init(&d);
    /* decode: rows of 16 groups, every byte value once per row (bytes b + 16 j), every
     * scale byte, both arrangements */
    for (nib = 0; nib < 2 && ok; nib++) {
        const int64_t n_groups = 16, n_rows = 256, d_in = n_groups * MXFP4X_GROUP;
        const int halves = nib == 1;
        const int64_t gstride = halves ? MXFP4X_GGUF_BLOCK_BYTES : MXFP4X_GROUP_BYTES;
        uint8_t *blocks = xcalloc(n_rows * n_groups * gstride, 1);
        uint8_t *scales = xcalloc(n_rows * n_groups, 1);
        double *got = xcalloc(n_rows * d_in, sizeof(double));
        double *want = xcalloc(n_rows * d_in, sizeof(double));
        mxfp4x_rows w;
        int64_t r, g, j, bad;
        for (r = 0; r < n_rows; r++)
            for (g = 0; g < n_groups; g++) {
                uint8_t *b = blocks + (r * n_groups + g) * gstride;
                if (halves) *b++ = (uint8_t)r;
                else scales[r * n_groups + g] = (uint8_t)r;
                for (j = 0; j < 16; j++) b[j] = (uint8_t)(16 * j + g + r);
            }
        w = halves ? mxfp4x_rows_gguf(blocks, n_groups * gstride, n_groups)
                   : mxfp4x_rows_split(blocks, scales, n_groups * gstride, n_groups, n_groups);
        k->decode_f64(&w, 0, n_rows, got);
        mxfp4x_decode_f64(&w, 0, n_rows, want);
        for (j = 0; j < n_rows * d_in; j++) digest_f64(&d, got[j]);
        bad = f64_mismatch(got, want, n_rows * d_in);
        if (bad >= 0) {
            ok = 0;
            snprintf(why, sizeof why, "decode (%s) element %lld: %a, scalar.h %a",
                     halves ? "halves" : "pairs", (long long)bad, got[bad], want[bad]);
        }
        free(blocks); free(scales); free(got); free(want);
    }
    /* panel_dot: panels of random doubles, tokens through permuted rows, padded strides */
    for (ci = 0; ci < 24 && ok; ci++) {
        const int64_t n_groups = 1 + ci % 5, n_rows = 1 + (ci * 7) % 21, n_tok = 1 + ci % 7;
        const int64_t d_in = n_groups * MXFP4X_GROUP, x_stride = d_in + 3;
        const int64_t n_x = n_tok + 2, out_stride = n_rows + 5;
        double *panel = xcalloc(n_rows * d_in, sizeof(double));
        double *x = xcalloc(n_x * x_stride, sizeof(double));
        double *got = xcalloc(n_tok * out_stride, sizeof(double));
        double *want = xcalloc(n_tok * out_stride, sizeof(double));
        int64_t x_rows[8], i, bad;
        seed(7000 + (uint64_t)ci);
        for (i = 0; i < n_rows * d_in; i++) panel[i] = ldexp(next_double(), (int)(i % 7) - 3);
        for (i = 0; i < n_x * x_stride; i++) x[i] = next_double();
        for (i = 0; i < n_tok; i++) x_rows[i] = (i * 5 + ci) % n_x;
        k->panel_dot_f64(panel, n_rows, n_groups, x, x_stride, x_rows, n_tok, got, out_stride);
        mxfp4x_panel_dot_f64(panel, n_rows, n_groups, x, x_stride, x_rows, n_tok, want,
                             out_stride);
        for (i = 0; i < n_tok * out_stride; i++) digest_f64(&d, got[i]);
        bad = f64_mismatch(got, want, n_tok * out_stride);
        if (bad >= 0) {
            ok = 0;
            snprintf(why, sizeof why, "panel_dot case %d (%lld rows, %lld tokens) output "
                     "%lld: %a, scalar.h %a", ci, (long long)n_rows, (long long)n_tok,
                     (long long)bad, got[bad], want[bad]);
        }
        free(panel); free(x); free(got); free(want);
    }
    /* axpy_rows: widths off the 32-column body */
    for (ci = 0; ci < 8 && ok; ci++) {
        static const int64_t cases[][2] = {{1, 1},   {3, 5},   {32, 256}, {7, 87},
                                           {17, 133}, {0, 10}, {9, 151},  {2, 64}};
        const int64_t n_rows = cases[ci][0], width = cases[ci][1];
        double *panel = xcalloc(n_rows * width, sizeof(double));
        double *coef = xcalloc(n_rows, sizeof(double));
        double *got = xcalloc(width, sizeof(double)), *want = xcalloc(width, sizeof(double));
        int64_t i, bad;
        seed(8000 + (uint64_t)ci);
        for (i = 0; i < n_rows * width; i++) panel[i] = next_double();
        for (i = 0; i < n_rows; i++) coef[i] = next_double();
        for (i = 0; i < width; i++) got[i] = want[i] = next_double();
        k->axpy_rows_f64(panel, n_rows, width, coef, got);
        mxfp4x_axpy_rows_f64(panel, n_rows, width, coef, want);
        for (i = 0; i < width; i++) digest_f64(&d, got[i]);
        bad = f64_mismatch(got, want, width);
        if (bad >= 0) {
            ok = 0;
            snprintf(why, sizeof why, "axpy_rows case %d column %lld: %a, scalar.h %a", ci,
                     (long long)bad, got[bad], want[bad]);
        }
        free(panel); free(coef); free(got); free(want);
    }
    report(k->name, "f64", &d, ok, why);
}

/* ---- dense bf16 rows x float32 tokens ----------------------------------------------- */

/* Against float64 within the bound; bit-identity of every (row, token) across one-token
 * calls, the several-token call and a split of the rows (batch and thread invariance);
 * padded strides; widths off every lane count; zero, subnormal and large values.  Where
 * the entry has dense_bf16x: bf16 tokens (subnormals among them) give, one token at a
 * time and in a split of the rows, with the weights 0, 2, 6, 40 and 1 bytes into a cache
 * line, the bits of dense_bf16 on them widened (the digest takes the one-token bits). */
static void check_dense(const mxfp4x_kernels *k) {
    static const int64_t cases[][3] = {/* rows, tokens, d_in */
                                       {1, 1, 1},   {5, 1, 7},   {4, 4, 16},  {9, 3, 17},
                                       {7, 6, 33},  {13, 5, 100}, {3, 9, 257}, {6, 2, 0},
                                       {11, 7, 64}, {2, 1, 1031}, {9, 4, 29}, {10, 7, 61}};
    const int n_cases = (int)(sizeof cases / sizeof cases[0]);
    digest d;
    int ok = 1, ci;
    double worst = 0;
    char why[200] = "", detail[260];
    digest_init(&d);
    for (ci = 0; ci < n_cases; ci++) {
        const int64_t n_rows = cases[ci][0], n_tok = cases[ci][1], d_in = cases[ci][2];
        const int64_t rs = d_in + 3, xs = d_in + 5, os = n_rows + 2, split = n_rows / 2;
        uint16_t *w = xcalloc(n_rows * rs + 1, sizeof(uint16_t));
        float *x = xcalloc(n_tok * xs + 1, sizeof(float));
        float *out = xcalloc(n_tok * os, sizeof(float));
        float *one = xcalloc(n_rows, sizeof(float)), *part = xcalloc(n_tok * os, sizeof(float));
        int64_t r, t, i;
        seed(7000 + (uint64_t)ci);
        for (i = 0; i < n_rows * rs; i++) {
            const uint32_t u = f32_bits(next_float() * 8.0f);
            const uint64_t pick = next_u64() % 16;
            /* bf16 bits: mostly the top half of a float, some zeros, subnormals, +-0 */
            w[i] = pick == 0 ? 0 : pick == 1 ? 0x8000 : pick == 2 ? (uint16_t)(next_u64() & 0x807F)
                                                                    : (uint16_t)(u >> 16);
        }
        for (i = 0; i < n_tok * xs; i++) x[i] = next_float();
        k->dense_bf16(w, rs, 0, n_rows, d_in, x, xs, n_tok, out, os);
        k->dense_bf16(w, rs, 0, split, d_in, x, xs, n_tok, part, os);
        k->dense_bf16(w, rs, split, n_rows, d_in, x, xs, n_tok, part + split, os);
        for (t = 0; t < n_tok; t++) {
            k->dense_bf16(w, rs, 0, n_rows, d_in, x + t * xs, xs, 1, one, n_rows);
            for (r = 0; r < n_rows; r++) {
                double s = 0, m = 0, err, bound;
                const float got = out[t * os + r];
                for (i = 0; i < d_in; i++) {
                    const double p = (double)mxfp4x_bf16_to_f32(w[r * rs + i]) * x[t * xs + i];
                    s += p;
                    m += fabs(p);
                }
                err = fabs((double)got - s);
                bound = error_bound(m, d_in);
                digest_f32(&d, got);
                if (bound > 0 && err / bound > worst) worst = err / bound;
                if (!(err <= bound) && ok) {
                    ok = 0;
                    snprintf(why, sizeof why, "case %d row %lld token %lld: got %.9g want %.17g",
                             ci, (long long)r, (long long)t, (double)got, s);
                }
                if ((f32_bits(one[r]) != f32_bits(got) || f32_bits(part[t * os + r]) !=
                     f32_bits(got)) && ok) {
                    ok = 0;
                    snprintf(why, sizeof why, "case %d row %lld token %lld: %08x one token, "
                             "%08x split rows, %08x in the full call", ci, (long long)r,
                             (long long)t, (unsigned)f32_bits(one[r]),
                             (unsigned)f32_bits(part[t * os + r]), (unsigned)f32_bits(got));
                }
            }
        }
        if (k->dense_bf16x) { /* bf16 tokens: the bits of the same tokens widened, with
                                * the weights at several byte offsets of a cache line */
            static const int shifts[] = {0, 2, 6, 40, 1};
            const size_t w_bytes = (size_t)(n_rows * rs) * sizeof(uint16_t);
            uint16_t *xb = xcalloc(n_tok * xs + 1, sizeof(uint16_t));
            uint8_t *raw = xcalloc(w_bytes + 128, 1);
            int si;
            for (i = 0; i < n_tok * xs; i++) {
                const uint64_t pick = next_u64() % 16;
                xb[i] = pick == 0 ? (uint16_t)(next_u64() & 0x807F) /* subnormal or zero */
                                  : (uint16_t)(f32_bits(next_float() * 4.0f) >> 16);
                x[i] = mxfp4x_bf16_to_f32(xb[i]);
            }
            k->dense_bf16(w, rs, 0, n_rows, d_in, x, xs, n_tok, out, os);
            for (si = 0; si < (int)(sizeof shifts / sizeof shifts[0]); si++) {
                uint16_t *wp = (uint16_t *)(void *)(raw + ((64 - ((uintptr_t)raw & 63)) & 63) +
                                                    shifts[si]);
                memcpy(wp, w, w_bytes);
                k->dense_bf16x(wp, rs, 0, split, d_in, xb, xs, n_tok, part, os);
                k->dense_bf16x(wp, rs, split, n_rows, d_in, xb, xs, n_tok, part + split, os);
                for (t = 0; t < n_tok; t++) {
                    k->dense_bf16x(wp, rs, 0, n_rows, d_in, xb + t * xs, xs, 1, one, n_rows);
                    for (r = 0; r < n_rows; r++) {
                        const float got = out[t * os + r];
                        if (si == 0) digest_f32(&d, one[r]);
                        if ((f32_bits(one[r]) != f32_bits(got) ||
                             f32_bits(part[t * os + r]) != f32_bits(got)) && ok) {
                            ok = 0;
                            snprintf(why, sizeof why, "case %d row %lld token %lld, weights %d "
                                     "bytes into a line: bf16 tokens %08x one token, %08x "
                                     "split rows, %08x widened", ci, (long long)r,
                                     (long long)t, shifts[si], (unsigned)f32_bits(one[r]),
                                     (unsigned)f32_bits(part[t * os + r]),
                                     (unsigned)f32_bits(got));
                        }
                    }
                }
            }
            free(xb);
            free(raw);
        }
        free(w); free(x); free(out); free(one); free(part);
    }
    snprintf(detail, sizeof detail, "worst err/bound %.3g%s%s", worst, *why ? " " : "", why);
    report(k->name, "dense_bf16", &d, ok, detail);
}

/* ---- flush-to-zero -------------------------------------------------------------------- */

#if MXFP4X_ARCH_X86_64
#define FZ_NAME "MXCSR"
#define FZ_BITS (MXFP4X_MXCSR_FTZ | MXFP4X_MXCSR_DAZ)
#define FZ_MUST FZ_BITS
static unsigned long long fz_read(void) { return _mm_getcsr(); }
static void fz_write(unsigned long long v) { _mm_setcsr((unsigned int)v); }
#define HAVE_FZ 1
#elif (defined(__aarch64__) || defined(__arm64__)) && MXFP4X_GNUC
#define FZ_NAME "FPCR"
#define FZ_BITS ((1ull << 24) | 1ull) /* FZ and FIZ */
#define FZ_MUST (1ull << 24) /* FZ; FIZ (bit 0) reads back 0 without FEAT_AFP (QEMU 7.2) */
static unsigned long long fz_read(void) {
    unsigned long long v;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(v) : : "memory");
    return v;
}
static void fz_write(unsigned long long v) {
    __asm__ __volatile__("msr fpcr, %0" : : "r"(v) : "memory");
}
#define HAVE_FZ 1
#else
#define HAVE_FZ 0
#endif

#if HAVE_FZ
/* Every kernel on a row of scale byte 0 (2^-127: decoded weights 2^-128 .. 1.5*2^-125,
 * float32 subnormals or tiny normals): all products and sums are exact, so the
 * results must equal the float64 values in any order of operations. */
#define FZ_G 2
#define FZ_D (FZ_G * MXFP4X_GROUP)
typedef struct {
    float panel[FZ_D], gemv1, gemv2[2], dot[2], axpy[FZ_D];
} fz_out;

static void fz_run(const mxfp4x_kernels *k, const mxfp4x_rows *rows, const float *x,
                   const int64_t *x_rows, const float *coef, fz_out *o) {
    float *scratch = xcalloc((size_t)k->panel_scratch_floats(1) + 1, sizeof(float));
    int j;
    k->decode_f32(rows, 0, 1, o->panel);
    k->gemv_f32(rows, 0, 1, x, FZ_D, x_rows, 1, &o->gemv1, 1);
    k->gemv_f32(rows, 0, 1, x, FZ_D, x_rows, 2, o->gemv2, 1);
    k->panel_dot_f32(o->panel, 1, FZ_G, x, FZ_D, x_rows, 2, o->dot, 1, scratch);
    for (j = 0; j < FZ_D; j++) o->axpy[j] = 0.0f;
    k->axpy_rows_f32(o->panel, 1, FZ_D, coef, o->axpy);
    free(scratch);
}

static void check_fz(const mxfp4x_kernels *k) {
    uint8_t blocks[FZ_G * MXFP4X_GROUP_BYTES], scales[FZ_G] = {0, 0};
    float x[2 * FZ_D], coef[1] = {0.75f};
    int64_t x_rows[2] = {0, 1};
    double want_w[FZ_D], want_dot[2] = {0, 0};
    mxfp4x_rows rows;
    fz_out guarded, bare;
    unsigned long long before, caller, inside = 0, after;
    mxfp4x_fpenv env;
    int i, ok = 1, flushed_bare = 0;
    digest d;
    char why[240] = "";
    for (i = 0; i < FZ_G * MXFP4X_GROUP_BYTES; i++) blocks[i] = (uint8_t)(i * 37 + 11);
    for (i = 0; i < FZ_D; i++) {
        x[i] = 1.0f;
        x[FZ_D + i] = (i & 1) ? 0.75f : -1.25f;
    }
    rows = mxfp4x_rows_split(blocks, scales, sizeof blocks, FZ_G, FZ_G);
    for (i = 0; i < FZ_D; i++) want_w[i] = weight_ref(&rows, 0, i);
    for (i = 0; i < FZ_D; i++) {
        const int p = (int)mxfp4x_layout_pos(i, k->layout_half, rows.nibbles);
        want_dot[0] += want_w[i] * x[p];
        want_dot[1] += want_w[i] * x[FZ_D + p];
    }

    before = fz_read();
    fz_write(before | FZ_BITS); /* the caller turned flush-to-zero on */
    caller = fz_read();
    fz_run(k, &rows, x, x_rows, coef, &bare); /* control: no guard */
    env = mxfp4x_fpenv_enter();
    inside = fz_read();
    fz_run(k, &rows, x, x_rows, coef, &guarded);
    mxfp4x_fpenv_exit(env);
    after = fz_read();
    fz_write(before);

    digest_init(&d);
    for (i = 0; i < FZ_D; i++) {
        const int p = (int)mxfp4x_layout_pos(i, k->layout_half, rows.nibbles);
        digest_f32(&d, guarded.panel[p]);
        if (f32_bits(guarded.panel[p]) != f32_bits((float)want_w[i]) && ok) {
            ok = 0;
            snprintf(why, sizeof why, "decode element %d: %a, want %a", i,
                     (double)guarded.panel[p], want_w[i]);
        }
        if (guarded.axpy[p] != (float)(0.75 * want_w[i]) && ok) {
            ok = 0;
            snprintf(why, sizeof why, "axpy_rows column %d: %a, want %a", i,
                     (double)guarded.axpy[p], 0.75 * want_w[i]);
        }
        if (want_w[i] != 0 && bare.panel[p] == 0) flushed_bare = 1;
    }
    digest_f32(&d, guarded.gemv1);
    digest_f32(&d, guarded.gemv2[0]);
    digest_f32(&d, guarded.gemv2[1]);
    digest_f32(&d, guarded.dot[0]);
    digest_f32(&d, guarded.dot[1]);
    if (ok && (guarded.gemv1 != (float)want_dot[0] || guarded.gemv2[0] != (float)want_dot[0] ||
               guarded.gemv2[1] != (float)want_dot[1] || guarded.dot[0] != (float)want_dot[0] ||
               guarded.dot[1] != (float)want_dot[1])) {
        ok = 0;
        snprintf(why, sizeof why, "dots %a %a %a %a %a, want %a %a", (double)guarded.gemv1,
                 (double)guarded.gemv2[0], (double)guarded.gemv2[1], (double)guarded.dot[0],
                 (double)guarded.dot[1], want_dot[0], want_dot[1]);
    }
    if (want_dot[0] == 0 || fabs(want_dot[0]) >= ldexp(1.0, -120)) {
        ok = 0; /* the case itself must be tiny and nonzero */
        snprintf(why, sizeof why, "bad case: want %a", want_dot[0]);
    }
    if ((caller & FZ_MUST) != FZ_MUST || (inside & FZ_BITS) != 0 || after != caller) {
        ok = 0;
        snprintf(why, sizeof why, FZ_NAME " caller %#llx inside %#llx after %#llx", caller,
                 inside, after);
    }
    {
        char detail[320];
        snprintf(detail, sizeof detail, "(%s %#llx -> %#llx in the guard -> %#llx; unguarded "
                 "control %s)%s%s", FZ_NAME, caller, inside, after,
                 flushed_bare ? "flushed" : "NOT flushed", *why ? " " : "", why);
        report(k->name, "fz", &d, ok, detail);
    }
}
#else
static void check_fz(const mxfp4x_kernels *k) {
    digest d;
    digest_init(&d);
    report(k->name, "fz", &d, 1, "(skipped: no flush-to-zero control known on this "
           "architecture)");
}
#endif

static void check_fma_loop(const mxfp4x_kernels *k) {
    int64_t flops = 0;
    const float v = k->fma_loop(1000, 1.0f, &flops);
    digest d;
    char detail[80];
    digest_init(&d);
    digest_f32(&d, v);
    snprintf(detail, sizeof detail, "flops=%lld", (long long)flops);
    report(k->name, "fma_loop", &d, flops > 0 && v == v && fabsf(v) < 1e30f, detail);
    if (k->bf16_dot_loop != NULL) { /* the bf16 unit's peak loop, where the entry has one */
        const float u = k->bf16_dot_loop(1000, 1.0f, &flops);
        digest_init(&d);
        digest_f32(&d, u);
        snprintf(detail, sizeof detail, "flops=%lld", (long long)flops);
        report(k->name, "bf16_dot_loop", &d, flops > 0 && u == u && fabsf(u) < 1e30f, detail);
    }
}

/* ---- bf16 latents on the entry's bf16 unit ---------------------------------------- */

static uint16_t bf16_of(float f) { /* truncated: any bf16 will do */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* out (n_tok x n_rows) = rows [0, n_rows) . the tokens src[0..n_tok) of x, through the
 * gather and bf16_rows in tile-aligned row ranges from row r_split on (0: one call); with
 * force_small every token flagged as holding small values (sent off the unit). */
static void bf16_run(const mxfp4x_kernels *k, const mxfp4x_rows *w, int64_t n_rows,
                     const uint16_t *x, int64_t d_in, const int64_t *src, int64_t n_tok,
                     int64_t r_split, float *out, int force_small) {
    const int64_t G = w->n_groups;
    uint16_t *xt = (uint16_t *)aligned_alloc(64, (size_t)((n_tok * d_in * 2 + 64 + 63) / 64 * 64));
    uint8_t *unsafe = (uint8_t *)xcalloc((size_t)n_tok + 1, 1);
    void *scratch = xcalloc((size_t)k->bf16_scratch_bytes(G), 1);
    float *part = (float *)xcalloc((size_t)(n_tok * n_rows), sizeof(float));
    int64_t r0, r1, t, r;
    if (!xt) exit(2);
    k->bf16_gather(x, d_in, src, n_tok, G, w->nibbles, xt, unsafe);
    for (t = 0; force_small && t < n_tok; t++) unsafe[t] |= MXFP4X_BF16_SMALL;
    for (r0 = 0; r0 < n_rows; r0 = r1) {
        r1 = r_split > 0 && r0 + r_split < n_rows ? r0 + r_split : n_rows;
        k->bf16_rows(w, r0, r1, xt, unsafe, n_tok, part, r1 - r0, scratch);
        for (t = 0; t < n_tok; t++)
            for (r = r0; r < r1; r++) out[t * n_rows + r] = part[t * (r1 - r0) + r - r0];
    }
    free(xt);
    free(unsafe);
    free(scratch);
    free(part);
}

static void check_bf16(const mxfp4x_kernels *k, int nibbles) {
    static const uint8_t special[] = {0, 1, 68, 69, 159, 160, 254, 255};
    /* rows: two full 48-row panels and a partial one (a call over all of them), 16-row
     * blocks and a last one of 5 (amx) */
    const int64_t n_rows = 101, G = 37, d_in = G * MXFP4X_GROUP;
    /* the fused/panel switch of this CPU (none without a bf16 unit: nothing checked), and
     * tokens enough for the whole batch to take the panel */
    const int64_t m = k->bf16_gemv_max_tokens ? k->bf16_gemv_max_tokens() : 0;
    const int64_t n_x = m + 8 > 40 ? m + 8 : 40;
    const int64_t counts[] = {1, 2, 3, 5, m, m + 1, 21};
    const int halves = nibbles == MXFP4X_NIBBLES_HALVES;
    const int64_t row_bytes = G * (halves ? MXFP4X_GGUF_BLOCK_BYTES : MXFP4X_GROUP_BYTES);
    uint8_t *blocks = (uint8_t *)xcalloc((size_t)(n_rows * row_bytes + 64), 1);
    uint8_t *scales = (uint8_t *)xcalloc((size_t)(n_rows * G), 1);
    uint16_t *x = (uint16_t *)xcalloc((size_t)(n_x * d_in), 2);
    int64_t *src, i, r, t, c, g;
    float *full, *one, *other;
    double worst = 0.0;
    /* which comparisons failed, named in the report */
    enum { F_BOUND = 1, F_ALONE = 2, F_COUNTS = 4, F_BLOCK5 = 8, F_SPLIT = 16, F_OFF = 32 };
    static const char *const fail_names[] = {"bound", "alone", "counts",
                                             "block5", "split", "off_unit"};
    int fail = 0;
    digest d;
    char detail[160];
    mxfp4x_rows w;
    if (!k->bf16_rows) {
        free(blocks);
        free(scales);
        free(x);
        return;
    }
    src = (int64_t *)xcalloc((size_t)n_x, sizeof(int64_t));
    seed(7000 + (uint64_t)nibbles);
    digest_init(&d);
    for (i = 0; i < n_rows * G; i++) scales[i] = (uint8_t)(118 + next_u64() % 18);
    for (i = 0; i < (int64_t)sizeof special; i++) /* one special scale per row 3i + 1 */
        scales[(3 * i + 1) * G + (i * 5) % G] = special[i];
    for (g = 0; g < G; g++) scales[(n_rows - 1) * G + g] = 1; /* a row of 2^-126-scale weights */
    if (halves) {
        for (r = 0; r < n_rows; r++)
            for (g = 0; g < G; g++) {
                uint8_t *blk = blocks + r * row_bytes + g * MXFP4X_GGUF_BLOCK_BYTES;
                blk[0] = scales[r * G + g];
                for (i = 1; i < MXFP4X_GGUF_BLOCK_BYTES; i++) blk[i] = (uint8_t)next_u64();
            }
        w = mxfp4x_rows_gguf(blocks, row_bytes, G);
    } else {
        for (i = 0; i < n_rows * row_bytes; i++) blocks[i] = (uint8_t)next_u64();
        w = mxfp4x_rows_split(blocks, scales, row_bytes, G, G);
    }
    for (i = 0; i < n_x * d_in; i++) x[i] = bf16_of(next_float());
    x[3 * d_in + 5] = 0x0001;                             /* a bf16 subnormal */
    for (i = 0; i < d_in; i++) /* every latent near 2^-125: products under 2^-126 */
        x[7 * d_in + i] = (uint16_t)((x[7 * d_in + i] & 0x807F) | 0x0100);
    for (i = 0; i < d_in; i++) /* every latent a bf16 subnormal (vdpbf16ps reads 0) */
        x[8 * d_in + i] = (uint16_t)((x[8 * d_in + i] & 0x807F) | 0x0001);
    x[11 * d_in + 40] = 0x5F80;                           /* 2^64 */
    x[13 * d_in + 2] = 0x7F80;                            /* inf */
    for (t = 0; t < n_x; t++) src[t] = (t * 17 + 3) % n_x; /* scattered, as routed */
    full = (float *)xcalloc((size_t)(n_x * n_rows), sizeof(float));
    one = (float *)xcalloc((size_t)n_rows, sizeof(float));
    other = (float *)xcalloc((size_t)(n_x * n_rows), sizeof(float));
    bf16_run(k, &w, n_rows, x, d_in, src, n_x, 0, full, 0);
    /* against float64 (NaN where the reference is; rows whose terms pass float32's range
     * overflow as every float32 path does: not compared) */
    for (t = 0; t < n_x; t++)
        for (r = 0; r < n_rows; r++) {
            double s = 0.0, mag = 0.0, err;
            const float got = full[t * n_rows + r];
            for (i = 0; i < d_in; i++) { /* natural order, as the latents are given */
                const double p =
                    weight_ref(&w, r, i) * (double)mxfp4x_bf16_to_f32(x[src[t] * d_in + i]);
                s += p;
                mag += fabs(p);
            }
            digest_f32(&d, got);
            if (s != s) {
                if (got == got) fail |= F_BOUND;
                continue;
            }
            if (mag >= ldexp(1.0, 127)) continue;
            err = fabs((double)got - s);
            if (err > error_bound(mag, d_in) || got != got) fail |= F_BOUND;
            if (mag > 0 && err / mag > worst) worst = err / mag;
        }
    /* every token alone, and runs of each count, bit for bit */
    for (t = 0; t < n_x; t++) {
        bf16_run(k, &w, n_rows, x, d_in, src + t, 1, 0, one, 0);
        if (memcmp(one, full + t * n_rows, (size_t)n_rows * sizeof(float))) fail |= F_ALONE;
    }
    for (c = 0; c < (int64_t)(sizeof counts / sizeof counts[0]); c++) {
        const int64_t n = counts[c], t0 = (c * 7) % (n_x - n + 1);
        bf16_run(k, &w, n_rows, x, d_in, src + t0, n, 0, other, 0);
        if (memcmp(other, full + t0 * n_rows, (size_t)(n * n_rows) * sizeof(float)))
            fail |= F_COUNTS;
    }
    /* 5 tokens (the fused block of 5 below the switch, tiles above it) over matrices of
     * 98 and 99 rows, last tiles of 2 and 3 rows, against each token alone over the same
     * rows (not against the 101-row run: which rows share a 16-row block, and so a block's
     * exact-path scan, depends on the matrix's row count, as it does on AMX) */
    for (c = 98; c <= 99; c++) {
        bf16_run(k, &w, c, x, d_in, src + 3, 5, 0, other, 0);
        for (t = 0; t < 5; t++) {
            bf16_run(k, &w, c, x, d_in, src + 3 + t, 1, 0, one, 0);
            if (memcmp(other + t * c, one, (size_t)c * sizeof(float))) fail |= F_BLOCK5;
        }
    }
    /* tile-aligned split row ranges (as the driver's tasks) */
    bf16_run(k, &w, n_rows, x, d_in, src, n_x, k->tile_rows, other, 0);
    if (memcmp(other, full, (size_t)(n_x * n_rows) * sizeof(float))) fail |= F_SPLIT;
    /* avx512bf16 takes small values off the unit by the unit's arithmetic in float32: where
     * the unit could take a token (nothing subnormal can occur), the bits are the unit's.
     * Every token forced off the unit, the batch (the unit's panel) and tokens alone (its
     * fused gemv) must give the same results, whatever path each (row, token) took. */
    if (!strcmp(k->name, MXFP4X_ISA_NAME_AVX512BF16)) {
        bf16_run(k, &w, n_rows, x, d_in, src, n_x, 0, other, 1);
        if (memcmp(other, full, (size_t)(n_x * n_rows) * sizeof(float))) fail |= F_OFF;
        for (t = 0; t < 6; t++) {
            bf16_run(k, &w, n_rows, x, d_in, src + t, 1, 0, one, 1);
            if (memcmp(one, full + t * n_rows, (size_t)n_rows * sizeof(float))) fail |= F_OFF;
        }
    }
    snprintf(detail, sizeof detail, "max_rel_err=%.3g switch=%lld", worst, (long long)m);
    for (i = 0; i < 6; i++)
        if (fail & (1 << i))
            snprintf(detail + strlen(detail), sizeof detail - strlen(detail), " failed:%s",
                     fail_names[i]);
    report(k->name, named("bf16", "gguf_bf16", nibbles), &d, fail == 0, detail);
    free(blocks);
    free(scales);
    free(x);
    free(src);
    free(full);
    free(one);
    free(other);
}

/* ---- main ---------------------------------------------------------------------------- */

/* ---- attention.h: a decoding step's attention ------------------------------------- */

typedef struct {
    int64_t b, hq, hkv, tq, tk, d;
    int dtype, mask, sinks, mask_heads; /* mask_heads 0: one mask row for every head */
} att_case;

static const att_case att_cases[] = {
    {1, 64, 8, 1, 137, 64, MXFP4X_DTYPE_BF16, 1, 1, 0}, /* gpt-oss's heads, one token */
    {2, 12, 3, 3, 37, 24, MXFP4X_DTYPE_F32, 1, 0, 1},   /* a head size off every vector */
    {3, 8, 8, 1, 5, 40, MXFP4X_DTYPE_F16, 0, 1, 1},     /* no grouping, few keys */
    {1, 16, 2, 5, 130, 80, MXFP4X_DTYPE_BF16, 1, 1, 1}, /* several passes of rows */
    {2, 6, 2, 2, 1, 16, MXFP4X_DTYPE_F32, 1, 1, 1},     /* one key */
    {1, 4, 1, 1, 33, 72, MXFP4X_DTYPE_BF16, 0, 0, 1},   /* d off 16: the generic key load */
    {2, 16, 2, 2, 29, 32, MXFP4X_DTYPE_F16, 1, 1, 0},   /* one mask row, two tokens */
};

/* n random floats (times scale) stored in dtype at dst */
static void att_fill(void *dst, int64_t n, int dtype, float scale) {
    float *f = (float *)xcalloc((size_t)n, sizeof(float));
    int64_t i;
    for (i = 0; i < n; i++) f[i] = next_float() * scale;
    mxfp4x_act_store(f, n, dtype, dst);
    free(f);
}

static double att_at(const void *p, int dtype, int64_t i) {
    float f;
    mxfp4x_act_load(p, dtype, i, 1, 1, &f);
    return f;
}

/* each case's output on the ISA's path against the plain C path (bits) and float64 (the
 * float32 bound of the scores' and the values' chains, plus the output's rounding; the
 * plain C entry is checked by the bound alone); the keys and values read through views
 * of longer buffers of different lengths and layouts, some rows' keys all masked out
 * (with a sink: zero weight on every key) */
static void check_attention(const mxfp4x_kernels *k) {
    digest dg;
    int ok = 1;
    size_t ci;
    char detail[160] = "";
    digest_init(&dg);
    seed(41);
    for (ci = 0; ci < sizeof att_cases / sizeof att_cases[0]; ci++) {
        const att_case *c = &att_cases[ci];
        const int64_t g = c->hq / c->hkv, sz = (int64_t)mxfp4x_att_size(c->dtype);
        const int64_t kst = c->tk + 5, vst = c->tk + 2; /* the buffers' token capacities */
        const int64_t n_out = c->b * c->tq * c->hq * c->d;
        mxfp4x_attention_args x;
        void *q = xcalloc((size_t)(c->b * c->hq * c->tq * c->d), (size_t)sz);
        void *kk = xcalloc((size_t)(c->b * c->hkv * kst * c->d), (size_t)sz);
        void *vv = xcalloc((size_t)(c->b * c->hkv * vst * c->d), (size_t)sz);
        void *mask = xcalloc((size_t)(c->b * c->hq * c->tq * c->tk), (size_t)sz);
        void *sinks = xcalloc((size_t)c->hq, (size_t)sz);
        void *got = xcalloc((size_t)n_out, (size_t)sz), *want = xcalloc((size_t)n_out, (size_t)sz);
        float *scratch = (float *)xcalloc((size_t)mxfp4x_attention_scratch(c->tk, c->d),
                                          sizeof(float));
        float *mf = (float *)xcalloc((size_t)(c->b * c->hq * c->tq * c->tk), sizeof(float));
        double *sc = (double *)xcalloc((size_t)c->tk + 1, sizeof(double));
        int64_t i, s, h, t, j, dd, n_tasks;
        att_fill(q, c->b * c->hq * c->tq * c->d, c->dtype, 0.7f);
        att_fill(kk, c->b * c->hkv * kst * c->d, c->dtype, 0.7f);
        att_fill(vv, c->b * c->hkv * vst * c->d, c->dtype, 3.0f);
        att_fill(sinks, c->hq, c->dtype, 1.0f);
        for (i = 0; i < c->b * c->hq * c->tq * c->tk; i++) {
            const uint64_t u = next_u64() % 8;
            mf[i] = u == 0 ? -INFINITY : u == 1 ? -65504.0f : 0.0f;
        }
        for (j = 0; j < c->tk; j++) mf[j] = -INFINITY; /* row (0, 0, 0): every key out */
        mxfp4x_act_store(mf, c->b * c->hq * c->tq * c->tk, c->dtype, mask);
        memset(&x, 0, sizeof x);
        x.q = q, x.k = kk, x.v = vv, x.out = got;
        x.mask = c->mask ? mask : NULL, x.sinks = c->sinks ? sinks : NULL;
        x.q_dtype = x.kv_dtype = x.mask_dtype = x.sinks_dtype = x.out_dtype = c->dtype;
        x.q_sb = c->hq * c->tq * c->d, x.q_sh = c->tq * c->d, x.q_st = c->d;
        /* the keys (b, capacity, hkv, d), as a cache of tokens by rows; the values (b, hkv,
         * capacity, d) */
        x.k_sb = c->hkv * kst * c->d, x.k_sh = c->d, x.k_st = c->hkv * c->d;
        x.v_sb = c->hkv * vst * c->d, x.v_sh = vst * c->d, x.v_st = c->d;
        x.m_sb = c->hq * c->tq * c->tk, x.m_sh = c->mask_heads ? c->tq * c->tk : 0;
        x.m_st = c->tk;
        x.b = c->b, x.hq = c->hq, x.hkv = c->hkv, x.tq = c->tq, x.tk = c->tk, x.d = c->d;
        x.scaling = 0.125f;
        n_tasks = mxfp4x_attention_tasks(&x);
        mxfp4x_attention(k->isa, &x, 0, n_tasks, scratch);
        x.out = want;
        mxfp4x_attention_c(&x, 0, n_tasks, scratch);
        if (memcmp(got, want, (size_t)(n_out * sz)) != 0 && ok) {
            ok = 0;
            snprintf(detail, sizeof detail, "case %d: not the plain C path's bits", (int)ci);
        }
        for (i = 0; i < n_out; i++) digest_f32(&dg, (float)att_at(got, c->dtype, i));
        for (s = 0; s < c->b; s++)
            for (t = 0; t < c->tq; t++)
                for (h = 0; h < c->hq; h++) {
                    const int64_t hk = h / g;
                    const char *kb = (const char *)kk + (size_t)(s * x.k_sb + hk * x.k_sh) * sz;
                    const char *vb = (const char *)vv + (size_t)(s * x.v_sb + hk * x.v_sh) * sz;
                    const int64_t mrow = s * x.m_sb + h * x.m_sh + t * x.m_st;
                    double mx = c->sinks ? att_at(sinks, c->dtype, h) : -INFINITY, z = 0, vmax = 0;
                    for (j = 0; j < c->tk; j++) {
                        double a = 0;
                        for (dd = 0; dd < c->d; dd++)
                            a += att_at(q, c->dtype, s * x.q_sb + h * x.q_sh + t * x.q_st + dd) *
                                 att_at(kb, c->dtype, j * x.k_st + dd);
                        sc[j] = a * 0.125 + (c->mask ? att_at(mask, c->dtype, mrow + j) : 0.0);
                        mx = sc[j] > mx ? sc[j] : mx;
                        for (dd = 0; dd < c->d; dd++) {
                            const double v = fabs(att_at(vb, c->dtype, j * x.v_st + dd));
                            vmax = v > vmax ? v : vmax;
                        }
                    }
                    for (j = 0; j < c->tk; j++) z += sc[j] = exp(sc[j] - mx);
                    if (c->sinks) z += exp(att_at(sinks, c->dtype, h) - mx);
                    for (dd = 0; dd < c->d; dd++) {
                        const int64_t o = ((s * c->tq + t) * c->hq + h) * c->d + dd;
                        const double unit = c->dtype == MXFP4X_DTYPE_F32    ? 0x1p-24
                                            : c->dtype == MXFP4X_DTYPE_BF16 ? 0x1p-8
                                                                            : 0x1p-11;
                        double ref = 0, err, bound;
                        for (j = 0; j < c->tk; j++)
                            ref += sc[j] * att_at(vb, c->dtype, j * x.v_st + dd);
                        ref /= z;
                        err = fabs(att_at(got, c->dtype, o) - ref);
                        bound = 2 * unit * fabs(ref) + 0x1p-24 +
                                (double)(4 * c->d + 4 * c->tk + 64) * 0x1p-22 * vmax;
                        /* no key and no sink: NaN, as a softmax of -inf's */
                        if (ref != ref ? !(err != err && att_at(got, c->dtype, o) !=
                                                             att_at(got, c->dtype, o))
                                       : !(err <= bound)) {
                            if (ok)
                                snprintf(detail, sizeof detail,
                                         "case %d (%lld, %lld, %lld, %lld): %g against %g",
                                         (int)ci, (long long)s, (long long)t, (long long)h,
                                         (long long)dd, att_at(got, c->dtype, o), ref);
                            ok = 0;
                        }
                    }
                }
        free(q), free(kk), free(vv), free(mask), free(sinks), free(got), free(want);
        free(scratch), free(mf), free(sc);
    }
    report(k->name, "attention", &dg, ok, detail);
}

static const char *arch_name(void) {
#if MXFP4X_ARCH_X86_64
    return "x86_64";
#elif defined(__aarch64__) || defined(__arm64__)
    return "aarch64";
#else
    return "other";
#endif
}

int main(int argc, char **argv) {
    int i, a, n_named = 0, feats = mxfp4x_cpu_features();
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (i = 0; i < mxfp4x_n_kernels(); i++)
            printf("%s %s\n", mxfp4x_kernel_at(i)->name,
                   mxfp4x_kernel_runnable(i) ? "runnable" : "not-runnable");
        return 0;
    }
    printf("# arch=%s kernels=", arch_name());
    for (i = 0; i < mxfp4x_n_kernels(); i++)
        printf("%s%s%s", i ? "," : "", mxfp4x_kernel_at(i)->name,
               mxfp4x_kernel_runnable(i) ? "" : "(not runnable)");
    i = mxfp4x_kernel_default();
    printf(" default=%s cpu_features=", i >= 0 ? mxfp4x_kernel_at(i)->name : "(none)");
    if (i < 0 || !mxfp4x_kernel_runnable(i)) {
        printf("\nFAIL: the default kernel is not a runnable entry\n");
        return 1;
    }
    for (i = 0, a = 0; i < MXFP4X_N_FEATURES; i++)
        if ((feats >> i) & 1) printf("%s%s", a++ ? "," : "", mxfp4x_feature_name(i));
    printf("\n");
    for (a = 1; a < argc; a++) {
        int found = -1;
        for (i = 0; i < mxfp4x_n_kernels(); i++)
            if (strcmp(mxfp4x_kernel_at(i)->name, argv[a]) == 0) found = i;
        if (found < 0) {
            fprintf(stderr, "unknown ISA %s (compiled:", argv[a]);
            for (i = 0; i < mxfp4x_n_kernels(); i++)
                fprintf(stderr, " %s", mxfp4x_kernel_at(i)->name);
            fprintf(stderr, ")\n");
            return 2;
        }
        if (!mxfp4x_kernel_runnable(found)) {
            printf("%-7s %-10s %016llx FAIL this CPU cannot run it\n", argv[a], "runnable",
                   0ull);
            failures++;
        }
        n_named++;
    }
    for (i = 0; i < mxfp4x_n_kernels(); i++) {
        const mxfp4x_kernels *k = mxfp4x_kernel_at(i);
        int wanted = n_named == 0;
        for (a = 1; a < argc; a++)
            if (strcmp(k->name, argv[a]) == 0) wanted = 1;
        if (!wanted) continue;
        if (!mxfp4x_kernel_runnable(i)) {
            printf("# %s: not runnable on this CPU, skipped\n", k->name);
            continue;
        }
        check_decode(k, MXFP4X_NIBBLES_PAIRS);
        check_mv(k, MXFP4X_NIBBLES_PAIRS);
        check_axpy(k);
        check_f64(k);
        check_fz(k);
        check_fma_loop(k);
        check_dense(k);
        check_bf16(k, MXFP4X_NIBBLES_PAIRS);
        check_decode(k, MXFP4X_NIBBLES_HALVES);
        check_mv(k, MXFP4X_NIBBLES_HALVES);
        check_bf16(k, MXFP4X_NIBBLES_HALVES);
        check_attention(k);
    }
    printf("# %s\n", failures ? "FAILED" : "all ok");
    return failures ? 1 : 0;
}
