"""Determinism: bit-identical across thread counts, repeated calls and batches."""
import pytest
import torch

import mxfp4x
from mxfp4x.testing.layers import random_layer


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_long_batches_run_in_token_chunks_with_the_same_bits(isa, rng, monkeypatch, dtype):
    # a long prefill runs in chunks of tokens (flat memory): forced down to chunks of 3
    # tokens here, every product (per token, per slot, per-slot latents, the transposed
    # one) must keep its bits, and a chunk boundary must not drop or repeat a token
    from mxfp4x import _cpu_impl
    layer = random_layer(rng, 11, 3, 5, 70, 5, dtype=dtype, repeat_expert=True)
    w = (layer["packed_weights"], layer["scale_bytes"])
    x, sel, mix = layer["latent_tokens"], layer["selected_experts"], layer["mixture_weights"]
    slot_x = torch.from_numpy(rng.standard_normal((11, 3, x.shape[1]))).to(dtype)
    grad = torch.from_numpy(rng.standard_normal((11, 70))).to(dtype)
    calls = {
        "tokens": lambda: mxfp4x.mxfp4_experts(**layer, isa=isa),
        "slots": lambda: mxfp4x.mxfp4_experts_slots(x, *w, sel, isa=isa),
        "slot_latents": lambda: mxfp4x.mxfp4_experts(slot_x, *w, sel, mix,
                                                     layer["shared_output"], isa=isa),
        "grad": lambda: torch.ops.mxfp4x.mxfp4_experts_grad_latents(grad, *w, sel, mix, x,
                                                                    isa=isa),
    }
    whole = {name: call() for name, call in calls.items()}
    monkeypatch.setattr(_cpu_impl, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(_cpu_impl, "_MIN_CHUNK_TOKENS", 3)
    assert len(_cpu_impl._chunks(11, 4)) == 4
    for name, call in calls.items():
        chunked = call()
        assert chunked.shape == whole[name].shape and chunked.dtype == whole[name].dtype
        assert torch.equal(chunked.view(torch.uint8), whole[name].view(torch.uint8)), name
