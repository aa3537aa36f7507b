/* mxfp4x/generic/end.h -- undefines the microkernel interface (generic/README.h), so
 * that the next ISA header defines its own. */
#undef MXFP4X_MK_NAME
#undef MXFP4X_MK_FN
#undef MXFP4X_MK_INLINE
#undef MXFP4X_MK_VEC
#undef MXFP4X_MK_LANES
#undef MXFP4X_MK_LOAD
#undef MXFP4X_MK_STORE
#undef MXFP4X_MK_SET1
#undef MXFP4X_MK_ADD
#undef MXFP4X_MK_FMA
#undef MXFP4X_MK_FMA1
#undef MXFP4X_MK_TABLES
#undef MXFP4X_MK_LOAD_TABLES
#undef MXFP4X_MK_DECODE_STORE
#undef MXFP4X_MK_AXPY_VECS
#undef MXFP4X_MK_FMA_CHAINS
#undef MXFP4X_MK_PANEL_MR
#undef MXFP4X_MK_PANEL_NT
#undef MXFP4X_MK_PANEL_TOKENS
#undef MXFP4X_MK_PANEL_KC
#undef MXFP4X_MK_PANEL_PARK
#undef MXFP4X_MK_HSUM_PARKED
#undef MXFP4X_MK_GEMV_NT
