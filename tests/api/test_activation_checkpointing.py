"""Activation checkpointing (``torch.utils.checkpoint``) through the ops and the modules:
a training step's gradients equal those of the same step without checkpointing, bit for
bit (the kernels are deterministic and the recomputed forward is the same call).

Non-reentrant checkpointing (``use_reentrant=False``, what transformers'
``gradient_checkpointing_enable()`` uses) lets a backward unpack each saved tensor once:
a backward that read ``ctx.saved_tensors`` twice raised ``CheckpointError``."""
import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mxfp4x
from mxfp4x import nn
from mxfp4x.testing.layers import gguf_blocks_of, random_layer

T, K, E, D_OUT, G = 7, 2, 3, 24, 2
REENTRANT = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]


def _step(fn, leaves, params, use_checkpoint, use_reentrant=False):
    """One training step's gradients: a trainable linear layer in front of ``fn`` (so the
    checkpointed region's input needs a gradient, as a model's hidden states do), a
    loss of every output element, backward; the gradients of ``leaves`` and ``params``."""
    for t in (*leaves, *params):
        t.grad = None
    if use_checkpoint:
        out = checkpoint(fn, *leaves, use_reentrant=use_reentrant)
    else:
        out = fn(*leaves)
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).view(out.shape)
    (out * weights).square().sum().backward()
    return [t.grad.clone() for t in (*leaves, *params)]


def _same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert b.abs().max() > 0, i  # a gradient that is there
        assert a.dtype == b.dtype and torch.equal(a, b), (i, (a - b).abs().max())


def _forms(layer):
    """The same experts stacked, as a list of per-expert tensors, and as GGUF blocks."""
    packed, scales = layer["packed_weights"], layer["scale_bytes"]
    blocks = torch.from_numpy(gguf_blocks_of(packed.numpy(), scales.numpy()))
    return {"stacked": (packed, scales), "list": (list(packed), list(scales)),
            "gguf": (blocks, None)}


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("form", ["stacked", "list", "gguf"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_experts_op(rng, backend, form, use_reentrant):
    layer = random_layer(rng, T, K, E, D_OUT, G, repeat_expert=True)
    packed, scales = _forms(layer)[form]
    sel = layer["selected_experts"]
    proj = torch.nn.Linear(32 * G, 32 * G)
    torch.manual_seed(0)
    with torch.no_grad():
        proj.weight.copy_(torch.eye(32 * G) + 0.1 * torch.randn(32 * G, 32 * G))

    def fn(x, mix, shared):
        return mxfp4x.mxfp4_experts(proj(x), packed, scales, sel, mix, shared,
                                    backend=backend, num_threads=2)

    leaves = [layer[k].clone().requires_grad_(True)
              for k in ("latent_tokens", "mixture_weights", "shared_output")]
    params = list(proj.parameters())
    want = _step(fn, leaves, params, use_checkpoint=False)
    _same(_step(fn, leaves, params, use_checkpoint=True, use_reentrant=use_reentrant), want)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
@pytest.mark.parametrize("per_slot_latents", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_slots_op(rng, backend, per_slot_latents, use_reentrant):
    """The per-slot op (a gate/up projection; with (T, K, I) latents a down projection)."""
    layer = random_layer(rng, T, K, E, D_OUT, G)
    packed, scales, sel = (layer[k] for k in ("packed_weights", "scale_bytes",
                                              "selected_experts"))
    x = layer["latent_tokens"]
    if per_slot_latents:
        x = torch.stack((x, x.flip(0)), dim=1)

    def fn(x):
        return mxfp4x.mxfp4_experts_slots(torch.tanh(x), packed, scales, sel,
                                          backend=backend, num_threads=2)

    leaves = [x.clone().requires_grad_(True)]
    want = _step(fn, leaves, [], use_checkpoint=False)
    _same(_step(fn, leaves, [], use_checkpoint=True, use_reentrant=use_reentrant), want)


def test_threads_do_not_change_the_checkpointed_gradients(rng):
    layer = random_layer(rng, 40, K, E, D_OUT, G)
    grads = []
    for threads in (1, 2):
        def fn(x, mix, threads=threads):
            return mxfp4x.mxfp4_experts(x, layer["packed_weights"], layer["scale_bytes"],
                                        layer["selected_experts"], mix,
                                        layer["shared_output"], num_threads=threads)
        leaves = [layer[k].clone().requires_grad_(True)
                  for k in ("latent_tokens", "mixture_weights")]
        grads.append(_step(fn, leaves, [], use_checkpoint=True))
    _same(grads[1], grads[0])


# ---- the modules --------------------------------------------------------------------------

def _routing(rng, n_tokens=T, n_experts=E, top_k=K, d=32 * G):
    h = torch.from_numpy(rng.standard_normal((n_tokens, d))).float()
    sel = torch.from_numpy(np.stack([rng.permutation(n_experts)[:top_k]
                                     for _ in range(n_tokens)]))
    w = torch.from_numpy(rng.random((n_tokens, top_k))).float()
    return h.requires_grad_(True), sel, w.requires_grad_(True)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_mxfp4_experts_module(rng, use_reentrant):
    weights = torch.from_numpy(rng.standard_normal((E, D_OUT, 32 * G))).float()
    module = nn.MXFP4Experts.from_float(weights, num_threads=2)
    h, sel, w = _routing(rng)
    shared = torch.from_numpy(rng.standard_normal((T, D_OUT))).float().requires_grad_(True)

    def fn(h, w, shared):
        return module(h, sel, w, shared)

    want = _step(fn, [h, w, shared], [], use_checkpoint=False)
    _same(_step(fn, [h, w, shared], [], use_checkpoint=True, use_reentrant=use_reentrant),
          want)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_gpt_oss_experts_module(rng, use_reentrant):
    """The gpt-oss block (per-slot gate/up, SwiGLU, down combined), biases trained."""
    hidden, inter = 32 * G, 64

    def q(o, i):
        return mxfp4x.quantize(torch.from_numpy(rng.standard_normal((E, o, i)) * 0.3).float())

    gu, down = q(2 * inter, hidden), q(hidden, inter)
    module = nn.GptOssExperts(*gu, torch.from_numpy(rng.standard_normal((E, 2 * inter))),
                              *down, torch.from_numpy(rng.standard_normal((E, hidden))),
                              limit=2.0, num_threads=2)
    for p in module.parameters():
        p.requires_grad_(True)
    h, sel, w = _routing(rng, d=hidden)

    def fn(h, w):
        return module(h, sel, w)

    params = list(module.parameters())
    assert len(params) == 2
    want = _step(fn, [h, w], params, use_checkpoint=False)
    _same(_step(fn, [h, w], params, use_checkpoint=True, use_reentrant=use_reentrant),
          want)


@pytest.mark.parametrize("use_reentrant", REENTRANT)
def test_kimi_k3_experts_module(rng, use_reentrant):
    """Per-expert lists (the list ops), SiTU and the clip between them."""
    def w(o, groups):
        return (torch.from_numpy(rng.integers(0, 256, (E, o, groups, 16), dtype=np.uint8)),
                torch.from_numpy(rng.integers(119, 127, (E, o, groups), dtype=np.uint8)))

    module = nn.KimiK3Experts(w(64, G), w(64, G), w(32 * G, 2), num_threads=2)
    h, sel, rw = _routing(rng)

    def fn(h, rw):
        return module(h, sel, rw)

    want = _step(fn, [h, rw], [], use_checkpoint=False)
    _same(_step(fn, [h, rw], [], use_checkpoint=True, use_reentrant=use_reentrant),
          want)
