"""mxfp4x.integrations.transformers.DecodeAttention and DecodeMLP: a decoding step's
attention layer as one compiled call (``mxfp4x._core.cpu.AttentionStep``) and its MLP as
two (``ExpertsStep``) give the bits of the pieces they replace, run one by one (the door's
dense kernels, transformers' rotary embedding, the growing cache, ``mxfp4x_grouped``, the
router, the experts' facade calls), and leave every other step to transformers."""
import copy
import pickle

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
pytest.importorskip("accelerate", reason="transformers' loader wants accelerate")

from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import (  # noqa: E402
    GptOssAttention,
    GptOssDecoderLayer,
    GptOssMLP,
    _apply_rotary_emb,
)

import mxfp4x.integrations.transformers as mxt  # noqa: E402
from mxfp4x._core import cpu as _cpu  # noqa: E402
from mxfp4x._core import cpu_impl  # noqa: E402
from mxfp4x.integrations.transformers import _cache, _decode  # noqa: E402
from mxfp4x.models.gpt_oss.experts import gpt_oss_experts  # noqa: E402

SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_local_experts=4,
             num_experts_per_tok=2, vocab_size=288, num_attention_heads=6,
             num_key_value_heads=2, head_dim=16, sliding_window=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mxfp4x.testing.gpt_oss import write_gpt_oss_model

    folder = str(tmp_path_factory.mktemp("gpt_oss_decode"))
    write_gpt_oss_model(folder, **SIZES)
    return folder


@pytest.fixture(scope="module")
def model(checkpoint):
    m = mxt.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    assert all(type(layer) is mxt.DecodeLayer and type(layer.self_attn) is
               mxt.DecodeAttention and type(layer.mlp) is mxt.DecodeMLP
               for layer in m.model.layers)
    return m


class _Counted:
    """Counts the decoding steps the compiled calls took and those they left, the
    attention's (``took``, ``left``) and the MLP's (``mlp_took``, ``mlp_left``), and the
    layers that ran transformers' forward (``layer_forward``), and the steps either took
    with their layer's norm and residual add inside (``fused``)."""

    def __init__(self, monkeypatch):
        self.took = self.left = self.mlp_took = self.mlp_left = self.layer_forward = 0
        self.fused = 0
        for name, kind in (("_decode_step", ""), ("_experts_step", "mlp_")):
            monkeypatch.setattr(_decode, name, self._counted(getattr(_decode, name), kind))
        plain = GptOssDecoderLayer.forward

        def layer_forward(*args, **kwargs):  # transformers' layer forward, DecodeLayer's too
            self.layer_forward += 1
            return plain(*args, **kwargs)
        monkeypatch.setattr(GptOssDecoderLayer, "forward", layer_forward)

    def _counted(self, step, kind):
        def counted(*args):
            out = step(*args)
            key = kind + ("left" if out is None else "took")
            setattr(self, key, getattr(self, key) + 1)
            norm = args[5 if kind == "" else 2] if len(args) > (5 if kind == "" else 2) \
                else None
            if out is not None and norm is not None:  # a norm and residual inside the call
                self.fused += 1
            return out
        return counted


def _fused(model, fused):
    """The decoding steps through the compiled calls (the door's classes) or not
    (transformers' own classes on the same pieces)."""
    for layer in model.model.layers:
        layer.__class__ = mxt.DecodeLayer if fused else GptOssDecoderLayer
        layer.self_attn.__class__ = mxt.DecodeAttention if fused else GptOssAttention
        layer.mlp.__class__ = mxt.DecodeMLP if fused else GptOssMLP


def _decode_run(model, fused, ids, mask, steps, width, cache_class=mxt.GrowingCache):
    """A prompt, then ``steps`` steps of ``width`` tokens each (every sequence's greedy
    pick repeated), through the compiled calls or not (:func:`_fused`): each step's
    logits and the cache."""
    _fused(model, fused)
    try:
        with torch.no_grad():
            cache = cache_class(config=model.config)
            out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
            logits = [out.logits]
            for _ in range(steps):
                tok = out.logits[:, -1:].float().argmax(-1).repeat(1, width)
                mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
                out = model(tok, attention_mask=mask, cache=cache, use_cache=True)
                logits.append(out.logits)
    finally:
        _fused(model, True)
    return logits, cache


def _same_bits(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("width", [1, 3, 6])
def test_decoding_steps_give_the_pieces_bits(model, monkeypatch, rng, batch, width):
    """Steps through the compiled call against the same steps through transformers'
    forward on the door's pieces: every logit and every cached key and value the same
    bits; past the sliding window (5) and through the buffers' growths (room of 3), left
    padding in the mask; 6 tokens in all take the bf16 unit where the CPU's default has
    one (else the step is transformers')."""
    monkeypatch.setattr(_cache, "_MIN_ROOM", 3)
    ids = torch.from_numpy(rng.integers(0, SIZES["vocab_size"], (batch, 7)))
    mask = torch.ones_like(ids)
    mask[1:, :int(rng.integers(1, 4))] = 0
    counted = _Counted(monkeypatch)
    ours, our_cache = _decode_run(model, True, ids, mask, 12, width)
    took = counted.took
    assert counted.layer_forward == 0  # DecodeLayer called its modules' forward itself
    fused = counted.fused
    theirs, their_cache = _decode_run(model, False, ids, mask, 12, width)
    for a, b in zip(ours, theirs, strict=True):
        _same_bits(a, b)
    for a, b in zip(our_cache.layers, their_cache.layers, strict=True):
        _same_bits(a.keys, b.keys)
        _same_bits(a.values, b.values)
        assert a.get_seq_length() == b.get_seq_length()
    takes = batch * width <= 4 or (batch * width <= 16 and _cpu.dense_unit())
    if takes and _cpu.default_isa() != "scalar":
        assert took > 0 and counted.left > 2  # the prompt and the growths: transformers'
        assert counted.mlp_took >= 2 * 12  # every step of both layers (and short prompts)
        assert fused >= took + 2 * 12  # every step the attention took, and the MLP's
    else:
        assert took == 0 and counted.mlp_took == 0 and fused == 0


def test_other_steps_are_transformers(model, checkpoint, monkeypatch, rng):
    """No growing cache, a hook on a projection, autograd, another attention, float32
    weights: transformers' forward, the same bits as without the class."""
    if _cpu.default_isa() == "scalar":
        pytest.skip("the door's dense kernels leave the scalar ISA's products to torch")
    ids = torch.from_numpy(rng.integers(0, SIZES["vocab_size"], (2, 6)))
    mask = torch.ones_like(ids)
    counted = _Counted(monkeypatch)
    got, _ = _decode_run(model, True, ids, mask, 3, 1, DynamicCache)
    want, _ = _decode_run(model, False, ids, mask, 3, 1, DynamicCache)
    for a, b in zip(got, want, strict=True):
        _same_bits(a, b)
    assert counted.took == 0
    calls = []
    proj = model.model.layers[0].self_attn.k_proj
    handle = proj.register_forward_hook(lambda *args: calls.append(1))
    try:
        _decode_run(model, True, ids, mask, 3, 1)
    finally:
        handle.remove()
    assert len(calls) == 4  # the prompt and 3 steps
    assert counted.took == 3  # the other layer's steps
    # a hook on the attention module itself: it runs, and so does the call
    counted.took = 0
    handle = model.model.layers[0].self_attn.register_forward_hook(
        lambda *args: calls.append(3))
    try:
        got, _ = _decode_run(model, True, ids, mask, 3, 1)
    finally:
        handle.remove()
    assert calls.count(3) == 4 and counted.took == 6
    for a, b in zip(got, _decode_run(model, False, ids, mask, 3, 1)[0], strict=True):
        _same_bits(a, b)
    # hooks on a layer's norms (DecodeLayer then calls its modules as transformers does):
    # they run, the compiled calls too, the same bits
    counted.took = counted.mlp_took = counted.layer_forward = 0
    layer = model.model.layers[1]
    handles = [layer.input_layernorm.register_forward_hook(lambda *args: calls.append(4)),
               layer.post_attention_layernorm.register_forward_pre_hook(
                   lambda *args: calls.append(5))]
    try:
        got, _ = _decode_run(model, True, ids, mask, 3, 1)
    finally:
        for handle in handles:
            handle.remove()
    assert calls.count(4) == calls.count(5) == 4 and counted.took == 6
    assert counted.layer_forward == 4  # that layer's: the prompt and 3 steps
    assert counted.mlp_took == 2 * (3 + int(_cpu.dense_unit()))
    for a, b in zip(got, _decode_run(model, False, ids, mask, 3, 1)[0], strict=True):
        _same_bits(a, b)
    counted.took = 3
    with torch.enable_grad():
        cache = mxt.GrowingCache(config=model.config)
        out = model(ids, cache=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True).logits.sum()
    eager = mxt.from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation="eager")
    wide = mxt.from_pretrained(checkpoint, dtype=torch.float32)
    for m in (eager, wide):
        assert type(m.model.layers[0].self_attn) is mxt.DecodeAttention
        _decode_run(m, True, ids, mask, 2, 1)
    assert counted.took == 3
    # the MLP: a hook on one layer's experts, a float32 intermediate, autograd
    counted.mlp_took = 0
    handle = model.model.layers[1].mlp.experts.register_forward_pre_hook(
        lambda *args: calls.append(2))
    try:
        _decode_run(model, True, ids, mask, 3, 1)
    finally:
        handle.remove()
    # the other layer's steps, and its prompt of 12 tokens on a bf16 unit
    assert calls.count(2) == 4 and counted.mlp_took == 3 + int(_cpu.dense_unit())
    counted.mlp_took = 0
    exact = mxt.from_pretrained(checkpoint, dtype=torch.bfloat16,
                                quantization_config=mxt.Mxfp4xConfig(float32_intermediate=True))
    _decode_run(exact, True, ids, mask, 2, 1)
    with torch.enable_grad():
        model(ids[:, :1]).logits.sum()
    assert counted.mlp_took == 0


def _bf16(rng, *shape, scale=1.0):
    return torch.from_numpy(rng.standard_normal(shape) * scale).to(torch.bfloat16)


def _bits(t):
    return t.view(torch.uint16).numpy()


@pytest.mark.parametrize("nb,t,h,hq,hkv,d,pos,start,cap", [
    (1, 1, 40, 6, 2, 6, 5, 0, 9), (2, 3, 72, 4, 4, 10, 7, 3, 12),
    (3, 2, 24, 8, 2, 16, 0, 0, 2), (1, 4, 130, 2, 1, 4, 9, 9, 13)])
def test_attention_step_gives_its_pieces_bits(isa, rng, nb, t, h, hq, hkv, d, pos, start,
                                              cap):
    """AttentionStep.run on every ISA against its pieces on that ISA: dense_bf16 with a
    bias and a bf16 result, transformers' rotary embedding (values down to bf16's
    subnormals), the cache's copy, attention with a mask (some keys -inf) and sinks, the
    output projection; the cache's tokens outside [pos, pos + t) untouched."""
    qw, kw = hq * d, hkv * d
    ws = [_bf16(rng, qw, h, scale=0.3), _bf16(rng, kw, h, scale=0.3),
          _bf16(rng, kw, h, scale=0.3), _bf16(rng, h, qw, scale=0.3)]
    bs = [_bf16(rng, qw), None, _bf16(rng, kw), _bf16(rng, h)]
    sinks = _bf16(rng, hq)
    scaling = d ** -0.5
    x = _bf16(rng, nb, t, h)
    x[0, 0, :3] = torch.tensor([3e-39, -1e-38, 5e-40])  # products into the subnormals
    angles = torch.from_numpy(rng.uniform(0, 6.3, (1, t, d // 2)))
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    kc, vc = _bf16(rng, nb, hkv, cap, d), _bf16(rng, nb, hkv, cap, d)
    tk = pos + t - start
    mask = _bf16(rng, nb, 1, t, tk)
    mask[0, 0, 0, 0] = -float("inf")
    step = _cpu.AttentionStep([_bits(w) for w in ws], [None if b is None else _bits(b)
                                                       for b in bs],
                              _bits(sinks), "bfloat16", hq, hkv, d, scaling)
    out = torch.empty(nb, t, h, dtype=torch.bfloat16)
    ours_k, ours_v = kc.clone(), vc.clone()
    step.run(_bits(x), _bits(cos), _bits(sin), _bits(ours_k), _bits(ours_v), pos, start,
             _bits(mask), "bfloat16", _bits(out), isa=isa, n_threads=2)

    def dense(a, w, b):
        o = torch.empty(a.shape[0], w.shape[0], dtype=torch.bfloat16)
        _cpu.dense_bf16(_bits(a), _bits(w), _bits(o), isa=isa, n_threads=1,
                        bias=None if b is None else _bits(b), bias_dtype="bfloat16",
                        out_dtype="bfloat16")
        return o
    rows = x.reshape(nb * t, h)
    q, k, v = (dense(rows, w, b).view(nb, t, -1, d).transpose(1, 2) for w, b in
               zip(ws[:3], bs[:3], strict=True))
    q = _apply_rotary_emb(q, cos.unsqueeze(1), sin.unsqueeze(1))
    k = _apply_rotary_emb(k, cos.unsqueeze(1), sin.unsqueeze(1))
    want_k, want_v = kc.clone(), vc.clone()
    want_k[:, :, pos:pos + t], want_v[:, :, pos:pos + t] = k, v
    att = torch.empty(nb, t, hq, d, dtype=torch.bfloat16)
    _cpu.attention(_bits(q.contiguous()), _bits(want_k[:, :, start:pos + t]),
                   _bits(want_v[:, :, start:pos + t]), _bits(mask), _bits(sinks), _bits(att),
                   "bfloat16", "bfloat16", "bfloat16", scaling, isa=isa, n_threads=1)
    want = dense(att.reshape(nb * t, qw), ws[3], bs[3]).view(nb, t, h)
    _same_bits(ours_k, want_k)
    _same_bits(ours_v, want_v)
    _same_bits(out, want)
    # and not by luck: the output is the attention of these tokens (float64, loosely)
    qf = q.double()
    kf = want_k[:, :, start:pos + t].double().repeat_interleave(hq // hkv, 1)
    vf = want_v[:, :, start:pos + t].double().repeat_interleave(hq // hkv, 1)
    s = qf @ kf.transpose(2, 3) * scaling + mask.double()
    s = torch.cat([s, sinks.double().view(1, hq, 1, 1).expand(nb, hq, t, 1)], -1)
    p = torch.softmax(s, -1)[..., :-1]
    ref = ((p @ vf).transpose(1, 2).reshape(nb * t, qw) @ ws[3].double().T
           + bs[3].double()).view(nb, t, h)
    assert (out.double() - ref).abs().max() <= 0.03 * ref.abs().max() + 1e-6
    # the layer's input norm first and its residual add after (DecodeLayer's call): the
    # norm's pass (rms_norm, a float32 weight as gpt-oss keeps it), then the same pieces,
    # then torch's bf16 add
    weight = torch.from_numpy(rng.uniform(0.5, 1.5, h).astype(np.float32))
    layer_in = _bf16(rng, nb, t, h, scale=3.0)
    normed = torch.empty_like(layer_in)
    _cpu.rms_norm(_bits(layer_in.reshape(nb * t, h)), "bfloat16", weight.numpy(), "float32",
                  _bits(normed.view(nb * t, h)), "bfloat16", 1e-5, isa=isa)
    fused_k, fused_v = kc.clone(), vc.clone()
    fused = torch.empty_like(out)
    step.run(_bits(layer_in), _bits(cos), _bits(sin), _bits(fused_k), _bits(fused_v), pos,
             start, _bits(mask), "bfloat16", _bits(fused), isa=isa, n_threads=2,
             norm=weight.numpy(), norm_dtype="float32", eps=1e-5, residual=True)
    pieces_k, pieces_v = kc.clone(), vc.clone()
    step.run(_bits(normed), _bits(cos), _bits(sin), _bits(pieces_k), _bits(pieces_v), pos,
             start, _bits(mask), "bfloat16", _bits(out), isa=isa, n_threads=1)
    _same_bits(fused_k, pieces_k)
    _same_bits(fused_v, pieces_v)
    _same_bits(fused, layer_in + out)
    assert not torch.equal(normed, layer_in) and not torch.equal(fused, out)


def test_attention_step_errors_name_the_argument(rng):
    h, hq, hkv, d = 32, 4, 2, 8
    ws = [_bits(_bf16(rng, *s)) for s in ((hq * d, h), (hkv * d, h), (hkv * d, h),
                                          (h, hq * d))]
    with pytest.raises(ValueError, match="weights\\[2\\]"):
        _cpu.AttentionStep(ws[:2] + [ws[0], ws[3]], [None] * 4, None, "float32", hq, hkv, d,
                           0.1)
    with pytest.raises(ValueError, match="hq, hkv, d"):
        _cpu.AttentionStep(ws, [None] * 4, None, "float32", hq, 3, d, 0.1)
    step = _cpu.AttentionStep(ws, [None] * 4, None, "float32", hq, hkv, d, 0.1)
    x, out = np.zeros((1, 2, h), np.uint16), np.zeros((1, 2, h), np.uint16)
    cos = np.zeros((1, 2, d // 2), np.uint16)
    kc = np.zeros((1, hkv, 6, d), np.uint16)
    args = dict(x=x, cos=cos, sin=cos, k_cache=kc, v_cache=kc.copy(), pos=3, start=0,
                mask=None, mask_dtype="float32", out=out)

    def run(**change):
        a = {**args, **change}
        step.run(a["x"], a["cos"], a["sin"], a["k_cache"], a["v_cache"], a["pos"],
                 a["start"], a["mask"], a["mask_dtype"], a["out"],
                 unit=change.get("unit", False), norm=change.get("norm"),
                 norm_dtype=change.get("norm_dtype", "float32"))
    run()
    for change, name in ((dict(x=np.zeros((1, 2, h + 1), np.uint16)), "x"),
                         (dict(x=np.zeros((1, 17, h), np.uint16)), "x"),
                         (dict(cos=np.zeros((1, 2, d), np.uint16)), "cos"),
                         (dict(k_cache=np.zeros((1, hkv, 6), np.uint16)), "k_cache"),
                         (dict(v_cache=np.zeros((1, hkv, 5, d), np.uint16)), "v_cache"),
                         (dict(pos=5), "pos"), (dict(start=4), "pos, start"),
                         (dict(mask=np.zeros((1, 1, 2, 4), np.uint16),
                               mask_dtype="bfloat16"), "mask"),
                         (dict(out=np.zeros((1, 2, h), np.float32)), "out"),
                         (dict(unit=True), "unit"),
                         (dict(norm=np.ones(h - 1, np.float32)), "norm"),
                         (dict(norm=np.ones(h, np.float32), norm_dtype="int8"),
                          "norm_dtype")):
        with pytest.raises((ValueError, TypeError), match=name):
            run(**change)


@pytest.mark.parametrize("n,top_k,e,h,f", [(1, 4, 8, 64, 32), (3, 2, 5, 96, 64),
                                           (6, 3, 4, 32, 96), (16, 1, 3, 64, 64)])
def test_experts_step_gives_the_facades_bits(isa, rng, n, top_k, e, h, f):
    """ExpertsStep.route and .run on every ISA against the router's dense product and
    gpt_oss_experts (the facade's calls) on that ISA: the same bits; random blocks and
    scales down to E8M0's smallest, an expert picked twice by one token."""
    u8 = torch.uint8
    gu = torch.from_numpy(rng.integers(0, 256, (e, 2 * f, h // 32, 16), np.uint8))
    gs = torch.from_numpy(rng.integers(118, 130, (e, 2 * f, h // 32), np.uint8))
    gs[0, 0, 0] = 0
    dn = torch.from_numpy(rng.integers(0, 256, (e, h, f // 32, 16), np.uint8))
    ds = torch.from_numpy(rng.integers(118, 130, (e, h, f // 32), np.uint8))
    assert gu.dtype == u8
    gub, dnb = _bf16(rng, e, 2 * f), _bf16(rng, e, h)
    router, router_bias = _bf16(rng, e, h, scale=0.2), _bf16(rng, e)
    x = _bf16(rng, n, h)
    sel = torch.from_numpy(rng.integers(0, e, (n, top_k)))
    sel[0, -1] = sel[0, 0]
    weights = torch.softmax(_bf16(rng, n, top_k).float(), -1).to(torch.bfloat16)
    step = _cpu.ExpertsStep(cpu_impl._call_experts(gu, gs), cpu_impl._call_experts(dn, ds),
                            _bits(gub), "bfloat16", _bits(dnb), "bfloat16", _bits(router),
                            _bits(router_bias), 7.0, 1.702)
    logits = torch.empty(n, e, dtype=torch.bfloat16)
    unit = n >= 5 and _cpu.dense_unit(isa)
    if n <= 4 or unit:
        step.route(_bits(x), _bits(logits), isa=isa, n_threads=2, unit=unit)
        want = torch.empty(n, e, dtype=torch.bfloat16)
        _cpu.dense_bf16(_bits(x), _bits(router), _bits(want), isa=isa, n_threads=1,
                        unit=unit, bias=_bits(router_bias), bias_dtype="bfloat16",
                        out_dtype="bfloat16")
        _same_bits(logits, want)
    out = torch.empty(n, h, dtype=torch.bfloat16)
    step.run(_bits(x), sel.numpy(), _bits(weights), _bits(out), isa=isa, n_threads=2)
    want = gpt_oss_experts(x, sel, weights, (gu, gs), gub, (dn, ds), dnb, limit=7.0,
                           alpha=1.702, num_threads=1, act_dtype=torch.bfloat16, isa=isa)
    _same_bits(out, want)
    assert out.abs().max() > 0
    # the post-attention norm inside route and the residual add inside run (DecodeLayer's
    # calls): the norm's pass, the same products on its rows, then torch's bf16 add
    weight = torch.from_numpy(rng.uniform(0.5, 1.5, h).astype(np.float32))
    stream = _bf16(rng, n, h, scale=3.0)
    normed = torch.empty_like(stream)
    _cpu.rms_norm(_bits(stream), "bfloat16", weight.numpy(), "float32", _bits(normed),
                  "bfloat16", 1e-5, isa=isa)
    if n <= 4 or unit:
        got = torch.empty_like(normed)
        step.route(_bits(stream), _bits(logits), isa=isa, n_threads=2, unit=unit,
                   norm=weight.numpy(), norm_dtype="float32", eps=1e-5, normed=_bits(got))
        _same_bits(got, normed)
        want = torch.empty(n, e, dtype=torch.bfloat16)
        step.route(_bits(normed), _bits(want), isa=isa, n_threads=1, unit=unit)
        _same_bits(logits, want)
    step.run(_bits(normed), sel.numpy(), _bits(weights), _bits(out), isa=isa, n_threads=2,
             residual=_bits(stream))
    want = gpt_oss_experts(normed, sel, weights, (gu, gs), gub, (dn, ds), dnb, limit=7.0,
                           alpha=1.702, num_threads=1, act_dtype=torch.bfloat16, isa=isa)
    _same_bits(out, stream + want)
    assert not torch.equal(out, want)


def test_experts_step_errors_name_the_argument(rng):
    e, h, f = 4, 32, 32
    tables = [cpu_impl._call_experts(
        torch.from_numpy(rng.integers(0, 256, (e, o, i // 32, 16), np.uint8)),
        torch.from_numpy(rng.integers(118, 130, (e, o, i // 32), np.uint8)))
        for o, i in ((2 * f, h), (h, f))]
    gub, dnb, router = (_bits(_bf16(rng, *s)) for s in ((e, 2 * f), (e, h), (e, h)))
    with pytest.raises(ValueError, match="gate_up, down"):
        _cpu.ExpertsStep(tables[1], tables[1], gub, "bfloat16", dnb, "bfloat16", router, None,
                         7.0, 1.7)
    with pytest.raises(ValueError, match="down_bias"):
        _cpu.ExpertsStep(*tables, gub, "bfloat16", gub, "bfloat16", router, None, 7.0, 1.7)
    step = _cpu.ExpertsStep(*tables, gub, "bfloat16", dnb, "bfloat16", router, None, 7.0, 1.7)
    x, out = np.zeros((2, h), np.uint16), np.zeros((2, h), np.uint16)
    sel, w = np.zeros((2, 3), np.int64), np.zeros((2, 3), np.uint16)
    step.run(x, sel, w, out)
    for args, name, error in (((x, sel.astype(np.int32), w, out), "selected", ValueError),
                              ((x, sel + e, w, out), "selected", IndexError),
                              ((x, sel, w[:, :2].copy(), out), "weights", ValueError),
                              ((x[:1].copy(), sel, w, out), "x", ValueError),
                              ((x, sel, w, out[:, :5].copy()), "out", ValueError)):
        with pytest.raises(error, match=name):
            step.run(*args)
    with pytest.raises(ValueError, match="x"):
        step.route(np.zeros((17, h), np.uint16), np.zeros((17, e), np.uint16))
    with pytest.raises(ValueError, match="out"):
        step.route(x, np.zeros((2, e + 1), np.uint16))
    logits, norm = np.zeros((2, e), np.uint16), np.ones(h, np.float32)
    with pytest.raises(ValueError, match="norm"):
        step.route(x, logits, norm=np.ones(h + 1, np.float32), normed=x.copy())
    with pytest.raises(ValueError, match="normed"):
        step.route(x, logits, norm=norm)
    with pytest.raises(ValueError, match="normed"):
        step.route(x, logits, norm=norm, normed=x[:, :4].copy())
    with pytest.raises(ValueError, match="eps"):
        step.route(x, logits, norm=norm, normed=x.copy(), eps=-1.0)
    with pytest.raises(ValueError, match="residual"):
        step.run(x, sel, w, out, residual=x[:1].copy())


def test_steps_live_beside_the_modules(checkpoint, rng):
    """The compiled steps are kept beside the modules: a copy or a pickle of a model that
    has decoded carries none and decodes the same bits; ``.to()`` drops a module's."""
    m = mxt.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    ids = torch.from_numpy(rng.integers(0, SIZES["vocab_size"], (1, 5)))
    mask = torch.ones_like(ids)
    want, _ = _decode_run(m, True, ids, mask, 3, 1)
    mine = [mod for mod in m.modules() if mod in _decode._STEPS]
    if _cpu.default_isa() != "scalar":  # every attention's and every MLP's
        assert {id(mod) for mod in mine} == {id(mod) for layer in m.model.layers
                                             for mod in (layer.self_attn, layer.mlp)}
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert not any(mod in _decode._STEPS for mod in other.modules())
        got, _ = _decode_run(other, True, ids, mask, 3, 1)
        for a, b in zip(got, want, strict=True):
            _same_bits(a, b)
    m.to(torch.float32)
    assert not any(mod in _decode._STEPS for mod in m.modules())
