"""Property tests (hypothesis): random shapes, dtypes, layouts and input forms
against the reference, and exact algebraic identities of the op."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x.testing.layers import assert_matches_reference, random_layer

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

shapes = st.tuples(st.integers(0, 12), st.integers(1, 4), st.integers(1, 6),
                   st.integers(1, 40), st.integers(1, 4))  # T, K, E, O, G


def _strided(t):
    big = torch.empty(t.shape + (3,), dtype=t.dtype)
    big[..., 1] = t
    return big[..., 1]


def _as_form(layer, form):
    if form == "numpy":
        return {k: v.numpy() if v.dtype != torch.bfloat16 else v for k, v in layer.items()}
    if form == "lists":
        # integer inputs as lists (they become int64); float lists would become the
        # default float dtype, a different input.  An empty list has no (0, K) shape.
        ints = ("packed_weights", "scale_bytes", "selected_experts")
        if layer["latent_tokens"].shape[0] == 0:
            return layer
        return {k: v.tolist() if k in ints else v for k, v in layer.items()}
    if form == "strided":
        return {k: _strided(v) for k, v in layer.items()}
    if form == "transposed":
        # the same values through transposed storage
        return {k: v.T.contiguous().T if v.dim() == 2 else v for k, v in layer.items()}
    return layer


@given(shape=shapes, seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES),
       index_dtype=st.sampled_from([torch.int32, torch.int64]),
       backend=st.sampled_from(["cpu", "torch"]),
       isa=st.sampled_from(_cpu.runnable_isas()),
       form=st.sampled_from(["torch", "numpy", "lists", "strided", "transposed"]),
       repeat=st.booleans())
def test_random_calls_match_reference(shape, seed, dtype, index_dtype, backend, isa, form,
                                      repeat):
    layer = random_layer(np.random.default_rng(seed), *shape, dtype=dtype,
                         index_dtype=index_dtype, repeat_expert=repeat)
    y = mxfp4x.mxfp4_experts(**_as_form(layer, form), backend=backend, isa=isa)
    assert y.dtype == dtype and y.shape == (shape[0], shape[3])
    assert_matches_reference(y, layer)


@given(shape=shapes, seed=st.integers(0, 2**32 - 1), k=st.integers(-12, 12),
       backend=st.sampled_from(["cpu", "torch"]))
def test_scale_byte_plus_k_multiplies_by_2_to_the_k(shape, seed, k, backend):
    layer = random_layer(np.random.default_rng(seed), *shape, scale_range=(100, 140))
    layer["shared_output"].zero_()
    y = mxfp4x.mxfp4_experts(**layer, backend=backend)
    shifted = dict(layer, scale_bytes=layer["scale_bytes"] + k)
    y_k = mxfp4x.mxfp4_experts(**shifted, backend=backend)
    assert torch.equal(y_k, torch.ldexp(y, torch.tensor(k)))


@given(shape=shapes, seed=st.integers(0, 2**32 - 1), backend=st.sampled_from(["cpu", "torch"]))
def test_linear_in_mixture_weights(shape, seed, backend):
    rng = np.random.default_rng(seed)
    layer = random_layer(rng, *shape)
    layer["shared_output"].zero_()
    y = mxfp4x.mxfp4_experts(**layer, backend=backend)
    # doubling every weight doubles the result exactly (every rounding scales by 2)
    y2 = mxfp4x.mxfp4_experts(**dict(layer, mixture_weights=2 * layer["mixture_weights"]),
                              backend=backend)
    assert torch.equal(y2, 2 * y)
    # p1 + p2 within the float32 bound of the sum
    p2 = torch.from_numpy(rng.standard_normal(layer["mixture_weights"].shape)).float()
    y_b = mxfp4x.mxfp4_experts(**dict(layer, mixture_weights=p2), backend=backend)
    both = dict(layer, mixture_weights=layer["mixture_weights"] + p2)
    y_sum = mxfp4x.mxfp4_experts(**both, backend=backend)
    assert_matches_reference(y_sum, both)
    np.testing.assert_allclose(y_sum.numpy(), (y + y_b).numpy(), rtol=1e-4,
                               atol=1e-4 * (float(y_sum.abs().max()) + 1 if y_sum.numel() else 1))


@given(shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_negated_latents_negate_the_result(shape, seed):
    layer = random_layer(np.random.default_rng(seed), *shape)
    layer["shared_output"].zero_()
    y = mxfp4x.mxfp4_experts(**layer)
    y_neg = mxfp4x.mxfp4_experts(**dict(layer, latent_tokens=-layer["latent_tokens"]))
    assert torch.equal(y_neg, -y)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_only_selected_experts_matter(rng, backend):
    # garbage (NaN scales) in experts nobody selected never reaches the result
    layer = random_layer(rng, 5, 2, 6, 9, 2)
    layer["selected_experts"] %= 3
    poisoned = dict(layer, scale_bytes=layer["scale_bytes"].clone())
    poisoned["scale_bytes"][3:] = 255
    assert torch.equal(mxfp4x.mxfp4_experts(**poisoned, backend=backend),
                       mxfp4x.mxfp4_experts(**layer, backend=backend))
