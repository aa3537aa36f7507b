"""The op against the float64 reference: every dtype, both backends, every ISA."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x.testing.layers import assert_matches_reference, random_layer

FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SPEC_EXAMPLE = dict(latent_tokens=[[1] * 32], packed_weights=[[[[34] * 16]]],
                    scale_bytes=[[[127]]], selected_experts=[[0]], mixture_weights=[[1]],
                    shared_output=[[0]])


@pytest.mark.parametrize("backend", ["auto", "cpu", "torch"])
@pytest.mark.parametrize("form", ["lists", "numpy", "torch_int64", "torch_uint8"])
def test_spec_example(form, backend):
    if form == "lists":
        args = SPEC_EXAMPLE
    elif form == "numpy":
        args = {k: np.array(v) for k, v in SPEC_EXAMPLE.items()}
    elif form == "torch_int64":
        args = {k: torch.tensor(v) for k, v in SPEC_EXAMPLE.items()}
        assert all(v.dtype == torch.int64 for v in args.values())
    else:
        args = {k: torch.tensor(v) for k, v in SPEC_EXAMPLE.items()}
        args["packed_weights"] = args["packed_weights"].to(torch.uint8)
        args["scale_bytes"] = args["scale_bytes"].to(torch.uint8)
        args["latent_tokens"] = args["latent_tokens"].float()
    y = mxfp4x.mxfp4_experts(**args, backend=backend)
    assert isinstance(y, torch.Tensor)
    assert y.dtype == torch.get_default_dtype() and y.shape == (1, 1)
    assert torch.equal(y, torch.tensor([[32.0]]))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [  # (T, K, E, O, G)
    (1, 1, 1, 1, 1), (1, 4, 8, 37, 3), (7, 2, 5, 33, 2), (16, 3, 4, 70, 5), (3, 8, 3, 5, 1),
])
def test_cpu_matches_reference(isa, rng, dtype, shape):
    layer = random_layer(rng, *shape, dtype=dtype, repeat_expert=True)
    y = mxfp4x.mxfp4_experts(**layer, backend="cpu", isa=isa)
    assert y.dtype == dtype and y.shape == (shape[0], shape[3])
    assert_matches_reference(y, layer)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4, 8, 37, 3), (9, 2, 5, 33, 2), (5, 3, 2, 1, 4)])
def test_torch_backend_matches_reference(rng, dtype, shape):
    layer = random_layer(rng, *shape, dtype=dtype, repeat_expert=True)
    y = mxfp4x.mxfp4_experts(**layer, backend="torch")
    assert y.dtype == dtype and y.shape == (shape[0], shape[3])
    assert_matches_reference(y, layer)


def test_model_like_slice(rng):
    # gpt-oss-like width (I = 2880, 90 groups), a tall expert, T spanning gemv and panel paths
    layer = random_layer(rng, 5, 4, 6, 130, 90, repeat_expert=True)
    for backend in ("cpu", "torch"):
        assert_matches_reference(mxfp4x.mxfp4_experts(**layer, backend=backend), layer)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_zero_tokens(rng, backend):
    layer = random_layer(rng, 0, 3, 4, 9, 2)
    y = mxfp4x.mxfp4_experts(**layer, backend=backend)
    assert y.shape == (0, 9) and y.dtype == torch.float32


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_zero_top_k_returns_shared(rng, backend):
    layer = random_layer(rng, 4, 0, 4, 9, 2)
    y = mxfp4x.mxfp4_experts(**layer, backend=backend)
    assert torch.equal(y, layer["shared_output"])
    assert y.data_ptr() != layer["shared_output"].data_ptr()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_repeated_expert_counts_twice(rng, backend):
    layer = random_layer(rng, 3, 2, 2, 11, 2)
    layer["selected_experts"][:] = 1
    y = mxfp4x.mxfp4_experts(**layer, backend=backend)
    assert_matches_reference(y, layer)
    # the same sum with the two weights added: within the documented bound of its own
    # reference (which equals the doubled one's up to float64 rounding), not a fixed atol
    single = dict(layer, selected_experts=layer["selected_experts"][:, :1],
                  mixture_weights=layer["mixture_weights"].sum(1, keepdim=True))
    assert_matches_reference(mxfp4x.mxfp4_experts(**single, backend=backend), single)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_index_dtypes(rng, index_dtype, backend):
    layer = random_layer(rng, 6, 3, 7, 13, 2, index_dtype=index_dtype)
    assert_matches_reference(mxfp4x.mxfp4_experts(**layer, backend=backend), layer)


def _strided(t):
    """A non-contiguous view holding the same values as t."""
    big = torch.empty(t.shape + (2,), dtype=t.dtype)
    big[..., 0] = t
    return big[..., 0]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_non_contiguous_views(isa, rng, backend):
    layer = random_layer(rng, 5, 2, 4, 17, 3, dtype=torch.bfloat16)
    views = {k: _strided(v) for k, v in layer.items()}
    assert not any(v.is_contiguous() for v in views.values())
    y = mxfp4x.mxfp4_experts(**views, backend=backend, isa=isa)
    assert torch.equal(y, mxfp4x.mxfp4_experts(**layer, backend=backend, isa=isa))
    assert_matches_reference(y, layer)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_expert_and_row_slices_without_copy(rng, backend):
    # a slice of experts / rows of a bigger tensor: strided outer dims, contiguous groups
    layer = random_layer(rng, 4, 2, 8, 20, 2)
    sub = dict(layer, packed_weights=layer["packed_weights"][1::2, 3:15],
               scale_bytes=layer["scale_bytes"][1::2, 3:15],
               shared_output=layer["shared_output"][:, 3:15])
    sub["selected_experts"] = layer["selected_experts"] % 4
    assert_matches_reference(mxfp4x.mxfp4_experts(**sub, backend=backend), sub)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_numpy_and_list_inputs(rng, backend):
    layer = random_layer(rng, 3, 2, 3, 7, 1)
    as_np = {k: v.numpy() for k, v in layer.items()}
    as_list = {k: v.tolist() for k, v in layer.items()}
    ref = mxfp4x.mxfp4_experts(**layer, backend=backend)
    assert torch.equal(mxfp4x.mxfp4_experts(**as_np, backend=backend), ref)
    y = mxfp4x.mxfp4_experts(**as_list, backend=backend)  # lists -> int64 bytes, float32 values
    assert torch.equal(y, ref)


def test_readonly_numpy_weights(rng):
    layer = random_layer(rng, 2, 2, 3, 7, 1)
    packed = layer["packed_weights"].numpy().copy()
    packed.setflags(write=False)
    y = mxfp4x.mxfp4_experts(**dict(layer, packed_weights=packed))
    assert torch.equal(y, mxfp4x.mxfp4_experts(**layer))


def test_scale_255_is_nan_exactly_where_used(rng, isa):
    layer = random_layer(rng, 4, 1, 3, 6, 2)
    layer["selected_experts"][:] = torch.tensor([[0], [1], [2], [1]])
    layer["scale_bytes"][1, 2, 1] = 255
    for backend in ("cpu", "torch"):
        y = mxfp4x.mxfp4_experts(**layer, backend=backend, isa=isa)
        nan = torch.isnan(y)
        expected = torch.zeros_like(nan)
        expected[1, 2] = expected[3, 2] = True
        assert torch.equal(nan, expected)


def test_subnormal_scale_survives(isa):
    # s = 0: 2^-127 times code 1.5 times x = 1 must not be flushed, on fp32 and fp64
    for dtype in (torch.float32, torch.float64):
        for backend in ("cpu", "torch"):
            x = torch.zeros(1, 32, dtype=dtype)
            x[0, 0] = 1
            packed = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
            packed[0, 0, 0, 0] = 3  # element 0: code 3 = 1.5
            y = mxfp4x.mxfp4_experts(x, packed, torch.zeros(1, 1, 1, dtype=torch.uint8),
                                     [[0]], [[1.0]], torch.zeros(1, 1), backend=backend, isa=isa)
            assert y.item() == 1.5 * 2.0 ** -127, (dtype, backend, y.item())
