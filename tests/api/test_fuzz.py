"""Fuzzing against the float64 reference (hypothesis).

Profiles (MXFP4X_HYPOTHESIS_PROFILE): "ci" (default, quick), "dev", "long"
(10,000 cases: ``MXFP4X_HYPOTHESIS_PROFILE=long pytest tests/api/test_fuzz.py``).

Inputs cover every dtype and index dtype, strided / transposed / sliced layouts,
scale bytes over the whole 0..255 range, NaN / Inf / huge / tiny latents and
mixture weights, weights that do not sum to 1 and repeated experts.  Outputs are
checked where a float32 (float64) computation can represent every intermediate:
NaN exactly where the reference has NaN, the same infinities, and finite values
within the float32 dot-product bound.  Outputs whose intermediates exceed the
float32 range (decoded weights with scale byte >= 253, |p|*|W||x| sums near
FLT_MAX) are the only ones skipped.
"""
import numpy as np
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x._core.format import accumulation_dtype
from mxfp4x._core.reference import mxfp4_experts_reference
from mxfp4x.testing.layers import reference_and_bound

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_MAX = {torch.float32: float(np.finfo(np.float32).max),
        torch.float64: float(np.finfo(np.float64).max),
        torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
        torch.float16: 65504.0}
# |ref| beyond which round-to-nearest-even gives inf in the output dtype
_INF_AT = {torch.float32: 2.0 ** 128 * (1 - 2.0 ** -25), torch.float64: float("inf"),
           torch.bfloat16: 2.0 ** 128 * (1 - 2.0 ** -9), torch.float16: 65520.0}

SPECIALS = [np.nan, np.inf, -np.inf, 3e38, -1e30, 1e-40, -1e-45, 0.0, -0.0, 1e20, 7.0]


@st.composite
def layers(draw):
    n_tokens = draw(st.integers(0, 9))
    top_k = draw(st.integers(1, 4))
    n_experts = draw(st.integers(1, 5))
    d_out = draw(st.integers(1, 24))
    n_groups = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    d_in = 32 * n_groups
    x = rng.standard_normal((n_tokens, d_in)) * 10.0 ** rng.integers(-3, 4)
    scales = rng.integers(110, 145, (n_experts, d_out, n_groups))
    mix = rng.standard_normal((n_tokens, top_k)) * draw(st.sampled_from([1.0, 1e-20, 1e10]))
    shared = rng.standard_normal((n_tokens, d_out))
    if draw(st.booleans()):  # scale bytes over the full range, 0 and 255 included
        scales = rng.integers(0, 256, scales.shape)
    for arr in (x, mix, shared):
        if arr.size and draw(st.booleans()):  # a few special values
            idx = rng.integers(0, arr.size, rng.integers(1, 4))
            arr.flat[idx] = rng.choice(SPECIALS, idx.size)
    sel = rng.integers(0, n_experts, (n_tokens, top_k))
    if n_tokens and top_k > 1 and draw(st.booleans()):
        sel[:, 1] = sel[:, 0]  # repeated experts
    return dict(latent_tokens=x, packed_weights=rng.integers(0, 256, (n_experts, d_out,
                                                                     n_groups, 16)),
                scale_bytes=scales, selected_experts=sel, mixture_weights=mix,
                shared_output=shared)


def _layout(t, kind):
    if kind == "strided":
        big = torch.empty(t.shape + (2,), dtype=t.dtype)
        big[..., 1] = t
        return big[..., 1]
    if kind == "transposed" and t.dim() == 2:
        return t.T.contiguous().T
    if kind == "sliced":
        big = torch.empty((t.shape[0] + 2,) + tuple(t.shape[1:]), dtype=t.dtype)
        big[1:-1] = t
        return big[1:-1]
    return t


def _finite(a):
    return np.where(np.isfinite(a), a, 0.0)


def check(y, layer_np, out_dtype):
    """The fuzz oracle described in the module docstring; returns #outputs checked."""
    acc = accumulation_dtype(out_dtype)
    ref, bound = reference_and_bound(layer_np, out_dtype)
    x, mix, shared = (layer_np[k] for k in ("latent_tokens", "mixture_weights",
                                            "shared_output"))
    packed, scales = layer_np["packed_weights"], layer_np["scale_bytes"]
    sel = layer_np["selected_experts"]
    safe_scales = np.where(scales == 255, 127, scales)
    mag = mxfp4_experts_reference(np.abs(_finite(x)), packed, safe_scales, sel,
                                  np.abs(_finite(mix)), np.abs(_finite(shared)), absolute=True)
    # rows whose decoded weights overflow the accumulation dtype (fp32: s >= 253)
    big_w = (scales >= 253).any(axis=-1) if acc == torch.float32 else np.zeros(
        scales.shape[:2], bool)
    risky = mag > _MAX[acc] / 4
    for k in range(sel.shape[1]):  # each dot product before its mixture weight, too
        dot_mag = mxfp4_experts_reference(np.abs(_finite(x)), packed, safe_scales,
                                          sel[:, k:k + 1], np.ones((sel.shape[0], 1)),
                                          np.zeros_like(shared), absolute=True)
        risky |= dot_mag > _MAX[acc] / 4
    for t in range(sel.shape[0]):
        for k in range(sel.shape[1]):
            risky[t] |= big_w[sel[t, k]]
    got = y.double().numpy()
    ok = ~risky
    np.testing.assert_array_equal(np.isnan(got)[ok], np.isnan(ref)[ok], err_msg="NaN pattern")
    inf_ref = np.isinf(ref) & ok
    np.testing.assert_array_equal(got[inf_ref], ref[inf_ref])
    fin = ok & np.isfinite(ref)
    with np.errstate(invalid="ignore"):  # bound is inf/NaN on skipped (risky) outputs
        over = fin & (np.abs(ref) - bound > _INF_AT[out_dtype])
        inside = fin & (np.abs(ref) + bound < _INF_AT[out_dtype])
    np.testing.assert_array_equal(np.abs(got[over]), np.inf)
    err = np.abs(got[inside] - ref[inside])
    assert np.all(err <= bound[inside]), (err - bound[inside]).max()
    return int(ok.sum())


@given(layer=layers(), dtype=st.sampled_from(DTYPES),
       index_dtype=st.sampled_from([torch.int32, torch.int64]),
       backend=st.sampled_from(["cpu", "torch"]), isa=st.sampled_from(_cpu.runnable_isas()),
       layout=st.sampled_from(["contiguous", "strided", "transposed", "sliced"]))
def test_fuzz_against_reference(layer, dtype, index_dtype, backend, isa, layout):
    # the inputs as the op will see them (latents etc. rounded to their dtype first)
    tensors = {
        "latent_tokens": torch.from_numpy(layer["latent_tokens"]).to(dtype),
        "packed_weights": torch.from_numpy(layer["packed_weights"]).to(torch.uint8),
        "scale_bytes": torch.from_numpy(layer["scale_bytes"]).to(torch.uint8),
        "selected_experts": torch.from_numpy(layer["selected_experts"]).to(index_dtype),
        "mixture_weights": torch.from_numpy(layer["mixture_weights"]).to(dtype),
        "shared_output": torch.from_numpy(layer["shared_output"]).to(dtype),
    }
    layer_np = {k: (v.double().numpy() if v.is_floating_point() else v.numpy().astype(
        np.int64)) for k, v in tensors.items()}
    args = {k: _layout(v, layout) for k, v in tensors.items()}
    y = mxfp4x.mxfp4_experts(**args, backend=backend, isa=isa)
    assert y.dtype == dtype and y.shape == tensors["shared_output"].shape
    checked = check(y, layer_np, dtype)
    note(f"checked {checked} of {y.numel()} outputs")
    assume(y.numel() == 0 or checked > 0)
