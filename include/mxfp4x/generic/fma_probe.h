/* mxfp4x/generic/fma_probe.h -- fma_loop, the FMA roof's probe: MXFP4X_MK_FMA_CHAINS
 * independent chains a = a * m + c of MXFP4X_MK_FMA (enough to cover the FMA units'
 * latency), iters steps each; the chains' sum is returned so that none is dead code. */

MXFP4X_MK_FN float MXFP4X_MK_NAME(mxfp4x_fma_loop)(int64_t iters, float seed, int64_t *flops) {
    enum { N = MXFP4X_MK_FMA_CHAINS, L = MXFP4X_MK_LANES };
    MXFP4X_MK_VEC a[N];
    const MXFP4X_MK_VEC m = MXFP4X_MK_SET1(0.999999f), c = MXFP4X_MK_SET1(1e-7f);
    int64_t i;
    int j;
    float out[L];
    for (j = 0; j < N; j++) a[j] = MXFP4X_MK_SET1(seed + (float)j);
    for (i = 0; i < iters; i++)
        for (j = 0; j < N; j++) a[j] = MXFP4X_MK_FMA(a[j], m, c);
    for (j = 1; j < N; j++) a[0] = MXFP4X_MK_ADD(a[0], a[j]);
    MXFP4X_MK_STORE(out, a[0]);
    *flops = iters * N * L * 2;
    return out[0];
}
