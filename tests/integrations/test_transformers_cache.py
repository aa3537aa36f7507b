"""mxfp4x.integrations.transformers.GrowingCache: the key/value cache that grows in place
hands the attention the same keys and values as transformers' DynamicCache, step after
step, through growths, moves and transformers' own operations on it (generate taking it
for the door's models: test_transformers.py)."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
pytest.importorskip("accelerate", reason="transformers' own mxfp4 loader wants accelerate")

from transformers.cache_utils import (  # noqa: E402
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

import mxfp4x.integrations.transformers as mxt  # noqa: E402
from mxfp4x.integrations.transformers import _cache  # noqa: E402


def _states(g, b, h, t, d, dtype):
    return ((torch.randn(b, h, t, d, generator=g) * 3).to(dtype),
            (torch.randn(b, h, t, d, generator=g) * 3).to(dtype))


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                       b.view(torch.uint8) if b.dtype != torch.float32 else b)


def _check(ours, theirs, got, want):
    for x, y in zip(got, want, strict=True):
        _same(x, y)
    _same(ours.keys, theirs.keys)
    _same(ours.values, theirs.values)
    assert ours.get_seq_length() == theirs.get_seq_length()
    for q in (1, 3):
        assert ours.get_mask_sizes(q) == theirs.get_mask_sizes(q)


@pytest.mark.parametrize("window", [None, 2, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_hand_out_what_transformers_layers_do(rng, monkeypatch, window, dtype):
    """A random run of prompts, decoding steps and chunks (past the buffers' room and the
    window many times), with transformers' operations on the layer in between."""
    monkeypatch.setattr(_cache, "_MIN_ROOM", 5)
    g = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    if window is None:
        ours, theirs = mxt.GrowingLayer(), DynamicLayer()
    else:
        ours = mxt.GrowingSlidingWindowLayer(sliding_window=window)
        theirs = DynamicSlidingWindowLayer(sliding_window=window)
    b, h, d = 3, 2, 5
    handed = []  # tensors handed out at earlier steps, and copies of them then
    for step in range(120):
        t = int(rng.choice([1, 1, 1, 2, 9, 31]))
        k, v = _states(g, b, h, t, d, dtype)
        k_in, v_in = k.clone(), v.clone()
        got, want = ours.update(k, v), theirs.update(k.clone(), v.clone())
        _check(ours, theirs, got, want)
        assert torch.equal(k, k_in) and torch.equal(v, v_in)  # inputs as given
        handed = handed[-30:] + [(x, x.clone()) for x in (*got, ours.keys, ours.values)]
        for x, then in handed:  # never written again
            assert torch.equal(x, then)
        if step % 17 == 16:  # transformers' operations replace the layer's tensors
            op = int(rng.integers(4))
            if op == 0 and (window is None or theirs.get_seq_length() < window):
                n = -int(rng.integers(1, 3))
                ours.crop(n)
                theirs.crop(n)
            elif op == 1:  # beam search's: the buffers kept, reordered
                idx = torch.from_numpy(rng.permutation(b))
                ours.reorder_cache(idx)
                theirs.reorder_cache(idx)
                assert ours._mxfp4x_buffers is not None
            elif op == 2 and b > 1:
                idx = torch.from_numpy(np.sort(rng.choice(b, b - 1, replace=False)))
                ours.batch_select_indices(idx)
                theirs.batch_select_indices(idx)
                b -= 1
            elif op == 3 and b < 4:
                ours.batch_repeat_interleave(2)
                theirs.batch_repeat_interleave(2)
                b *= 2
        if step == 80:
            ours.reset()
            theirs.reset()
            assert ours.get_seq_length() == theirs.get_seq_length() == 0


def test_growth_copies_once_per_quarter(monkeypatch):
    """A decoding step writes its token into room made beforehand: the buffer (its data
    pointer) changes once per growth, not every step; the handed-out views share it."""
    layer = mxt.GrowingLayer()
    g = torch.Generator().manual_seed(0)
    k, _ = layer.update(*_states(g, 1, 2, 1000, 4, torch.float32))
    growths, last = 0, k.untyped_storage().data_ptr()
    for _ in range(600):
        k, v = layer.update(*_states(g, 1, 2, 1, 4, torch.float32))
        growths += k.untyped_storage().data_ptr() != last
        last = k.untyped_storage().data_ptr()
    assert layer.get_seq_length() == 1600
    assert growths == 2  # room for 1256 tokens, at the 1257th 1571, at the 1572nd 1965
    assert k.stride(1) >= k.shape[2] * 4 and not k.is_contiguous()


def test_grow_in_place_leaves_other_layers_and_written_ones(rng):
    cfg = transformers.GptOssConfig(num_hidden_layers=4, sliding_window=8)
    cache = mxt.GrowingCache(config=cfg)
    kinds = [type(layer) for layer in cache.layers]
    assert set(kinds) == {mxt.GrowingLayer, mxt.GrowingSlidingWindowLayer}
    plain = DynamicCache(config=cfg)
    plain.layers[0].update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    _cache.grow_in_place(plain)
    assert type(plain.layers[0]) in (DynamicLayer, DynamicSlidingWindowLayer)
    assert type(plain.layers[1]) in (mxt.GrowingLayer, mxt.GrowingSlidingWindowLayer)


def test_growing_cache_config_round_trip():
    assert mxt.Mxfp4xConfig().growing_cache is True
    assert "growing_cache=False" in repr(mxt.Mxfp4xConfig(growing_cache=False))


def test_layers_take_what_transformers_does_in_every_other_case(rng):
    """States of another dtype (promoted as torch.cat does), an update under autograd
    (transformers' own, no buffer), a prompt cached in inference mode and decoded
    outside it, a sliding layer recording its past, no config (layers made on use)."""
    g = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    for make in (lambda: (mxt.GrowingLayer(), DynamicLayer()),
                 lambda: (mxt.GrowingSlidingWindowLayer(sliding_window=6),
                          DynamicSlidingWindowLayer(sliding_window=6))):
        ours, theirs = make()
        k, v = _states(g, 1, 2, 7, 4, torch.bfloat16)
        with torch.inference_mode():
            _check(ours, theirs, ours.update(k, v), theirs.update(k, v))
        for dtype, grad in ((torch.bfloat16, False), (torch.float32, False),
                            (torch.float32, True), (torch.float32, False)):
            k, v = _states(g, 1, 2, 1, 4, dtype)
            k.requires_grad_(grad)
            got, want = ours.update(k, v), theirs.update(k, v)
            assert got[0].requires_grad == want[0].requires_grad
            _check(ours, theirs, [x.detach() for x in got], [x.detach() for x in want])
        assert ours.keys.dtype == torch.float32 and ours.keys.requires_grad
    ours = mxt.GrowingSlidingWindowLayer(sliding_window=4)
    theirs = DynamicSlidingWindowLayer(sliding_window=4)
    for layer in (ours, theirs):
        layer.activate_past_recording()
    for t in (5, 1, 2):
        k, v = _states(g, 2, 1, t, 3, torch.float32)
        _check(ours, theirs, ours.update(k, v), theirs.update(k, v))
    cache = mxt.GrowingCache()
    for _ in range(3):
        cache.update(*_states(g, 1, 2, 1, 4, torch.float32), 0)
    assert type(cache.layers[0]) is mxt.GrowingLayer and cache.get_seq_length() == 3
    assert cache.layers[0]._mxfp4x_buffers is not None
