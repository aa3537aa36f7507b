"""Determinism: bit-identical across thread counts, repeated calls and batches."""
import pytest
import torch

import mxfp4x
from mxfp4x._testing import random_layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("n_tokens", [1, 37])
def test_bitwise_equal_across_thread_counts(isa, rng, dtype, n_tokens):
    layer = random_layer(rng, n_tokens, 4, 6, 300, 9, dtype=dtype, repeat_expert=True)
    results = [mxfp4x.mxfp4_experts(**layer, num_threads=n, isa=isa) for n in (1, 2, 3, 1)]
    for r in results[1:]:
        assert torch.equal(r.view(torch.uint8), results[0].view(torch.uint8))


def test_batch_invariance(isa, rng):
    # a token's row does not depend on the batch around it (gemv vs panel paths)
    layer = random_layer(rng, 40, 4, 3, 150, 7)
    full = mxfp4x.mxfp4_experts(**layer, isa=isa)
    for t in (0, 17, 39):
        alone = mxfp4x.mxfp4_experts(**{k: v[t:t + 1] if k != "packed_weights" and
                                        k != "scale_bytes" else v for k, v in layer.items()},
                                     isa=isa)
        assert torch.equal(alone[0], full[t])
    seven = mxfp4x.mxfp4_experts(**{k: v[10:17] if k not in ("packed_weights", "scale_bytes")
                                    else v for k, v in layer.items()}, isa=isa)
    assert torch.equal(seven, full[10:17])
