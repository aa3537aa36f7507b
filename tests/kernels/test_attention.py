"""The attention of a few query tokens over a key/value cache (include/mxfp4x/attention.h,
mxfp4x._core.attention.decode_attention): against float64, the same bits on every ISA,
thread count and batch, special values, and the calls it leaves to its caller."""
import math

import numpy as np
import pytest
import torch

from mxfp4x._core import cpu as _cpu
from mxfp4x._core.attention import decode_attention

UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _inputs(rng, b, hq, hkv, tq, tk, d, dtype, mask_heads=1, spare=0):
    """Random heads (scaled so that scores spread over several units), a mask of
    finfo.min and 0 (with `spare` more keys than cached, as transformers' masks may
    have), sinks."""
    g = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    q = (torch.randn(b, hq, tq, d, generator=g) * 0.7).to(dtype)
    k = (torch.randn(b, hkv, tk, d, generator=g) * 0.7).to(dtype)
    v = (torch.randn(b, hkv, tk, d, generator=g) * torch.logspace(-2, 1, d)).to(dtype)
    drop = torch.rand(b, mask_heads, tq, tk + spare, generator=g) < 0.25
    mask = torch.zeros(drop.shape).masked_fill(drop, torch.finfo(dtype).min).to(dtype)
    sinks = torch.randn(hq, generator=g).to(dtype)
    return q, k, v, mask, sinks


def _scores(q, k, mask, scaling):
    """float64 of the masked scores (B, HQ, TQ, TK) from the same inputs."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = q.double() @ kk.transpose(2, 3) * scaling
    if mask is not None:
        s = s + mask[..., :k.shape[2]].double()
    return s


def _reference(q, k, v, mask, sinks, scaling):
    """float64 of the formula from the same inputs, in (B, TQ, HQ, D)."""
    b, hq, tq, _ = q.shape
    g = hq // k.shape[1]
    vv = v.double().repeat_interleave(g, 1)
    s = _scores(q, k, mask, scaling)
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(1, -1, 1, 1).expand(b, -1, tq, 1)], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ vv).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, hq, hkv, tq, tk, d", [
    (1, 64, 8, 1, 137, 64),   # gpt-oss's heads, one token: the pairs' fast path
    (2, 12, 3, 3, 37, 24),    # a head size that no vector divides, keys past a block
    (3, 8, 8, 1, 5, 40),      # no grouping, fewer keys than a block
    (1, 16, 2, 5, 130, 80),   # several passes of rows per head
    (2, 6, 2, 2, 1, 16),      # one key
])
@pytest.mark.parametrize("with_mask, with_sinks", [(True, True), (False, False),
                                                   (True, False)])
def test_attention_within_roundings_of_float64(rng, isa, dtype, b, hq, hkv, tq, tk, d,
                                               with_mask, with_sinks):
    q, k, v, mask, sinks = _inputs(rng, b, hq, hkv, tq, tk, d, dtype, spare=3)
    mask = mask if with_mask else None
    sinks = sinks if with_sinks else None
    scaling = 0.125
    with torch.no_grad():
        out = decode_attention(q, k, v, mask, sinks, scaling, isa=isa)
    assert out is not None and out.dtype == dtype and out.shape == (b, tq, hq, d)
    ref = _reference(q, k, v, mask, sinks, scaling)
    # float32 roundings along d and the keys (relative to the values' size), then one to
    # the output's dtype, which they may push across a midpoint (2 units, one ulp; below
    # the dtype's smallest normal the ulp is that of the smallest normal: float16's
    # subnormals); a head or key read in the wrong place is off by the values' size.
    # Each score is rounded in float32 near its size, and e_j = exp(s_j - m) sees that
    # as relative to m, the row's largest logit: a row whose keys are all masked (no sink)
    # has m near the mask's finfo.min, every e_j off by up to |m| 2^-23 relative
    scale = v.double().abs().amax(dim=2).repeat_interleave(hq // hkv, 1).unsqueeze(1)
    m = _scores(q, k, mask, scaling).amax(-1)
    if sinks is not None:
        m = torch.maximum(m, sinks.double().reshape(1, -1, 1))
    m = m.abs().transpose(1, 2).unsqueeze(-1)  # (b, tq, hq, 1)
    err = (out.double() - ref).abs()
    bound = (2 * UNIT[dtype] * ref.abs().clamp(min=torch.finfo(dtype).tiny)
             + ((4 * d + 4 * tk + 64) + 2 * m) * 2.0 ** -22 * scale)
    assert (err <= bound).all(), (err - bound).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_bits_on_every_isa_thread_count_and_batch(rng, isa, dtype):
    q, k, v, mask, sinks = _inputs(rng, 3, 16, 2, 2, 301, 64, dtype, mask_heads=16)
    with torch.no_grad():
        base = decode_attention(q, k, v, mask, sinks, 0.125, num_threads=1, isa="scalar")
        for threads in (1, 2, 3):
            out = decode_attention(q, k, v, mask, sinks, 0.125, num_threads=threads, isa=isa)
            assert torch.equal(out.view(torch.uint8), base.view(torch.uint8))
        alone = decode_attention(q[1:2], k[1:2], v[1:2], mask[1:2], sinks, 0.125, isa=isa)
        assert torch.equal(alone.view(torch.uint8), base[1:2].view(torch.uint8))
        # a cache read through views of longer buffers (the keys' and the values' of
        # different lengths, so their strides differ), a mask through a slice
        longer = [torch.cat([t, t[:, :, :n]], 2) for t, n in ((k, 7), (v, 12))]
        cut = decode_attention(q, longer[0][:, :, :301], longer[1][:, :, :301],
                               torch.cat([mask, mask[..., :5]], -1), sinks, 0.125, isa=isa)
        assert torch.equal(cut.view(torch.uint8), base.view(torch.uint8))
        # keys cached as (batch, tokens, heads, d), read through a transposed view
        rows = decode_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, mask,
                                sinks, 0.125, isa=isa)
        assert torch.equal(rows.view(torch.uint8), base.view(torch.uint8))
        # values whose last dimension is strided (every other element of a wider cache):
        # copied first, the same bits
        wide = torch.stack([v, torch.randn(v.shape).to(dtype)], -1).flatten(-2)[..., ::2]
        assert wide.stride(-1) == 2
        spread = decode_attention(q, k, wide, mask, sinks, 0.125, isa=isa)
        assert torch.equal(spread.view(torch.uint8), base.view(torch.uint8))


def test_attention_special_values(isa):
    b, hq, hkv, tq, tk, d = 1, 4, 2, 1, 20, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for h, t in
               ((hq, tq), (hkv, tk), (hkv, tk)))
    mask = torch.zeros(b, hq, tq, tk)
    mask[0, 0] = -math.inf  # every key of head 0 masked out
    mask[0, 1, 0, :-1] = -math.inf  # head 1 keeps its last key alone
    with torch.no_grad():
        out = decode_attention(q, k, v, mask, None, 0.5, isa=isa)
        # no keys and no sink: a softmax of -inf's, NaN (as torch's); one key: its value
        assert torch.isnan(out[0, 0, 0]).all()
        assert torch.equal(out[0, 0, 1], v[0, 0, -1])
        assert torch.isfinite(out[0, 0, 2:]).all()
        # a sink keeps a fully masked row finite: zero weight on every key
        sunk = decode_attention(q, k, v, mask, torch.zeros(hq), 0.5, isa=isa)
        assert torch.equal(sunk[0, 0, 0], torch.zeros(d))
        # a NaN reaches the rows that read it, and only those
        qn = q.clone()
        qn[0, 2, 0, 3] = math.nan
        bad = decode_attention(qn, k, v, None, None, 0.5, isa=isa)
        assert torch.isnan(bad[0, 0, 2]).all()
        assert torch.isfinite(bad[0, 0, [0, 1, 3]]).all()
        sink_nan = decode_attention(q, k, v, None, torch.tensor([0, math.nan, 0, 0]), 0.5,
                                    isa=isa)
        assert torch.isnan(sink_nan[0, 0, 1]).all() and torch.isfinite(sink_nan[0, 0, 0]).all()


def test_attention_leaves_other_calls_to_the_caller():
    q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8)
    with torch.no_grad():
        assert decode_attention(q.double(), kv.double(), kv.double(), None, None, 1.0) is None
        assert decode_attention(q, kv.bfloat16(), kv.bfloat16(), None, None, 1.0) is None
        assert decode_attention(q, kv, kv, torch.ones(1, 1, 1, 5, dtype=torch.bool), None,
                                1.0) is None
        assert decode_attention(q, kv, kv, torch.zeros(1, 3, 1, 5), None, 1.0) is None
        assert decode_attention(q, kv, kv, torch.zeros(1, 1, 1, 4), None, 1.0) is None
        assert decode_attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), None,
                                None, 1.0) is None
    assert decode_attention(q.requires_grad_(), kv, kv, None, None, 1.0) is None


def test_attention_errors_name_the_argument():
    f32 = np.zeros

    def call(**over):
        args = dict(q=f32((1, 4, 1, 8), np.float32), k=f32((1, 2, 5, 8), np.float32),
                    v=f32((1, 2, 5, 8), np.float32), mask=None, sinks=None,
                    out=f32((1, 1, 4, 8), np.float32))
        args.update(over)
        _cpu.attention(args["q"], args["k"], args["v"], args["mask"], args["sinks"],
                       args["out"], "float32", "float32", "float32", 1.0)

    call()
    with pytest.raises(ValueError, match="k: 3 key/value heads"):
        call(k=f32((1, 3, 5, 8), np.float32), v=f32((1, 3, 5, 8), np.float32))
    with pytest.raises(ValueError, match=r"v: expected a \(1, 2, 5, 8\) array"):
        call(v=f32((1, 2, 4, 8), np.float32))
    with pytest.raises(ValueError, match="k: .* its last dimension contiguous"):
        call(k=f32((1, 2, 5, 16), np.float32)[..., ::2])
    with pytest.raises(ValueError, match="v: expected a 4-D array"):
        call(v=[0.0])
    call(k=f32((2, 3, 9, 8), np.float32)[1:, 1:, 2:7])  # a view: any strides but the last
    with pytest.raises(ValueError, match="out: expected a C-contiguous"):
        call(out=f32((1, 4, 1, 8), np.float32))
    with pytest.raises(ValueError, match="mask: expected a 4-D array"):
        call(mask=f32((1, 1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="sinks: expected a C-contiguous"):
        call(sinks=f32(3, np.float32))
    with pytest.raises(ValueError, match="q: expected a 4-D array"):
        call(q=f32((4, 1, 8), np.float32))
    with pytest.raises(ValueError, match="dtype: expected"):
        _cpu.attention(f32((1, 4, 1, 8)), f32((1, 2, 5, 8)), f32((1, 2, 5, 8)), None, None,
                       f32((1, 1, 4, 8)), "float64", "float32", "float32", 1.0)
