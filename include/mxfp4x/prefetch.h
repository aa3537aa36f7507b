/* mxfp4x/prefetch.h -- software prefetch of the row blocks a kernel reads next and of
 * the token rows a driver task writes. */
#ifndef MXFP4X_PREFETCH_H
#define MXFP4X_PREFETCH_H

#include "format.h"

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

#endif /* MXFP4X_PREFETCH_H */
