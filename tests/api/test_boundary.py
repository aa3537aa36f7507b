"""The typed boundary between Python and the kernels (mxfp4x._core.cpu.Experts / Call):
named modes, every array checked, stacked and per-expert tables equivalent."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x._core import cpu_impl as _cpu_impl
from mxfp4x.testing.layers import random_layer


def _call(layer, **change):
    """A forward call built the way _cpu_impl builds it, with fields replaced."""
    x = layer["latent_tokens"]
    sel = layer["selected_experts"].long().numpy()
    out = layer["shared_output"].clone().numpy()
    kwargs = dict(product="forward", compute="float32", selected=sel,
                  mix=layer["mixture_weights"].numpy(), src=x.numpy(), src_dtype="float32",
                  src_rows="token", dst=out, dst_rows="token")
    kwargs.update(change)
    ex = _cpu_impl.experts_of(layer["packed_weights"], layer["scale_bytes"])
    return _cpu.Call(ex, **kwargs), out


def test_call_runs_and_matches_the_facade(rng):
    layer = random_layer(rng, 6, 3, 4, 37, 3)
    call, out = _call(layer)
    call.run()
    assert torch.equal(torch.from_numpy(out), mxfp4x.mxfp4_experts(**layer))
    assert call.isa == mxfp4x.backend_info()["isa"]


@pytest.mark.parametrize("change,match", [
    (dict(product="backward"), "product: expected one of"),
    (dict(src_rows="tokens"), "src_rows: expected one of"),
    (dict(compute="bfloat16"), "compute: expected 'float32' or 'float64'"),
    (dict(src_dtype="float64"), "src: expected a C-contiguous"),
    (dict(mix=None), "mix: expected where"),
    (dict(dst_rows="slot"), "mix: not expected"),
    (dict(selected=np.zeros((6, 3), np.int32)), "selected: expected a C-contiguous"),
    (dict(selected=np.zeros((5, 3), np.int64)), "mix: expected a C-contiguous"),
    (dict(src=np.zeros((6, 64), np.float32)), "src: expected a C-contiguous"),
    (dict(dst=np.zeros((6, 36), np.float32)), "dst: expected a C-contiguous"),
    (dict(dst=np.zeros((37, 6), np.float32).T), "dst: expected a C-contiguous"),
    (dict(product="transposed"), "src_dtype|src: expected"),
    (dict(product="transposed", src_dtype="float64"),
     "src_dtype: the transposed product reads a gradient that converts exactly"),
    (dict(isa="neon9"), "isa='neon9' is not an ISA"),
], ids=lambda v: str(v)[:40])
def test_call_checks_every_field(rng, change, match):
    layer = random_layer(rng, 6, 3, 4, 37, 3)
    with pytest.raises(ValueError, match=match):
        _call(layer, **change)


def test_call_refuses_read_only_output(rng):
    layer = random_layer(rng, 2, 1, 2, 8, 1)
    out = layer["shared_output"].numpy().copy()
    out.setflags(write=False)
    with pytest.raises(ValueError, match="dst: the array is read-only"):
        _call(layer, dst=out)


def test_expert_ids_checked_once_while_routing(rng):
    layer = random_layer(rng, 4, 2, 3, 8, 1)
    sel = layer["selected_experts"].long().clone()
    sel[2, 1] = 3
    call, _ = _call(layer, selected=sel.numpy())
    with pytest.raises(IndexError, match=r"selected_experts: expert id 3 is outside \[0, 3\)"):
        call.run()


def test_experts_table_checks(rng):
    # overlapping and repeated rows are legal (a stride-0 view): only read
    _cpu.Experts(np.array([[1, 1, 8, 0]], np.int64), d_out=4, n_groups=2, owner=None)
    with pytest.raises(ValueError, match="negative row strides"):
        _cpu.Experts(np.array([[1, 1, -32, 2]], np.int64), d_out=4, n_groups=2, owner=None)
    with pytest.raises(ValueError, match="null address"):
        _cpu.Experts(np.array([[0, 1, 32, 2]], np.int64), d_out=4, n_groups=2, owner=None)
    with pytest.raises(ValueError, match=r"\(n_experts, 4\) table"):
        _cpu.Experts(np.zeros((2, 3), np.int64), d_out=4, n_groups=2, owner=None)


@pytest.mark.parametrize("form", ["(O, G, 16)", "(O, G*16)"])
def test_per_expert_tensors_are_bit_identical_to_stacked(isa, rng, form):
    """The same bytes as one stacked tensor or as E separate tensors (each its own
    allocation): the same bits, and no copy of any expert."""
    layer = random_layer(rng, 30, 3, 5, 41, 4, repeat_expert=True)
    packed = [layer["packed_weights"][e].clone() for e in range(5)]
    if form == "(O, G*16)":
        packed = [p.flatten(1) for p in packed]
    scales = [layer["scale_bytes"][e].clone() for e in range(5)]
    ex = _cpu_impl.experts_of(packed, scales)
    # read in place, none re-laid; the table holds the tensors themselves, not the list
    assert all(a is b for a, b in zip(ex.owner[0], packed, strict=True)) and ex.owner[2] == []
    sel = layer["selected_experts"]
    for per_slot in (False, True):
        if per_slot:
            want = _cpu_impl.experts(layer["latent_tokens"], layer["packed_weights"],
                                     layer["scale_bytes"], sel, None, None, 2,
                                     per_slot_outputs=True, isa=isa)
            got = _cpu_impl.experts(layer["latent_tokens"], packed, scales, sel, None, None,
                                    2, per_slot_outputs=True, isa=isa)
        else:
            want = _cpu_impl.experts(layer["latent_tokens"], layer["packed_weights"],
                                     layer["scale_bytes"], sel, layer["mixture_weights"],
                                     layer["shared_output"], 2, isa=isa)
            got = _cpu_impl.experts(layer["latent_tokens"], packed, scales, sel,
                                    layer["mixture_weights"], layer["shared_output"], 2,
                                    isa=isa)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    g = torch.randn(30, 41)
    assert torch.equal(
        _cpu_impl.grad_latents(g, packed, scales, sel, layer["mixture_weights"],
                               layer["latent_tokens"], 2, isa=isa),
        _cpu_impl.grad_latents(g, layer["packed_weights"], layer["scale_bytes"], sel,
                               layer["mixture_weights"], layer["latent_tokens"], 2, isa=isa))


def test_per_expert_tensor_mismatch_is_named():
    p = [torch.zeros(4, 2, 16, dtype=torch.uint8), torch.zeros(4, 3, 16, dtype=torch.uint8)]
    s = [torch.zeros(4, 2, dtype=torch.uint8)] * 2
    with pytest.raises(ValueError, match=r"packed_weights\[1\]"):
        _cpu_impl.experts_of(p, s)
    with pytest.raises(ValueError, match="expert 1"):
        _cpu_impl.experts_of(p[:1] * 2, [s[0], torch.zeros(4, 3, dtype=torch.uint8)])


def test_format_facts_agree():
    from mxfp4x._core import format as _format
    assert (_cpu.GROUP, _cpu.GROUP_BYTES) == (_format.GROUP, _format.GROUP_BYTES)
    assert _cpu.DTYPES == ("float32", "float64", "bfloat16", "float16")


def _bits16(t):
    return t.view(torch.int16).numpy()


@pytest.mark.parametrize("change,match", [
    (dict(dst_dtype="int8"), "dst_dtype: expected one of"),
    (dict(dst_dtype="float16", compute="float64"), "dst_dtype: expected 'float64'"),
    (dict(dst_dtype="float64"), "dst_dtype: expected 'float32'"),
    (dict(dst_dtype="bfloat16"), "dst: expected a C-contiguous .* 2-byte"),
    (dict(dst_dtype="bfloat16", dst=np.zeros((6, 37), np.int16)), "init: expected the start"),
    (dict(init=np.zeros((6, 37), np.float32), init_dtype="float64"),
     "init_dtype: expected one of"),
    (dict(init=np.zeros((6, 37), np.float32), init_dtype=None), "init_dtype: expected one of"),
    (dict(init=np.zeros((5, 37), np.float32), init_dtype="float32"),
     "init: expected a C-contiguous"),
    (dict(init=np.zeros((6, 37), np.float32), init_dtype="bfloat16"),
     "init: expected a C-contiguous"),
    (dict(init=np.zeros((18, 37), np.float32), init_dtype="float32", mix=None,
          dst_rows="slot", dst=np.zeros((18, 37), np.float32)), "init: only a forward"),
], ids=lambda v: str(v)[:50])
def test_call_checks_the_start_and_the_result_dtype(rng, change, match):
    layer = random_layer(rng, 6, 3, 4, 37, 3)
    with pytest.raises(ValueError, match=match):
        _call(layer, **change)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("start", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_16_bit_results_are_the_float32_sums_rounded_once(isa, rng, dtype, start):
    """A 16-bit dst: the driver's float32 sums from init, rounded in its tasks, are the
    float32 call's result rounded by torch, on 1 and 3 threads (many tasks)."""
    layer = random_layer(rng, 70, 3, 5, 203, 3)
    x = layer["latent_tokens"].to(dtype)
    init = (layer["shared_output"] * 4).to(start)
    sel = layer["selected_experts"].numpy()
    mix = layer["mixture_weights"].to(dtype).float().numpy()
    ex = _cpu_impl.experts_of(layer["packed_weights"], layer["scale_bytes"])
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    want = init.float().numpy().copy()
    _cpu.Call(ex, product="forward", compute="float32", selected=sel, mix=mix,
              src=_bits16(x), src_dtype=names[dtype], src_rows="token", dst=want,
              dst_rows="token", isa=isa).run()
    want = torch.from_numpy(want).to(dtype)
    for n_threads in (1, 3):
        got = torch.empty(want.shape, dtype=dtype)
        _cpu.Call(ex, product="forward", compute="float32", selected=sel, mix=mix,
                  src=_bits16(x), src_dtype=names[dtype], src_rows="token",
                  dst=_bits16(got), dst_rows="token", dst_dtype=names[dtype],
                  init=_bits16(init) if start != torch.float32 else init.numpy(),
                  init_dtype=names[start], isa=isa, n_threads=n_threads).run()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), n_threads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_gradients_are_the_float32_sums_rounded_once(isa, rng, dtype):
    """The transposed product with a 16-bit gradient and a 16-bit dx: the gradient
    converted and dx rounded by the driver are torch's conversions around a float32 call,
    on 1 and 3 threads."""
    layer = random_layer(rng, 70, 3, 5, 203, 3)
    grad = (torch.randn(70, 203) * 1e3).to(dtype)
    sel = layer["selected_experts"].numpy()
    mix = layer["mixture_weights"].to(dtype).float().numpy()
    ex = _cpu_impl.experts_of(layer["packed_weights"], layer["scale_bytes"])
    name = str(dtype).replace("torch.", "")
    want = np.empty((70, 96), np.float32)
    _cpu.Call(ex, product="transposed", compute="float32", selected=sel, mix=mix,
              src=grad.float().numpy(), src_dtype="float32", src_rows="token", dst=want,
              dst_rows="token", isa=isa).run()
    want = torch.from_numpy(want).to(dtype)
    for n_threads in (1, 3):
        got = torch.empty(want.shape, dtype=dtype)
        _cpu.Call(ex, product="transposed", compute="float32", selected=sel, mix=mix,
                  src=_bits16(grad), src_dtype=name, src_rows="token", dst=_bits16(got),
                  dst_rows="token", dst_dtype=name, isa=isa, n_threads=n_threads).run()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), n_threads


def _float32_bit_patterns(rng, n):
    """Float32 bit patterns for a rounding test: uniform bits (every exponent, NaNs), the
    ties and near-ties of bfloat16 and float16 at every exponent that matters, and the
    edges (float16's overflow and subnormal boundaries, signed zeros, infinities)."""
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    k = n // 4
    exps = rng.integers(90, 160, k, dtype=np.uint32) << 23
    sign = rng.integers(0, 2, k, dtype=np.uint32) << 31
    hi = rng.integers(0, 2**10, k, dtype=np.uint32) << 13
    u[:k] = sign | exps | hi | rng.choice(np.array([0xFFF, 0x1000, 0x1001], np.uint32), k)
    hi = rng.integers(0, 2**7, k, dtype=np.uint32) << 16
    u[k:2 * k] = sign | exps | hi | rng.choice(np.array([0x7FFF, 0x8000, 0x8001], np.uint32), k)
    edges = [0x477FEFFF, 0x477FF000, 0x477FF001, 0x477FE000, 0x7F7FFFFF, 0x7F800000,
             0x33000000, 0x33000001, 0x32FFFFFF, 0x337FFFFF, 0x38800000, 0x387FE000,
             0x387FF000, 0x387FEFFF, 0x00000001, 0x00800000, 0, 0x7FC00000, 0x7F800001,
             0x7FA00000, 0x7F812345]
    edges += [e | 0x80000000 for e in edges]
    u[2 * k:2 * k + len(edges)] = edges
    return u


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounding_into_16_bits_is_torchs(rng, dtype):
    """No expert per token (top_k = 0): each result is its float32 shared output rounded by
    the driver, to nearest even, overflow to infinity, float16's subnormals, exactly as
    torch rounds; NaNs become 0xFFFF (bfloat16, torch's vectorised x86 conversion) or stay
    quiet NaNs of their sign and top payload bits (float16, as F16C)."""
    u = _float32_bit_patterns(rng, 64 * 1024)
    shared = torch.from_numpy(u.view(np.float32).reshape(64, 1024))
    packed = torch.from_numpy(rng.integers(0, 256, (2, 1024, 1, 16), dtype=np.uint8))
    scales = torch.full((2, 1024, 1), 127, dtype=torch.uint8)
    x = torch.randn(64, 32).to(dtype)
    got = mxfp4x.mxfp4_experts(x, packed, scales, torch.zeros(64, 0, dtype=torch.int64),
                               torch.zeros(64, 0, dtype=dtype), shared, num_threads=2)
    got = got.view(torch.int16).numpy().astype(np.uint16).ravel()
    want = shared.to(dtype).view(torch.int16).numpy().astype(np.uint16).ravel()
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    assert nan.sum() > 100 and (got[~nan] == want[~nan]).all()
    if dtype == torch.bfloat16:
        assert (got[nan] == 0xFFFF).all()
    else:
        q = ((u[nan] >> 16) & 0x8000) | 0x7E00 | ((u[nan] >> 13) & 0x3FF)
        assert (got[nan] == q.astype(np.uint16)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_widening_16_bit_starts_is_exact(rng, dtype):
    """Every 16-bit pattern as a float32 call's shared output, no expert per token: the
    result is each value widened by the driver, bit for bit as torch widens it (subnormals,
    infinities, NaN payloads; float16's signalling NaNs made quiet, as F16C does)."""
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    shared = bits[torch.from_numpy(rng.permutation(2**16))].view(dtype).reshape(64, 1024)
    packed = torch.from_numpy(rng.integers(0, 256, (2, 1024, 1, 16), dtype=np.uint8))
    scales = torch.full((2, 1024, 1), 127, dtype=torch.uint8)
    got = mxfp4x.mxfp4_experts(torch.randn(64, 32), packed, scales,
                               torch.zeros(64, 0, dtype=torch.int64), torch.zeros(64, 0),
                               shared, num_threads=2)
    assert torch.equal(got.view(torch.int32), shared.float().view(torch.int32))
