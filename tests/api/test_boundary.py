"""The typed boundary between Python and the kernels (mxfp4x._cpu.Experts / Call):
named modes, every array checked, stacked and per-expert tables equivalent."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x import _cpu, _cpu_impl
from mxfp4x.testing.layers import random_layer


def _call(layer, **change):
    """A forward call built the way _cpu_impl builds it, with fields replaced."""
    x = layer["latent_tokens"]
    sel = layer["selected_experts"].long().numpy()
    out = layer["shared_output"].clone().numpy()
    kwargs = dict(product="forward", compute="float32", selected=sel,
                  mix=layer["mixture_weights"].numpy(), src=x.numpy(), src_dtype="float32",
                  src_rows="token", dst=out, dst_rows="token")
    kwargs.update(change)
    ex = _cpu_impl.experts_of(layer["packed_weights"], layer["scale_bytes"])
    return _cpu.Call(ex, **kwargs), out


def test_call_runs_and_matches_the_facade(rng):
    layer = random_layer(rng, 6, 3, 4, 37, 3)
    call, out = _call(layer)
    call.run()
    assert torch.equal(torch.from_numpy(out), mxfp4x.mxfp4_experts(**layer))
    assert call.isa == mxfp4x.backend_info()["isa"]


@pytest.mark.parametrize("change,match", [
    (dict(product="backward"), "product: expected one of"),
    (dict(src_rows="tokens"), "src_rows: expected one of"),
    (dict(compute="bfloat16"), "compute: expected 'float32' or 'float64'"),
    (dict(src_dtype="float64"), "src: expected a C-contiguous"),
    (dict(mix=None), "mix: expected where"),
    (dict(dst_rows="slot"), "mix: not expected"),
    (dict(selected=np.zeros((6, 3), np.int32)), "selected: expected a C-contiguous"),
    (dict(selected=np.zeros((5, 3), np.int64)), "mix: expected a C-contiguous"),
    (dict(src=np.zeros((6, 64), np.float32)), "src: expected a C-contiguous"),
    (dict(dst=np.zeros((6, 36), np.float32)), "dst: expected a C-contiguous"),
    (dict(dst=np.zeros((37, 6), np.float32).T), "dst: expected a C-contiguous"),
    (dict(product="transposed"), "src_dtype|src: expected"),
    (dict(isa="neon9"), "isa='neon9' is not an ISA"),
], ids=lambda v: str(v)[:40])
def test_call_checks_every_field(rng, change, match):
    layer = random_layer(rng, 6, 3, 4, 37, 3)
    with pytest.raises(ValueError, match=match):
        _call(layer, **change)


def test_call_refuses_read_only_output(rng):
    layer = random_layer(rng, 2, 1, 2, 8, 1)
    out = layer["shared_output"].numpy().copy()
    out.setflags(write=False)
    with pytest.raises(ValueError, match="dst: the array is read-only"):
        _call(layer, dst=out)


def test_expert_ids_checked_once_while_routing(rng):
    layer = random_layer(rng, 4, 2, 3, 8, 1)
    sel = layer["selected_experts"].long().clone()
    sel[2, 1] = 3
    call, _ = _call(layer, selected=sel.numpy())
    with pytest.raises(IndexError, match=r"selected_experts: expert id 3 is outside \[0, 3\)"):
        call.run()


def test_experts_table_checks(rng):
    # overlapping and repeated rows are legal (a stride-0 view): only read
    _cpu.Experts(np.array([[1, 1, 8, 0]], np.int64), d_out=4, n_groups=2, owner=None)
    with pytest.raises(ValueError, match="negative row strides"):
        _cpu.Experts(np.array([[1, 1, -32, 2]], np.int64), d_out=4, n_groups=2, owner=None)
    with pytest.raises(ValueError, match="null address"):
        _cpu.Experts(np.array([[0, 1, 32, 2]], np.int64), d_out=4, n_groups=2, owner=None)
    with pytest.raises(ValueError, match=r"\(n_experts, 4\) table"):
        _cpu.Experts(np.zeros((2, 3), np.int64), d_out=4, n_groups=2, owner=None)


@pytest.mark.parametrize("form", ["(O, G, 16)", "(O, G*16)"])
def test_per_expert_tensors_are_bit_identical_to_stacked(isa, rng, form):
    """The same bytes as one stacked tensor or as E separate tensors (each its own
    allocation): the same bits, and no copy of any expert."""
    layer = random_layer(rng, 30, 3, 5, 41, 4, repeat_expert=True)
    packed = [layer["packed_weights"][e].clone() for e in range(5)]
    if form == "(O, G*16)":
        packed = [p.flatten(1) for p in packed]
    scales = [layer["scale_bytes"][e].clone() for e in range(5)]
    ex = _cpu_impl.experts_of(packed, scales)
    # read in place, none re-laid; the table holds the tensors themselves, not the list
    assert all(a is b for a, b in zip(ex.owner[0], packed, strict=True)) and ex.owner[2] == []
    sel = layer["selected_experts"]
    for per_slot in (False, True):
        if per_slot:
            want = _cpu_impl.experts(layer["latent_tokens"], layer["packed_weights"],
                                     layer["scale_bytes"], sel, None, None, 2,
                                     per_slot_outputs=True, isa=isa)
            got = _cpu_impl.experts(layer["latent_tokens"], packed, scales, sel, None, None,
                                    2, per_slot_outputs=True, isa=isa)
        else:
            want = _cpu_impl.experts(layer["latent_tokens"], layer["packed_weights"],
                                     layer["scale_bytes"], sel, layer["mixture_weights"],
                                     layer["shared_output"], 2, isa=isa)
            got = _cpu_impl.experts(layer["latent_tokens"], packed, scales, sel,
                                    layer["mixture_weights"], layer["shared_output"], 2,
                                    isa=isa)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    g = torch.randn(30, 41)
    assert torch.equal(
        _cpu_impl.grad_latents(g, packed, scales, sel, layer["mixture_weights"],
                               layer["latent_tokens"], 2, isa=isa),
        _cpu_impl.grad_latents(g, layer["packed_weights"], layer["scale_bytes"], sel,
                               layer["mixture_weights"], layer["latent_tokens"], 2, isa=isa))


def test_per_expert_tensor_mismatch_is_named():
    p = [torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 3, 16, dtype=torch.uint8)]
    s = [torch.zeros(4, 2, dtype=torch.uint8)] * 2
    with pytest.raises(ValueError, match=r"packed_weights\[1\]"):
        _cpu_impl.experts_of(p, s)
    with pytest.raises(ValueError, match="expert 1"):
        _cpu_impl.experts_of(p[:1] * 2, [s[0], torch.zeros(4, 3, dtype=torch.uint8)])


def test_format_facts_agree():
    from mxfp4x import _format
    assert (_cpu.GROUP, _cpu.GROUP_BYTES) == (_format.GROUP, _format.GROUP_BYTES)
    assert _cpu.DTYPES == ("float32", "float64", "bfloat16", "float16")
