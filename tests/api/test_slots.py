"""The per-slot forms: inputs (T, K, I) (a down projection) and outputs (T, K, O) without
the combine (a gate/up projection), against the float64 reference, with gradients."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core.reference import decode_expert, error_bound
from mxfp4x.testing.layers import acc_name, random_layer


def _ref_slots(x, packed, scales, sel):
    """(T, K, O) in float64; x (T, I) or (T, K, I)."""
    x = x.detach().double().numpy()
    out = np.zeros(sel.shape + (packed.shape[1],))
    for t in range(sel.shape[0]):
        for k in range(sel.shape[1]):
            e = int(sel[t, k])
            w = decode_expert(packed[e].numpy(), scales[e].numpy())
            out[t, k] = w @ (x[t, k] if x.ndim == 3 else x[t])
    return out


def _bound(x, packed, scales, sel):
    mag = _ref_slots(x.abs(), packed & 0x77, scales, sel)  # |W|: both sign bits cleared
    return error_bound(mag, x.shape[-1] + 2, acc_name(x.dtype))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("per_slot_x", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_slots_against_reference(isa, rng, backend, per_slot_x, dtype):
    layer = random_layer(rng, 11, 3, 4, 29, 3, dtype=dtype, repeat_expert=True)
    x = layer["latent_tokens"]
    if per_slot_x:
        x = torch.from_numpy(rng.standard_normal((11, 3, 96))).to(dtype)
    y = mxfp4x.mxfp4_experts_slots(x, layer["packed_weights"], layer["scale_bytes"],
                                   layer["selected_experts"], backend=backend, isa=isa)
    assert y.shape == (11, 3, 29) and y.dtype == dtype
    ref = _ref_slots(x, layer["packed_weights"], layer["scale_bytes"],
                     layer["selected_experts"])
    bound = _bound(x, layer["packed_weights"], layer["scale_bytes"], layer["selected_experts"])
    assert np.all(np.abs(y.double().numpy() - ref) <= bound)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_per_slot_latents_combined_against_reference(isa, rng, backend):
    layer = random_layer(rng, 9, 4, 5, 21, 2, repeat_expert=True)
    x = torch.from_numpy(rng.standard_normal((9, 4, 64))).float()
    y = mxfp4x.mxfp4_experts(**dict(layer, latent_tokens=x), backend=backend, isa=isa)
    slots = _ref_slots(x, layer["packed_weights"], layer["scale_bytes"],
                       layer["selected_experts"])
    ref = layer["shared_output"].double().numpy() + (
        layer["mixture_weights"].double().numpy()[..., None] * slots).sum(1)
    # the documented bound (a fixed tolerance failed on a cancelling row: 16.7 out of
    # terms up to 6000, off by 1.6e-3 on the torch backend)
    mag = layer["shared_output"].double().abs().numpy() + (
        layer["mixture_weights"].double().abs().numpy()[..., None]
        * _ref_slots(x.abs(), layer["packed_weights"] & 0x77, layer["scale_bytes"],
                     layer["selected_experts"])).sum(1)
    bound = error_bound(mag, x.shape[-1] + layer["selected_experts"].shape[1] + 1, "float32",
                        reference=ref, out="float32")
    assert np.all(np.abs(y.double().numpy() - ref) <= bound)


def test_per_slot_shape_errors(rng):
    layer = random_layer(rng, 4, 2, 3, 5, 1)
    with pytest.raises(ValueError, match=r"latent_tokens: per-slot latents must be"):
        mxfp4x.mxfp4_experts(**dict(layer, latent_tokens=torch.randn(4, 3, 32)))
    with pytest.raises(ValueError, match="latent_tokens: expected a 2-D"):
        mxfp4x.mxfp4_experts_slots(torch.randn(32), layer["packed_weights"],
                                   layer["scale_bytes"], layer["selected_experts"])
    with pytest.raises(IndexError, match="selected_experts"):
        mxfp4x.mxfp4_experts_slots(layer["latent_tokens"], layer["packed_weights"],
                                   layer["scale_bytes"], layer["selected_experts"] + 3)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gradcheck_per_slot_forms(rng, backend):
    layer = random_layer(rng, 4, 2, 3, 6, 1, dtype=torch.float64, repeat_expert=True)
    packed, scales, sel = layer["packed_weights"], layer["scale_bytes"], layer["selected_experts"]
    x2 = layer["latent_tokens"].clone().requires_grad_(True)
    x3 = torch.randn(4, 2, 32, dtype=torch.float64, requires_grad=True)
    mix = layer["mixture_weights"].clone().requires_grad_(True)
    shared = layer["shared_output"]

    assert torch.autograd.gradcheck(
        lambda x: mxfp4x.mxfp4_experts_slots(x, packed, scales, sel, backend=backend), (x2,))
    assert torch.autograd.gradcheck(
        lambda x: mxfp4x.mxfp4_experts_slots(x, packed, scales, sel, backend=backend), (x3,))
    assert torch.autograd.gradcheck(
        lambda x, p: mxfp4x.mxfp4_experts(x, packed, scales, sel, p, shared, backend=backend),
        (x3, mix))


def test_slots_ops_opcheck(rng):
    layer = random_layer(rng, 5, 2, 3, 9, 2, dtype=torch.float64)
    x3 = torch.randn(5, 2, 64, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts_slots.default,
                          (x3, layer["packed_weights"], layer["scale_bytes"],
                           layer["selected_experts"], 1))
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts.default,
                          (x3, layer["packed_weights"], layer["scale_bytes"],
                           layer["selected_experts"], layer["mixture_weights"],
                           layer["shared_output"], 1))
