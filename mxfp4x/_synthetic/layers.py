"""Random MXFP4 layers and the check of a result against their float64 reference within
the error bound a float32 (or float64) computation is held to: what ``python -m mxfp4x
check`` and ``bench`` run, and the tests (through ``mxfp4x.testing.layers``)."""
import numpy as np
import torch

from .._core.format import accumulation_dtype
from .._core.reference import error_bound, mxfp4_experts_reference


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def acc_name(dtype):
    """The accumulation dtype of a result of ``dtype`` (float64 only for float64)."""
    return accumulation_dtype(dtype_name(dtype))


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

    The bound is ``mxfp4x._core.reference.error_bound`` for float32 accumulation (float64 for
    float64 outputs) over n = d_in + top_k + 2 terms, rounded once to ``out_dtype``.
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
    bound = error_bound(mag, x.shape[1] + sel.shape[1] + 2, acc_name(out_dtype), ref,
                        dtype_name(out_dtype))
    return ref, bound


def assert_matches_reference(result, layer, rows=None):
    """Raise ``AssertionError`` unless ``result`` is the float64 reference of ``layer``
    within the error bound: same shape, NaN and infinities where the reference has them,
    every other element within its bound.  Explicit checks, not ``assert`` statements:
    the self-test (``python -m mxfp4x check``) and bench's result check run under
    ``python -O`` too, which strips those."""
    ref, bound = reference_and_bound(layer, result.dtype, rows=rows)
    got = result.detach().cpu().double().numpy()
    if got.shape != ref.shape:
        raise AssertionError(f"result: shape {got.shape}, the reference's is {ref.shape}")
    nan_ref = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan_ref,
                                  err_msg="NaN where the reference has none (or the reverse)")
    inf_ref = np.isinf(ref)
    np.testing.assert_array_equal(got[inf_ref], ref[inf_ref])
    ok = ~(nan_ref | inf_ref)
    err = np.abs(got[ok] - ref[ok])
    if err.size and not np.all(err <= bound[ok]):
        worst = np.argmax(err - bound[ok])
        raise AssertionError(
            f"error {err[worst]:.3g} exceeds the bound {bound[ok][worst]:.3g} "
            f"(reference {ref[ok][worst]:.6g}, got {got[ok][worst]:.6g})")
