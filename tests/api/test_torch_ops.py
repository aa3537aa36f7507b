"""torch.library ops: opcheck, torch.compile(fullgraph=True), autograd (gradcheck in
float64 and gradients against the float64 reference)."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import ops as _ops
from mxfp4x._core.reference import decode_expert, error_bound
from mxfp4x.testing.layers import acc_name, random_layer


def _op_args(layer, num_threads=2):
    return (layer["latent_tokens"], layer["packed_weights"], layer["scale_bytes"],
            layer["selected_experts"].long(), layer["mixture_weights"],
            layer["shared_output"], num_threads)


def test_ops_work_as_written_with_their_defaults(rng):
    """The extra arguments (num_threads, isa) have defaults, as the public functions do."""
    layer = random_layer(rng, 5, 2, 3, 24, 2)
    x, packed, scales = layer["latent_tokens"], layer["packed_weights"], layer["scale_bytes"]
    sel, mix, shared = layer["selected_experts"].long(), layer["mixture_weights"], \
        layer["shared_output"]
    want = mxfp4x.mxfp4_experts(**layer)
    assert torch.equal(torch.ops.mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared), want)
    assert torch.equal(torch.ops.mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared,
                                                      isa="scalar"),
                       mxfp4x.mxfp4_experts(**layer, isa="scalar"))
    slots = torch.ops.mxfp4x.mxfp4_experts_slots(x, packed, scales, sel)
    assert slots.shape == (5, 2, 24)
    g = torch.randn(5, 24)
    dx = torch.ops.mxfp4x.mxfp4_experts_grad_latents(g, packed, scales, sel, mix, x)
    assert dx.shape == x.shape
    dx_slots = torch.ops.mxfp4x.mxfp4_experts_grad_latents(torch.randn(5, 2, 24), packed,
                                                           scales, sel, None, x)
    assert dx_slots.shape == x.shape


def test_ops_are_registered():
    assert torch.ops.mxfp4x.mxfp4_experts.default is not None
    assert torch.ops.mxfp4x.mxfp4_experts_slots.default is not None
    assert torch.ops.mxfp4x.mxfp4_experts_grad_latents.default is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_opcheck(rng, dtype):
    layer = random_layer(rng, 5, 2, 3, 9, 2, dtype=dtype, repeat_expert=True)
    layer["latent_tokens"].requires_grad_(True)
    layer["mixture_weights"].requires_grad_(True)
    layer["shared_output"].requires_grad_(True)
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts.default, _op_args(layer))
    plain = random_layer(rng, 5, 2, 3, 9, 2, dtype=dtype)
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts_slots.default,
                          (plain["latent_tokens"], plain["packed_weights"],
                           plain["scale_bytes"], plain["selected_experts"], 1))
    g = torch.randn(5, 9, dtype=dtype)
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts_grad_latents.default,
                          (g, plain["packed_weights"], plain["scale_bytes"],
                           plain["selected_experts"], plain["mixture_weights"],
                           plain["latent_tokens"], 1))


def test_compile_fullgraph_equals_eager(rng):
    layer = random_layer(rng, 6, 3, 4, 40, 3)

    def block(x, packed, scales, sel, mix, shared):
        h = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared)
        # exact elementwise ops only: inductor's fused silu may differ from eager's by an
        # ulp, which would make this test about inductor rather than the op
        return torch.relu(h) * 2

    eager = block(*layer.values())
    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(*layer.values()), eager)
    other = random_layer(rng, 6, 3, 4, 40, 3)
    assert torch.equal(compiled(*other.values()), block(*other.values()))


def test_compiled_graph_checks_expert_ids_at_run_time(rng):
    layer = random_layer(rng, 3, 2, 4, 8, 1)
    compiled = torch.compile(mxfp4x.mxfp4_experts, fullgraph=True)
    compiled(**layer)
    with pytest.raises(IndexError, match="selected_experts"):
        compiled(**dict(layer, selected_experts=layer["selected_experts"] + 4))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_gradcheck_float64(rng, backend):
    layer = random_layer(rng, 4, 2, 3, 7, 2, dtype=torch.float64, repeat_expert=True)
    for k in ("latent_tokens", "mixture_weights", "shared_output"):
        layer[k].requires_grad_(True)

    def f(x, mix, shared):
        return mxfp4x.mxfp4_experts(x, layer["packed_weights"], layer["scale_bytes"],
                                    layer["selected_experts"], mix, shared, backend=backend)

    assert torch.autograd.gradcheck(f, (layer["latent_tokens"], layer["mixture_weights"],
                                        layer["shared_output"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gradients_against_reference(isa, rng, dtype):
    layer = random_layer(rng, 13, 3, 4, 50, 4, dtype=dtype, repeat_expert=True)
    for k in ("latent_tokens", "mixture_weights", "shared_output"):
        layer[k].requires_grad_(True)
    y = mxfp4x.mxfp4_experts(**layer, isa=isa)
    g = torch.randn_like(y)
    y.backward(g)
    x = layer["latent_tokens"].detach().double().numpy()
    p = layer["mixture_weights"].detach().double().numpy()
    sel = layer["selected_experts"].numpy()
    gn = g.double().numpy()
    ws = {e: decode_expert(layer["packed_weights"][e].numpy(), layer["scale_bytes"][e].numpy())
          for e in np.unique(sel)}
    dx, dp = np.zeros_like(x), np.zeros_like(p)
    dx_mag, dp_mag = np.zeros_like(x), np.zeros_like(p)
    for t in range(sel.shape[0]):
        for k in range(sel.shape[1]):
            w = ws[sel[t, k]]
            dx[t] += p[t, k] * (w.T @ gn[t])
            dp[t, k] = gn[t] @ (w @ x[t])
            dx_mag[t] += abs(p[t, k]) * (np.abs(w).T @ np.abs(gn[t]))
            dp_mag[t, k] = np.abs(gn[t]) @ (np.abs(w) @ np.abs(x[t]))
    # the documented dot-product bound over every sum involved
    n = x.shape[1] + gn.shape[1] + sel.shape[1] + 4
    got_dx = layer["latent_tokens"].grad.double().numpy()
    got_dp = layer["mixture_weights"].grad.double().numpy()
    assert np.all(np.abs(got_dx - dx) <= error_bound(dx_mag, n, acc_name(dtype)))
    assert np.all(np.abs(got_dp - dp) <= error_bound(dp_mag, n, acc_name(dtype)))
    assert torch.equal(layer["shared_output"].grad, g)
    assert layer["latent_tokens"].grad.dtype == dtype


def test_cpu_and_torch_backends_give_the_same_gradients(rng):
    layer = random_layer(rng, 9, 2, 3, 33, 3, dtype=torch.float64)
    grads = []
    for backend in ("cpu", "torch"):
        leaves = {k: layer[k].clone().requires_grad_(True)
                  for k in ("latent_tokens", "mixture_weights", "shared_output")}
        y = mxfp4x.mxfp4_experts(**dict(layer, **leaves), backend=backend)
        y.sum().backward()
        grads.append([leaves[k].grad for k in sorted(leaves)])
    for a, b in zip(*grads, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ids", [torch.int32, torch.uint8, torch.int16], ids=str)
def test_narrow_expert_ids_give_the_same_bits_with_gradients(rng, ids):
    # ids of other integer dtypes reach the op (a gradient is recorded) as they are
    # (int32) or as int64: the result and every gradient as with int64 ids
    layer = random_layer(rng, 9, 3, 5, 33, 3, dtype=torch.bfloat16)
    outs = []
    for sel in (layer["selected_experts"], layer["selected_experts"].to(ids)):
        leaves = {k: layer[k].clone().requires_grad_(True)
                  for k in ("latent_tokens", "mixture_weights", "shared_output")}
        y = mxfp4x.mxfp4_experts(**dict(layer, **leaves, selected_experts=sel))
        y.backward(torch.ones_like(y))
        outs.append([y] + [leaves[k].grad for k in sorted(leaves)])
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_grad_latents_bitwise_across_threads(rng):
    layer = random_layer(rng, 40, 4, 5, 70, 9)
    g = torch.randn(40, 70)
    args = (g, layer["packed_weights"], layer["scale_bytes"],
            layer["selected_experts"].long(), layer["mixture_weights"],
            layer["latent_tokens"])
    first = _ops.mxfp4_experts_grad_latents_op(*args, 1)
    for n in (2, 3, 4):
        assert torch.equal(_ops.mxfp4_experts_grad_latents_op(*args, n), first)


def test_slots_op_matches_reference(rng):
    layer = random_layer(rng, 7, 3, 4, 20, 2, dtype=torch.float64)
    slots = torch.ops.mxfp4x.mxfp4_experts_slots(layer["latent_tokens"],
                                                 layer["packed_weights"],
                                                 layer["scale_bytes"],
                                                 layer["selected_experts"], 2)
    for t in range(7):
        for k in range(3):
            e = int(layer["selected_experts"][t, k])
            w = decode_expert(layer["packed_weights"][e].numpy(),
                              layer["scale_bytes"][e].numpy())
            np.testing.assert_allclose(slots[t, k].numpy(),
                                       w @ layer["latent_tokens"][t].numpy(), rtol=1e-12,
                                       atol=1e-12)


def test_grad_op_fake_strides_match_for_transposed_latents(rng):
    layer = random_layer(rng, 4, 2, 3, 9, 2)
    x = layer["latent_tokens"].T.contiguous().T  # dense but transposed
    assert not x.is_contiguous()
    torch.library.opcheck(torch.ops.mxfp4x.mxfp4_experts_grad_latents.default,
                          (torch.randn(4, 9), layer["packed_weights"], layer["scale_bytes"],
                           layer["selected_experts"], layer["mixture_weights"], x, 1))


def test_mixture_weight_gradient_keeps_float32_precision_for_bf16(rng):
    layer = random_layer(rng, 6, 2, 3, 40, 3, dtype=torch.bfloat16)
    mix = layer["mixture_weights"].float().requires_grad_(True)
    y = mxfp4x.mxfp4_experts(**dict(layer, mixture_weights=mix))
    g = torch.randn(y.shape)
    y.float().backward(g)
    x = layer["latent_tokens"].double().numpy()
    sel = layer["selected_experts"].numpy()
    want = np.zeros((6, 2))
    for t in range(6):
        for k in range(2):
            w = decode_expert(layer["packed_weights"][sel[t, k]].numpy(),
                              layer["scale_bytes"][sel[t, k]].numpy())
            # the output is bf16, so the gradient reaching the op is g rounded to bf16
            want[t, k] = g[t].bfloat16().double().numpy() @ (w @ x[t])
    err = np.abs(mix.grad.double().numpy() - want) / np.abs(want).max()
    assert err.max() < 1e-5, err.max()  # rounding W x to bf16 first would give ~1e-2


def test_eager_calls_skip_the_dispatcher_only_when_the_op_would_add_nothing(rng, monkeypatch):
    """A plain eager CPU call runs the kernel directly (the same bits as the op); a call
    that needs autograd, or under a dispatch mode, goes through the op, which the mode
    then sees."""
    from torch.utils._python_dispatch import TorchDispatchMode
    layer = random_layer(rng, 5, 2, 3, 24, 2)
    via_op = []
    for name in ("forward_op_for", "slots_op_for"):
        real = getattr(_ops, name)
        monkeypatch.setattr(mxfp4x._core.api, name,
                            lambda packed, real=real: via_op.append(1) or real(packed))
    plain = mxfp4x.mxfp4_experts(**layer)
    assert not via_op
    assert torch.equal(plain, torch.ops.mxfp4x.mxfp4_experts(*_op_args(layer)))
    slots = mxfp4x.mxfp4_experts_slots(layer["latent_tokens"], layer["packed_weights"],
                                       layer["scale_bytes"], layer["selected_experts"])
    assert not via_op
    assert torch.equal(slots, torch.ops.mxfp4x.mxfp4_experts_slots(*_op_args(layer)[:4]))
    listed = [layer["packed_weights"][e] for e in range(3)], \
        [torch.nn.Parameter(layer["scale_bytes"][e], requires_grad=False) for e in range(3)]
    assert torch.equal(mxfp4x.mxfp4_experts(**{**layer, "packed_weights": listed[0],
                                               "scale_bytes": listed[1]}), plain)
    assert not via_op

    x = layer["latent_tokens"].clone().requires_grad_()
    y = mxfp4x.mxfp4_experts(**{**layer, "latent_tokens": x})
    assert via_op and y.grad_fn is not None and torch.equal(y.detach(), plain)
    with torch.no_grad():  # nothing to record: direct again
        via_op.clear()
        assert torch.equal(mxfp4x.mxfp4_experts(**{**layer, "latent_tokens": x}), plain)
        assert not via_op

    seen = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Names():
        assert torch.equal(mxfp4x.mxfp4_experts(**layer), plain)
    assert any("mxfp4x.mxfp4_experts" in name for name in seen), seen


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_a_jit_trace_records_the_op(rng):
    """torch.jit.trace sees no mode and no dynamo: the call must still go through the op,
    or the trace would keep only the shared output's copy."""
    layer = random_layer(rng, 5, 2, 3, 24, 2)
    rest = {k: v for k, v in layer.items() if k != "latent_tokens"}
    traced = torch.jit.trace(lambda x: mxfp4x.mxfp4_experts(x, **rest),
                             (layer["latent_tokens"],), check_trace=False)
    assert "mxfp4x::mxfp4_experts" in str(traced.graph)
    other = torch.from_numpy(rng.standard_normal(layer["latent_tokens"].shape)).float()
    assert torch.equal(traced(other), mxfp4x.mxfp4_experts(other, **rest))


def test_forward_mode_ad_is_refused_not_silently_zero(rng):
    """The ops carry no forward-mode formula: torch.func.jvp would give a zero tangent and
    forward_ad none at all.  Such a call is a clear error; the torch backend does it."""
    import torch.autograd.forward_ad as fwAD
    layer = random_layer(rng, 5, 2, 3, 24, 2)
    rest = {k: v for k, v in layer.items() if k != "latent_tokens"}
    x, v = layer["latent_tokens"], torch.from_numpy(rng.standard_normal((5, 64))).float()
    with pytest.raises(NotImplementedError, match="backend='torch'"):
        torch.func.jvp(lambda t: mxfp4x.mxfp4_experts(t, **rest), (x,), (v,))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            mxfp4x.mxfp4_experts(fwAD.make_dual(x, v), **rest)
        with pytest.raises(NotImplementedError, match="mxfp4_experts_slots"):
            mxfp4x.mxfp4_experts_slots(fwAD.make_dual(x, v), layer["packed_weights"],
                                       layer["scale_bytes"], layer["selected_experts"])
        plain = mxfp4x.mxfp4_experts(x, **rest)  # no dual among the inputs: no tangent
    assert torch.equal(plain, mxfp4x.mxfp4_experts(**layer))
    _, tangent = torch.func.jvp(lambda t: mxfp4x.mxfp4_experts(t, **rest, backend="torch"),
                                (x,), (v,))
    zero = torch.zeros_like(layer["shared_output"])
    want = mxfp4x.mxfp4_experts(v, **{**rest, "shared_output": zero}, backend="torch")
    torch.testing.assert_close(tangent, want)
