/* mxfp4x/generic/decode_f64.h -- decode_f64: the float64 path's decode (scalar.h states
 * it), generic/decode.h's loop over a panel of doubles: each group through
 * MXFP4X_MK_DECODE_F64(b, s, t, p) (16 bytes at b, scale byte s, the constants *t of type
 * MXFP4X_MK_F64_TABLES from MXFP4X_MK_F64_LOAD_TABLES(), once per call -> 32 doubles at
 * p). */
#define MXFP4X_MK_DECODE_AS_F64
#include "decode.h"
#undef MXFP4X_MK_DECODE_AS_F64
