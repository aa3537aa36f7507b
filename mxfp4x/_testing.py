"""Helpers shared by the tests and the benchmarks: random MXFP4 layers and the
error bound a float32 (or float64) computation is held to."""
import numpy as np
import torch

from ._reference import mxfp4_experts_reference

_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
_OUT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8,
                 torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
_OUT_TINY = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134,
             torch.float32: 2.0 ** -150, torch.float64: 2.0 ** -1075}


def random_layer(rng, n_tokens, top_k, n_experts, d_out, n_groups, dtype=torch.float32,
                 index_dtype=torch.int64, scale_range=(119, 134), repeat_expert=False):
    """A random MXFP4 MoE call: every byte value, scales around 1, no zeros-only rows."""
    d_in = 32 * n_groups
    x = torch.from_numpy(rng.standard_normal((n_tokens, d_in))).to(dtype)
    packed = torch.from_numpy(rng.integers(0, 256, (n_experts, d_out, n_groups, 16),
                                           dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(scale_range[0], scale_range[1] + 1,
                                           (n_experts, d_out, n_groups), dtype=np.uint8))
    sel = torch.from_numpy(rng.integers(0, n_experts, (n_tokens, top_k))).to(index_dtype)
    if repeat_expert and top_k > 1 and n_tokens > 0:
        sel[0, 1] = sel[0, 0]
    mix = torch.from_numpy(rng.random((n_tokens, top_k))).to(dtype)
    shared = torch.from_numpy(rng.standard_normal((n_tokens, d_out))).to(dtype)
    return dict(latent_tokens=x, packed_weights=packed, scale_bytes=scales,
                selected_experts=sel, mixture_weights=mix, shared_output=shared)


def _np(t):
    """float tensors -> float64 ndarray; integer tensors -> ndarray views (no copy of
    a multi-GB weight tensor)."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return t.double().numpy() if t.is_floating_point() else t.numpy()
    return np.asarray(t)


def reference_and_bound(layer, out_dtype, rows=None):
    """(float64 reference, per-element error bound) for a result of ``out_dtype``.

    The bound is the classic one for a float32 (float64 for float64 outputs)
    dot product summed in any order: gamma_n * sum |terms|, n = d_in + top_k + 2,
    plus one rounding to the output dtype and an underflow allowance.  A wrong
    index, nibble or scale misses it by orders of magnitude.
    """
    x = _np(layer["latent_tokens"])
    packed = _np(layer["packed_weights"])
    scales = _np(layer["scale_bytes"])
    sel = _np(layer["selected_experts"]).astype(np.int64)
    mix = _np(layer["mixture_weights"])
    shared = _np(layer["shared_output"])
    ref = mxfp4_experts_reference(x, packed, scales, sel, mix, shared, rows=rows)
    mag = mxfp4_experts_reference(np.abs(x), packed, scales, sel, np.abs(mix),
                                  np.abs(shared), rows=rows, absolute=True)
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    n = x.shape[1] + sel.shape[1] + 2
    u = _UNIT_ROUNDOFF[acc]
    gamma = n * u / (1 - n * u)
    bound = gamma * mag + _OUT_ROUNDOFF[out_dtype] * np.abs(ref) + n * _OUT_TINY[acc] \
        + _OUT_TINY[out_dtype]
    return ref, bound


def assert_matches_reference(result, layer, rows=None):
    ref, bound = reference_and_bound(layer, result.dtype, rows=rows)
    got = result.detach().cpu().double().numpy()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan_ref,
                                  err_msg="NaN where the reference has none (or the reverse)")
    inf_ref = np.isinf(ref)
    np.testing.assert_array_equal(got[inf_ref], ref[inf_ref])
    ok = ~(nan_ref | inf_ref)
    err = np.abs(got[ok] - ref[ok])
    if err.size:
        worst = np.argmax(err - bound[ok])
        assert np.all(err <= bound[ok]), (
            f"error {err[worst]:.3g} exceeds the bound {bound[ok][worst]:.3g} "
            f"(reference {ref[ok][worst]:.6g}, got {got[ok][worst]:.6g})")
