"""The torch backend on CUDA; skipped without a GPU."""
import pytest
import torch

import mxfp4x
from mxfp4x.testing.layers import assert_matches_reference, random_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
def test_cuda_matches_reference(rng, dtype):
    layer = random_layer(rng, 9, 4, 6, 70, 5, dtype=dtype, repeat_expert=True)
    cuda = {k: v.cuda() for k, v in layer.items()}
    y = mxfp4x.mxfp4_experts(**cuda)
    assert y.device.type == "cuda" and y.dtype == dtype
    assert_matches_reference(y, layer)


def test_cuda_lists_follow_latents_device(rng):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    args = {k: v.tolist() for k, v in layer.items()}
    args["latent_tokens"] = layer["latent_tokens"].cuda()
    assert mxfp4x.mxfp4_experts(**args).device.type == "cuda"


def test_cuda_mixed_devices_is_an_error(rng):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    args = dict(layer, latent_tokens=layer["latent_tokens"].cuda())
    with pytest.raises(ValueError, match="packed_weights: on device cpu"):
        mxfp4x.mxfp4_experts(**args)
    with pytest.raises(ValueError, match="backend: 'cpu' needs CPU tensors"):
        mxfp4x.mxfp4_experts(**{k: v.cuda() for k, v in layer.items()}, backend="cpu")
