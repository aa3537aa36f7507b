"""The contract: nothing mutated, nothing aliased, dtype/device kept, clear errors."""
import re

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core.format import accumulation_dtype
from mxfp4x.testing.layers import random_layer


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
def test_no_mutation_no_alias_dtype_kept(rng, backend, dtype):
    layer = random_layer(rng, 6, 2, 3, 9, 2, dtype=dtype)
    before = {k: v.clone() for k, v in layer.items()}
    y = mxfp4x.mxfp4_experts(**layer, backend=backend)
    for k, v in layer.items():
        assert torch.equal(v, before[k]), f"{k} was modified"
    assert y.dtype == dtype and y.device == layer["latent_tokens"].device
    assert y.shape == layer["shared_output"].shape
    for k, v in layer.items():
        assert y.untyped_storage().data_ptr() != v.untyped_storage().data_ptr(), f"aliases {k}"
    y.add_(1)  # writing the result leaves the inputs alone
    for k, v in layer.items():
        assert torch.equal(v, before[k])


def test_int_latents_give_default_dtype(rng):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    layer["latent_tokens"] = torch.randint(-3, 4, (2, 32))
    y = mxfp4x.mxfp4_experts(**layer)
    assert y.dtype == torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert mxfp4x.mxfp4_experts(**layer).dtype == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_int_mixture_and_shared_are_promoted(rng):
    layer = random_layer(rng, 2, 2, 2, 3, 1)
    layer["mixture_weights"] = torch.tensor([[1, 2], [0, 1]])
    layer["shared_output"] = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ref = mxfp4x.mxfp4_experts(**dict(layer, mixture_weights=layer["mixture_weights"].float(),
                                      shared_output=layer["shared_output"].float()))
    assert torch.equal(mxfp4x.mxfp4_experts(**layer), ref)


def _bad(layer, **change):
    return dict(layer, **change)


BAD_CASES = [
    # (name, change(layer) -> kwargs, exception, pattern that must appear)
    ("latent rank", lambda L: _bad(L, latent_tokens=L["latent_tokens"][0]), ValueError,
     r"latent_tokens.*2-D.*\(64,\)"),
    ("latent d_in", lambda L: _bad(L, latent_tokens=L["latent_tokens"][:, :40]), ValueError,
     r"latent_tokens.*multiple of 32"),
    ("latent complex", lambda L: _bad(L, latent_tokens=L["latent_tokens"].to(torch.complex64)),
     TypeError, r"latent_tokens.*complex64"),
    ("latent bool", lambda L: _bad(L, latent_tokens=L["latent_tokens"] > 0), TypeError,
     r"latent_tokens.*bool"),
    ("packed rank", lambda L: _bad(L, packed_weights=L["packed_weights"][0]), ValueError,
     r"packed_weights.*4-D"),
    ("packed groups", lambda L: _bad(L, packed_weights=L["packed_weights"][:, :, :1]),
     ValueError, r"packed_weights.*\(n_experts, d_out, 2, 16\)"),
    ("packed last dim", lambda L: _bad(L, packed_weights=L["packed_weights"][..., :8]),
     ValueError, r"packed_weights.*16"),
    ("packed float", lambda L: _bad(L, packed_weights=L["packed_weights"].float()), TypeError,
     r"packed_weights.*float32"),
    ("packed int8 negative", lambda L: _bad(L, packed_weights=L["packed_weights"].view(
        torch.int8)), ValueError, r"packed_weights.*\[0, 255\].*view\(torch.uint8\)"),
    ("packed too big", lambda L: _bad(L, packed_weights=L["packed_weights"].long() + 200),
     ValueError, r"packed_weights.*\[0, 255\]"),
    ("scales shape", lambda L: _bad(L, scale_bytes=L["scale_bytes"][:, :-1]), ValueError,
     r"scale_bytes.*expected shape"),
    ("scales rank", lambda L: _bad(L, scale_bytes=L["scale_bytes"][0]), ValueError,
     r"scale_bytes.*3-D"),
    ("scales float", lambda L: _bad(L, scale_bytes=L["scale_bytes"].double()), TypeError,
     r"scale_bytes.*float64"),
    ("scales negative", lambda L: _bad(L, scale_bytes=L["scale_bytes"].long() - 200),
     ValueError, r"scale_bytes.*\[0, 255\]"),
    ("ids float", lambda L: _bad(L, selected_experts=L["selected_experts"].float()), TypeError,
     r"selected_experts.*float32"),
    ("ids too big", lambda L: _bad(L, selected_experts=L["selected_experts"] + 3), IndexError,
     r"selected_experts.*outside \[0, 3\)"),
    ("ids negative", lambda L: _bad(L, selected_experts=L["selected_experts"] - 3), IndexError,
     r"selected_experts.*-\d+.*outside \[0, 3\)"),
    ("ids rows", lambda L: _bad(L, selected_experts=L["selected_experts"][:-1]), ValueError,
     r"selected_experts.*4 rows"),
    ("ids rank", lambda L: _bad(L, selected_experts=L["selected_experts"][:, 0]), ValueError,
     r"selected_experts.*2-D"),
    ("mix shape", lambda L: _bad(L, mixture_weights=L["mixture_weights"][:, :1]), ValueError,
     r"mixture_weights.*\(4, 2\)"),
    ("mix bool", lambda L: _bad(L, mixture_weights=L["mixture_weights"] > 0), TypeError,
     r"mixture_weights.*bool"),
    ("shared shape", lambda L: _bad(L, shared_output=L["shared_output"][:, :-1]), ValueError,
     r"shared_output.*\(4, 5\)"),
    ("shared tokens", lambda L: _bad(L, shared_output=L["shared_output"][:-1]), ValueError,
     r"shared_output.*\(4, 5\)"),
    ("not an array", lambda L: _bad(L, latent_tokens="tokens"), TypeError,
     r"latent_tokens.*str"),
    ("object array", lambda L: _bad(L, mixture_weights=np.array([[None, 1]] * 4)), TypeError,
     r"mixture_weights.*object"),
    ("ragged list", lambda L: _bad(L, shared_output=[[1.0, 2.0], [3.0]]), ValueError,
     r"shared_output"),
]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("case", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_names_the_argument(rng, case, backend):
    _, change, exc, pattern = case
    layer = random_layer(rng, 4, 2, 3, 5, 2)
    layer["packed_weights"][0, 0, 0, 0] = 0xF0  # a byte that is negative as int8
    layer["scale_bytes"][0, 0, 0] = 250
    with pytest.raises(exc, match=pattern):
        mxfp4x.mxfp4_experts(**change(layer), backend=backend)


@pytest.mark.parametrize("value,exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError),
                                       (True, TypeError), ("2", TypeError)])
def test_bad_num_threads(rng, value, exc):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    with pytest.raises(exc, match="num_threads"):
        mxfp4x.mxfp4_experts(**layer, num_threads=value)


def test_bad_backend(rng):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    with pytest.raises(ValueError, match=re.escape("backend: expected one of ('auto', 'cpu', "
                                                   "'torch'), got 'gpu'")):
        mxfp4x.mxfp4_experts(**layer, backend="gpu")


def test_zero_experts_with_tokens_is_index_error(rng):
    layer = random_layer(rng, 2, 1, 1, 3, 1)
    layer["packed_weights"] = layer["packed_weights"][:0]
    layer["scale_bytes"] = layer["scale_bytes"][:0]
    with pytest.raises(IndexError, match=r"outside \[0, 0\)"):
        mxfp4x.mxfp4_experts(**layer)


def test_many_threads_requested(rng):
    layer = random_layer(rng, 3, 2, 3, 9, 2)
    assert torch.equal(mxfp4x.mxfp4_experts(**layer, num_threads=64),
                       mxfp4x.mxfp4_experts(**layer, num_threads=1))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_empty_rows_d_in_zero(isa, rng, backend):
    # d_in = 0: every dot product is 0, so y = shared + p * 0 (NaN where p is NaN or inf)
    layer = random_layer(rng, 5, 3, 2, 7, 0)
    layer["mixture_weights"][0, 0] = float("inf")
    y = mxfp4x.mxfp4_experts(**layer, backend=backend, isa=isa)
    expected = layer["shared_output"].clone()
    expected[0] = float("nan")
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert torch.equal(y[1:], expected[1:])


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.int16, torch.int8], ids=str)
def test_other_integer_dtypes(rng, dtype):
    layer = random_layer(rng, 3, 2, 3, 5, 1)
    layer["packed_weights"] %= 128  # int8 range too
    layer["scale_bytes"].clamp_(max=127)
    ref = mxfp4x.mxfp4_experts(**layer)
    other = {k: (v.to(dtype) if k in ("packed_weights", "scale_bytes", "selected_experts")
                 else v) for k, v in layer.items()}
    assert torch.equal(mxfp4x.mxfp4_experts(**other), ref)
    bad = dict(other, selected_experts=(layer["selected_experts"] + 3).to(dtype))
    with pytest.raises(IndexError, match="selected_experts"):
        mxfp4x.mxfp4_experts(**bad)


def test_numpy_uint32_bytes(rng):
    layer = random_layer(rng, 3, 2, 3, 5, 1)
    packed = layer["packed_weights"].numpy().astype(np.uint32)
    assert torch.equal(mxfp4x.mxfp4_experts(**dict(layer, packed_weights=packed)),
                       mxfp4x.mxfp4_experts(**layer))


def test_nested_input_is_a_type_error(rng):
    layer = random_layer(rng, 2, 4, 64, 4, 2)
    nested = torch.nested.nested_tensor([layer["latent_tokens"][0], layer["latent_tokens"][1]])
    with pytest.raises(TypeError, match="latent_tokens: expected a dense tensor, got a nested"):
        mxfp4x.mxfp4_experts(**dict(layer, latent_tokens=nested))


def test_sparse_input_is_a_type_error(rng):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    with pytest.raises(TypeError, match="shared_output.*strided"):
        mxfp4x.mxfp4_experts(**dict(layer, shared_output=layer["shared_output"].to_sparse()))


def _same_as_fresh(layer, **kw):
    """The call's result, and the same call on fresh copies of the weights (a table that
    was never cached): the two must be the same bits."""
    y = mxfp4x.mxfp4_experts(**layer, **kw)
    fresh = dict(layer, packed_weights=layer["packed_weights"].clone(),
                 scale_bytes=None if layer["scale_bytes"] is None else
                 layer["scale_bytes"].clone())
    return y, mxfp4x.mxfp4_experts(**fresh, **kw)


@pytest.mark.parametrize("form", ["split", "gguf"])
def test_weights_changed_in_place_or_replaced_are_read_again(rng, form):
    """Calls keep a table of each stacked weight tensor's addresses: whatever the caller
    does to the tensor between calls (new values, another storage, another shape or
    strides, another scale tensor), a call reads what the tensors hold then."""
    from mxfp4x._core import cpu_impl as _cpu_impl
    from mxfp4x.testing.layers import gguf_blocks_of

    layer = random_layer(rng, 5, 2, 4, 7, 3)
    if form == "gguf":
        blocks = gguf_blocks_of(layer["packed_weights"], layer["scale_bytes"])
        layer = dict(layer, packed_weights=torch.as_tensor(blocks), scale_bytes=None)
    packed = layer["packed_weights"]
    y0, ref0 = _same_as_fresh(layer)
    assert torch.equal(y0, ref0)
    assert id(packed) in _cpu_impl._TABLES  # kept, and then served
    assert torch.equal(mxfp4x.mxfp4_experts(**layer), ref0)
    # new values in place (the table holds addresses, never values)
    packed[:, :, :, -1].random_(0, 256, generator=torch.Generator().manual_seed(1))
    y1, ref1 = _same_as_fresh(layer)
    assert torch.equal(y1, ref1) and not torch.equal(y1, y0)
    # another storage behind the same tensor object
    other = torch.from_numpy(rng.integers(0, 256, tuple(packed.shape), dtype=np.uint8))
    if form == "gguf":  # keep valid scale bytes in the blocks
        other[..., 0] = packed[..., 0]
    packed.data = other
    y2, ref2 = _same_as_fresh(layer)
    assert torch.equal(y2, ref2) and not torch.equal(y2, y1)
    # the same bytes seen with other strides (a transposed copy, transposed back)
    packed.data = packed.data.transpose(0, 1).contiguous().transpose(0, 1)
    assert not packed.is_contiguous()
    y3, ref3 = _same_as_fresh(layer)
    assert torch.equal(y3, ref3) and torch.equal(y3, y2)
    # fewer experts: the same object resized in place
    packed.data = packed.data.contiguous()
    packed.resize_(3, *packed.shape[1:])
    layer["selected_experts"] = layer["selected_experts"] % 3
    if form == "split":
        layer["scale_bytes"] = layer["scale_bytes"][:3].clone()
    y4, ref4 = _same_as_fresh(layer)
    assert torch.equal(y4, ref4)
    if form == "split":  # another scale tensor with the same packed tensor
        layer["scale_bytes"] = layer["scale_bytes"] + 1
        y5, ref5 = _same_as_fresh(layer)
        assert torch.equal(y5, ref5) and not torch.equal(y5, y4)


def test_weights_are_not_kept_alive_by_calls(rng):
    """The tables calls keep own no tensor: weights the caller drops are freed at once,
    and their table with them."""
    import gc
    import weakref

    from mxfp4x._core import cpu_impl as _cpu_impl

    gc.collect()
    layer = random_layer(rng, 3, 2, 4, 7, 2)
    mxfp4x.mxfp4_experts(**layer)
    key = id(layer["packed_weights"])
    assert key in _cpu_impl._TABLES
    packed, scales = weakref.ref(layer["packed_weights"]), weakref.ref(layer["scale_bytes"])
    del layer
    assert packed() is None and scales() is None  # freed without a garbage collection
    assert key not in _cpu_impl._TABLES


def test_weights_with_strided_rows_are_copied_per_call(rng):
    """Stacked weights whose rows are not contiguous are copied for the call (the kernels
    read rows of contiguous bytes), never kept."""
    from mxfp4x._core import cpu_impl as _cpu_impl

    layer = random_layer(rng, 3, 2, 4, 7, 2)
    wide = torch.zeros(4, 7, 2, 32, dtype=torch.uint8)
    wide[..., ::2] = layer["packed_weights"]
    strided = dict(layer, packed_weights=wide[..., ::2])
    assert torch.equal(mxfp4x.mxfp4_experts(**strided), mxfp4x.mxfp4_experts(**layer))
    assert id(strided["packed_weights"]) not in _cpu_impl._TABLES


@pytest.mark.parametrize("x_dtype,mix_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float64, torch.bfloat16), (torch.float64, torch.float16)], ids=str)
def test_16bit_mixture_weights_read_as_they_are(rng, x_dtype, mix_dtype):
    """16-bit mixture weights reach the driver as they are and are converted there,
    exactly: the same bits as the weights converted beforehand, subnormal, negative and
    zero weights included, forward and latents' gradient."""
    layer = random_layer(rng, 7, 3, 4, 9, 2, dtype=x_dtype)
    mix = torch.from_numpy(rng.standard_normal((7, 3))).to(mix_dtype)
    mix[0, 0], mix[1, 1], mix[2, 2] = 0.0, -0.0, torch.finfo(mix_dtype).tiny / 4
    compute = accumulation_dtype(x_dtype)
    y = mxfp4x.mxfp4_experts(**dict(layer, mixture_weights=mix))
    ref = mxfp4x.mxfp4_experts(**dict(layer, mixture_weights=mix.to(compute)))
    assert torch.equal(y.view(torch.uint8), ref.view(torch.uint8))
    x = layer["latent_tokens"].clone().requires_grad_()
    g = torch.from_numpy(rng.standard_normal(tuple(layer["shared_output"].shape))).to(x_dtype)
    grads = []
    for m in (mix, mix.to(compute)):
        x.grad = None
        mxfp4x.mxfp4_experts(**dict(layer, latent_tokens=x, mixture_weights=m)).backward(g)
        grads.append(x.grad.clone())
    assert torch.equal(grads[0].view(torch.uint8), grads[1].view(torch.uint8))


def test_driver_checks_the_mixture_dtype(rng):
    from mxfp4x._core import cpu as _cpu
    from mxfp4x._core import cpu_impl as _cpu_impl

    layer = random_layer(rng, 2, 2, 3, 5, 1)
    ex = _cpu_impl.experts_of(layer["packed_weights"], layer["scale_bytes"])
    call = dict(product="forward", compute="float32", selected=layer["selected_experts"].numpy(),
                mix=layer["mixture_weights"].numpy(), src=layer["latent_tokens"].numpy(),
                src_dtype="float32", src_rows="token", dst=np.zeros((2, 5), np.float32),
                dst_rows="token")
    with pytest.raises(ValueError, match="mix_dtype: expected 'float32', 'bfloat16' or "
                                         "'float16', got 'float64'"):
        _cpu.Call(ex, **call, mix_dtype="float64")
    with pytest.raises(ValueError, match=r"mix: expected a C-contiguous \(2, 2\) array of "
                                         r"2-byte items"):
        _cpu.Call(ex, **call, mix_dtype="bfloat16")
