"""The specification in numpy, in float64: slow and obviously correct, and the
documented error bound every result is held to.

Used by the tests and by the benchmarks' result checks.  Not a fast path.  (numpy
only: the QEMU portability probe runs it without torch.)
"""
import numpy as np

from .format import E2M1_TABLE, GROUP, e8m0_to_float64


def decode_expert(packed_weights, scale_bytes, absolute=False):
    """(O, G, 16) bytes and (O, G) scales -> the (O, 32*G) float64 matrix (|W| if absolute)."""
    packed = np.asarray(packed_weights, dtype=np.uint8)
    if absolute:
        packed = packed & 0x77  # clear both sign bits
    d_out, n_groups, _ = packed.shape
    codes = np.empty((d_out, n_groups, GROUP), dtype=np.uint8)
    codes[..., 0::2] = packed & 0xF   # element 2j: low nibble
    codes[..., 1::2] = packed >> 4    # element 2j+1: high nibble
    values = E2M1_TABLE[codes] * e8m0_to_float64(scale_bytes)[..., None]
    return values.reshape(d_out, n_groups * GROUP)


def mxfp4_experts_reference(latent_tokens, packed_weights, scale_bytes, selected_experts,
                            mixture_weights, shared_output, rows=None, absolute=False):
    """y_t = shared_t + sum_k p_tk * W_{e_tk} x_t, all in float64.

    ``rows`` (a slice or index array) restricts the output rows computed, so a
    check at model size decodes only those rows.  ``absolute=True`` decodes |W|
    (for error bounds).  Returns a float64 ndarray.
    """
    x = np.asarray(latent_tokens, dtype=np.float64)
    packed = np.asarray(packed_weights)
    scales = np.asarray(scale_bytes)
    sel = np.asarray(selected_experts, dtype=np.int64)
    p = np.asarray(mixture_weights, dtype=np.float64)
    y = np.array(shared_output, dtype=np.float64)
    rows = slice(None) if rows is None else rows
    y = y[:, rows].copy()
    cache = {}
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf propagate (IEEE)
        for t in range(sel.shape[0]):
            for k in range(sel.shape[1]):
                e = int(sel[t, k])
                if e not in cache:
                    cache[e] = decode_expert(packed[e][rows], scales[e][rows], absolute)
                y[t] += p[t, k] * (cache[e] @ x[t])
    return y


# unit roundoff and smallest subnormal of each dtype, by name
_UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                  "float64": 2.0 ** -53}
_TINY = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -134, "float32": 2.0 ** -150,
         "float64": 2.0 ** -1075}


def error_bound(magnitude, n_terms, acc="float32", reference=None, out=None):
    """The documented bound on |result - float64 reference|, elementwise.

    ``magnitude`` is the float64 sum of the absolute values of the terms (the reference
    computed on |x|, |W|, |p|, |shared|).  A sum of ``n_terms`` products accumulated in
    ``acc`` in any order is within gamma_n * magnitude, gamma_n = n u / (1 - n u) (the
    classic dot-product bound), plus an underflow allowance of n subnormals; a result
    rounded once to ``out`` adds u_out * |reference| and one subnormal of ``out``.
    A wrong index, nibble or scale misses it by orders of magnitude.
    """
    u = _UNIT_ROUNDOFF[acc]
    gamma = n_terms * u / (1 - n_terms * u)
    bound = gamma * np.asarray(magnitude, dtype=np.float64) + n_terms * _TINY[acc]
    if out is not None:
        bound = bound + _UNIT_ROUNDOFF[out] * np.abs(reference) + _TINY[out]
    return bound
