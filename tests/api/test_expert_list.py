"""Experts given one tensor each (a per-expert checkpoint such as Kimi K3's): read in
place, bit-identical to the stacked form, checked entry by entry; byte dtypes by view."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import ops as _ops
from mxfp4x.checkpoints.safetensors import SafeTensorsFile, save_file
from mxfp4x.testing.layers import assert_matches_reference, random_layer

E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _as_list(layer, flat=False):
    """Each expert in its own allocation, (O, G, 16) or (O, G*16)."""
    packed = [layer["packed_weights"][e].clone() for e in range(layer["packed_weights"].shape[0])]
    if flat:
        packed = [p.flatten(1) for p in packed]
    scales = [layer["scale_bytes"][e].clone() for e in range(len(packed))]
    return dict(layer, packed_weights=packed, scale_bytes=scales)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("flat", [False, True], ids=["OG16", "OGx16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_list_is_bit_identical_to_stacked(isa, rng, backend, flat, dtype):
    layer = random_layer(rng, 21, 3, 5, 45, 3, dtype=dtype, repeat_expert=True)
    listed = _as_list(layer, flat)
    want = mxfp4x.mxfp4_experts(**layer, backend=backend, isa=isa)
    got = mxfp4x.mxfp4_experts(**listed, backend=backend, isa=isa)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert_matches_reference(got, layer)
    args = (layer["latent_tokens"], layer["selected_experts"])
    assert torch.equal(
        mxfp4x.mxfp4_experts_slots(args[0], listed["packed_weights"], listed["scale_bytes"],
                                   args[1], backend=backend, isa=isa),
        mxfp4x.mxfp4_experts_slots(args[0], layer["packed_weights"], layer["scale_bytes"],
                                   args[1], backend=backend, isa=isa))


def test_list_entries_are_not_copied(rng):
    layer = random_layer(rng, 4, 2, 3, 16, 2)
    listed = _as_list(layer)
    ptrs = [p.data_ptr() for p in listed["packed_weights"]]
    from mxfp4x._core import cpu_impl as _cpu_impl
    ex = _cpu_impl.experts_of(listed["packed_weights"], listed["scale_bytes"])
    assert ex.owner[2] == [] and [p.data_ptr() for p in ex.owner[0]] == ptrs


def test_list_gradients_match_stacked(rng):
    layer = random_layer(rng, 6, 2, 3, 20, 2, dtype=torch.float64, repeat_expert=True)
    grads = []
    for form in (layer, _as_list(layer)):
        leaves = {k: layer[k].clone().requires_grad_(True)
                  for k in ("latent_tokens", "mixture_weights", "shared_output")}
        y = mxfp4x.mxfp4_experts(**dict(form, **leaves))
        y.backward(torch.ones_like(y))
        grads.append([leaves[k].grad for k in sorted(leaves)])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    listed = _as_list(layer)
    # every argument passed (no trailing defaults for the dispatcher to drop)
    x = layer["latent_tokens"].clone().requires_grad_(True)
    y = mxfp4x.mxfp4_experts(**dict(listed, latent_tokens=x), num_threads=2, isa="scalar")
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, grads[0][0])

    def f(x, p, s):
        return mxfp4x.mxfp4_experts(x, listed["packed_weights"], listed["scale_bytes"],
                                    layer["selected_experts"], p, s)

    assert torch.autograd.gradcheck(f, tuple(layer[k].clone().requires_grad_(True) for k in
                                             ("latent_tokens", "mixture_weights",
                                              "shared_output")))


def test_list_ops_opcheck_and_compile(rng):
    layer = random_layer(rng, 5, 2, 3, 24, 2)
    listed = _as_list(layer)
    sel = layer["selected_experts"].long()
    args = (layer["latent_tokens"], listed["packed_weights"], listed["scale_bytes"], sel,
            layer["mixture_weights"], layer["shared_output"], 1)
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts_list.default, args)
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts_slots_list.default,
                          (args[0], args[1], args[2], sel, 1))
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts_grad_latents_list.default,
                          (torch.randn(5, 24), args[1], args[2], sel, args[4], args[0], 1))
    compiled = torch.compile(lambda x, mix, shared: mxfp4x.mxfp4_experts(
        x, listed["packed_weights"], listed["scale_bytes"], sel, mix, shared), fullgraph=True)
    assert torch.equal(compiled(args[0], args[4], args[5]), mxfp4x.mxfp4_experts(**layer))
    assert _ops.forward_op_for(listed["packed_weights"]) is _ops.mxfp4_experts_list_op


@pytest.mark.parametrize("bad,exc,match", [
    (lambda p, s: (p[:2] + [p[2][:, :1]] + p[3:], s), ValueError, r"packed_weights\[2\]"),
    (lambda p, s: (p, s[:1] + [s[1][:3]] + s[2:]), ValueError, r"scale_bytes\[1\]"),
    (lambda p, s: (p, s[:-1]), ValueError, "expected 4 per-expert tensors"),
    (lambda p, s: (p, torch.stack(s)), ValueError, "scale_bytes must be one too"),
    (lambda p, s: (p[:3] + [p[3].float()], s), TypeError, r"packed_weights\[3\]"),
    (lambda p, s: (p[:1] + [p[1].to(torch.int16) - 300] + p[2:], s), ValueError,
     r"packed_weights\[1\]: byte values"),
    (lambda p, s: (p[:2] + [p[2].to("meta")] + p[3:], s), ValueError,
     r"packed_weights\[2\]: on device meta"),
], ids=["shape", "scale-shape", "count", "stacked-scales", "float", "range", "device"])
def test_list_validation_names_the_entry(rng, bad, exc, match):
    layer = random_layer(rng, 3, 2, 4, 8, 2)
    listed = _as_list(layer)
    p, s = bad(listed["packed_weights"], listed["scale_bytes"])
    with pytest.raises(exc, match=match):
        mxfp4x.mxfp4_experts(**dict(layer, packed_weights=p, scale_bytes=s))


@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
@pytest.mark.parametrize("listed", [False, True])
def test_e8m0_scales_are_read_by_view(rng, listed):
    layer = random_layer(rng, 5, 2, 3, 16, 2, scale_range=(0, 254))
    want = mxfp4x.mxfp4_experts(**layer)
    form = _as_list(layer) if listed else dict(layer)
    sc = form["scale_bytes"]
    form["scale_bytes"] = [s.view(E8M0) for s in sc] if listed else sc.view(E8M0)
    got = mxfp4x.mxfp4_experts(**form)  # big scales: inf and NaN too, so compare bits
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
def test_safetensors_f8_e8m0_and_i8_round_trip(tmp_path):
    every = torch.arange(256, dtype=torch.uint8)
    tensors = {"w.weight_scale": every.view(E8M0).reshape(16, 16),
               "w.weight_packed": every.view(torch.int8).reshape(8, 32)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    f = SafeTensorsFile(str(tmp_path / "m.safetensors"))
    assert f.header["w.weight_scale"]["dtype"] == "F8_E8M0"
    assert f.header["w.weight_packed"]["dtype"] == "I8"
    scale = f.get("w.weight_scale")
    packed = f.get("w.weight_packed")
    assert scale.dtype == E8M0 and packed.dtype == torch.int8
    assert torch.equal(scale.view(torch.uint8).flatten(), every)
    assert torch.equal(packed.view(torch.uint8).flatten(), every)
    np.testing.assert_array_equal(packed.view(torch.uint8).numpy().ravel(), np.arange(256))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_a_prepared_table_goes_through_the_same_door(isa, rng, dtype):
    """A module's expert table, built once (what Kimi K3's modules pass), runs through the
    facade with the tensors' bits; the facade checks the rest of the call as for tensors
    and refuses the table where the op, not the kernels, would run."""
    from mxfp4x._core import api as _api
    from mxfp4x._core import cpu_impl as _cpu_impl

    layer = random_layer(rng, 13, 4, 3, 37, 3, dtype=dtype)
    listed = _as_list(layer)
    table = _cpu_impl.experts_of(listed["packed_weights"], listed["scale_bytes"])
    x, sel = layer["latent_tokens"], layer["selected_experts"]
    want = mxfp4x.mxfp4_experts(**layer, isa=isa)
    got = _api.mxfp4_experts(x, table, None, sel, layer["mixture_weights"],
                             layer["shared_output"], isa=isa)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(_api.mxfp4_experts_slots(x, table, None, sel, isa=isa),
                       mxfp4x.mxfp4_experts_slots(x, layer["packed_weights"],
                                                  layer["scale_bytes"], sel, isa=isa))
    with pytest.raises(ValueError, match="latent_tokens: d_in"):
        _api.mxfp4_experts_slots(x[:, :32], table, None, sel)
    with pytest.raises(TypeError, match="scale_bytes"):
        _api.mxfp4_experts_slots(x, table, listed["scale_bytes"], sel)
    with pytest.raises(TypeError, match="prepared expert table"):
        _api.mxfp4_experts_slots(x.detach().requires_grad_(), table, None, sel)
    with pytest.raises(TypeError, match="prepared expert table"):
        _api.mxfp4_experts_slots(x, table, None, sel, backend="torch")
