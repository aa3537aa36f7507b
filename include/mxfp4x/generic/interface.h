/* mxfp4x/generic/interface.h -- the float32 drivers (and the float64 decode) written once,
 * compiled by each ISA header over its microkernel (the way float64.h is).  No include
 * guards: an ISA header defines the macros below, includes this file and the drivers it
 * uses, then generic/end.h, which undefines them.  No intrinsic appears here: every
 * instruction comes from the includer's macros, so each ISA header holds all the
 * instructions it runs (the emulation lane's intrinsic check reads avx512.h alone).
 *
 * The interface (a driver names only what it uses; see each file's head):
 *   MXFP4X_MK_NAME(name)      name with the ISA suffix (name##_avx2)
 *   MXFP4X_MK_FN              a kernel's storage and target attributes
 *   MXFP4X_MK_INLINE          the same, always inlined
 *   MXFP4X_MK_VEC             the float32 vector type; MXFP4X_MK_LANES its lanes
 *   MXFP4X_MK_LOAD(p), MXFP4X_MK_STORE(p, v), MXFP4X_MK_SET1(f), MXFP4X_MK_ADD(a, b)
 *   MXFP4X_MK_FMA(a, b, c)    a * b + c, one rounding (the scalar entry: two; its build
 *                             never contracts them), the ISA's own instruction
 *   MXFP4X_MK_FMA1(a, b, c)   the same on one float (column tails)
 *   MXFP4X_MK_TABLES, MXFP4X_MK_LOAD_TABLES()       a decode's constants, held per call
 *   MXFP4X_MK_DECODE_STORE(b, s, t, p)              one group (16 bytes at b, scale byte
 *                             s, tables *t) -> 32 floats at p in the entry's layout order
 * and, per driver: MXFP4X_MK_AXPY_VECS (axpy_rows.h), MXFP4X_MK_FMA_CHAINS (fma_probe.h),
 * MXFP4X_MK_PANEL_* and MXFP4X_MK_HSUM_PARKED (panel_chunked.h), MXFP4X_MK_GEMV_NT
 * (gemv_tokens.h), MXFP4X_MK_GEMV1_MR, _PREFETCH, MXFP4X_MK_ROW_ACCS, MXFP4X_MK_DECODE_GROUP,
 * MXFP4X_MK_FMA_GROUP and MXFP4X_MK_HSUM_ACCS (gemv1.h), MXFP4X_MK_F64_TABLES,
 * MXFP4X_MK_F64_LOAD_TABLES and MXFP4X_MK_DECODE_F64 (decode_f64.h: the float64 decode),
 * MXFP4X_MK_BF16_LOAD, MXFP4X_MK_HSUM, MXFP4X_MK_DENSE_MR1 and MXFP4X_MK_DENSE_PREFETCH
 * (dense_bf16.h: the dense bf16 product).
 *
 * The drivers fix loops and blocking; the microkernel fixes every arithmetic step.  A
 * driver runs each (row, token)'s microkernel steps in the order the entry's header
 * states, so the bits are the entry's (tests/c/check_kernels.c, every ISA). */
