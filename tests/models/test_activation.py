"""What runs between the two expert products (mxfp4x._core.activation;
include/mxfp4x/activation.h): gpt-oss's clamped SwiGLU, the routing-weighted bias rows and
Kimi K3's SiTU times its clipped up branch, against float64 on fresh random inputs at odd
sizes, in every dtype, on every ISA and thread count, bit for bit across them, compiled as
in eager mode, and the torch formula where the kernel does not run."""
import math

import pytest
import torch

import mxfp4x
from mxfp4x._core import activation as act
from mxfp4x._core import cpu as _cpu

LIMIT, ALPHA = 7.0, 1.702
ULP = 2.0 ** -24
ISAS = mxfp4x.backend_info()["isas"]


def _inputs(rows, d_ff, n_experts, dtype, bias_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # around the clamp (7), the up's -1 and sigmoid's tails; some far out
    gate_up = torch.randn(rows, 2 * d_ff, generator=g) * 4
    gate_up[:, ::7] *= 8
    gate_up[:, 1::2][:, ::5] = -1 + torch.randn(rows, len(range(0, d_ff, 5)), generator=g) * 1e-3
    gate_up = gate_up.to(dtype)
    bias = None if bias_dtype is None else (torch.randn(n_experts, 2 * d_ff, generator=g)
                                            .to(bias_dtype))
    ids = torch.randint(0, n_experts, (rows,), generator=g)
    return gate_up, bias, ids


def _reference(gate_up, bias, ids):
    """The formula from float32 inputs g, u and z = g * alpha (float32 operations, as the
    kernel's definition states), the rest in float64."""
    g = gate_up.float()
    if bias is not None:
        g = g + bias.float()[ids]
    gate, up = g[..., 0::2].clamp(max=LIMIT), g[..., 1::2].clamp(min=-LIMIT, max=LIMIT)
    z = (gate * ALPHA).double()
    return (up.double() + 1) * (gate.double() * torch.sigmoid(z))


def _ulps(out, ref):
    """The largest error in ulps of the result; a sigmoid under 2^-126 is a subnormal,
    whose absolute error (2^-150) times |g| (< 2^6) and |u + 1| (<= 8) counts as one."""
    err = (out.double() - ref).abs()
    return (err / (ref.abs() * ULP + 2.0 ** -141)).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_ff", [1, 37, 300])
def test_swiglu_within_ulps_of_float64(dtype, bias_dtype, d_ff):
    gate_up, bias, ids = _inputs(23, d_ff, 5, dtype, bias_dtype, seed=d_ff)
    out = act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA)
    assert out.dtype == torch.float32 and out.shape == (23, d_ff)
    ref = _reference(gate_up, bias, ids)
    # the kernel's six roundings and e^x's ulp, each relative to the result
    assert _ulps(out, ref) <= 8
    # and torch's own float32 ops on the same formula agree to a few ulps (torch's
    # 1 / (1 + e^-z) is 0 where e^-z overflows: a result under 2^-119 there)
    formula = act.gpt_oss_swiglu_formula(gate_up, bias, ids, LIMIT, ALPHA)
    assert torch.allclose(out, formula, rtol=16 * ULP, atol=2.0 ** -119, equal_nan=True)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_swiglu_rounds_once_to_the_out_dtype(out_dtype):
    gate_up, bias, ids = _inputs(19, 300, 4, torch.bfloat16, torch.float32, seed=3)
    wide = act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA)
    out = act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA, out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(out, wide.to(out_dtype))


def test_swiglu_special_values_as_the_formula():
    vals = torch.tensor([0.0, -0.0, 7.0, 7.5, -7.0, -7.5, 1e30, -1e30, math.inf, -math.inf,
                         math.nan, -60.0, -51.0, 88.0, 3.0e-40, -1.0, 100.0])
    n = len(vals)
    gate_up = torch.stack(torch.meshgrid(vals, vals, indexing="ij"), -1).reshape(n, 2 * n)
    ids = torch.zeros(n, dtype=torch.int64)
    out = act.gpt_oss_swiglu(gate_up, None, ids, LIMIT, ALPHA)
    ref = act.gpt_oss_swiglu_formula(gate_up, None, ids, LIMIT, ALPHA)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.isinf(), ref.isinf())
    fin = ref.isfinite()
    assert torch.allclose(out[fin], ref[fin], rtol=16 * ULP, atol=1e-37)
    assert torch.equal(torch.signbit(out[fin & (ref == 0)]), torch.signbit(ref[fin & (ref == 0)]))


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_bits_on_every_isa_thread_count_and_batch(isa):
    gate_up, bias, ids = _inputs(41, 300, 6, torch.bfloat16, torch.bfloat16, seed=11)
    base = act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA, torch.float32,
                              num_threads=1, isa=ISAS[0])
    for threads in (1, 2, 3):
        out = act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA, num_threads=threads,
                                 isa=isa)
        assert torch.equal(out.view(torch.int32), base.view(torch.int32))
    alone = act.gpt_oss_swiglu(gate_up[17:18], bias, ids[17:18], LIMIT, ALPHA, isa=isa)
    assert torch.equal(alone.view(torch.int32), base[17:18].view(torch.int32))


def test_swiglu_keeps_leading_dims_and_reads_strided_input():
    gate_up, bias, ids = _inputs(3 * 4, 37, 5, torch.float32, torch.float32, seed=5)
    g3, i3 = gate_up.view(3, 4, 74), ids.view(3, 4)
    out = act.gpt_oss_swiglu(g3, bias, i3, LIMIT, ALPHA)
    assert out.shape == (3, 4, 37)
    assert torch.equal(out.reshape(12, 37), act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA))
    wide = torch.zeros(12, 100)
    wide[:, :74] = gate_up
    assert torch.equal(act.gpt_oss_swiglu(wide[:, :74], bias, ids, LIMIT, ALPHA),
                       out.reshape(12, 37))
    assert torch.equal(gate_up, wide[:, :74])  # nothing mutated


def test_swiglu_compiled_gives_the_eager_bits():
    gate_up, bias, ids = _inputs(9, 37, 3, torch.bfloat16, torch.float32, seed=7)

    def f(gu, b, i):
        return act.gpt_oss_swiglu(gu, b, i, LIMIT, ALPHA, torch.bfloat16)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)(gate_up, bias, ids)
    assert torch.equal(compiled.view(torch.int16), f(gate_up, bias, ids).view(torch.int16))


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_swiglu_gradient_is_the_formulas_and_the_forward_keeps_its_bits(out_dtype):
    gate_up, bias, ids = _inputs(5, 37, 3, torch.float32, torch.float32, seed=9)
    with torch.no_grad():
        plain = act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA, out_dtype)
    g1, b1 = gate_up.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    g2, b2 = gate_up.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    out = act.gpt_oss_swiglu(g1, b1, ids, LIMIT, ALPHA, out_dtype)
    assert torch.equal(out.detach(), plain)  # recording a gradient changes no bit
    weight = torch.randn(out.shape)
    (out.float() * weight).sum().backward()
    (act.gpt_oss_swiglu_formula(g2, b2, ids, LIMIT, ALPHA, out_dtype).float()
     * weight).sum().backward()
    assert torch.equal(g1.grad, g2.grad) and torch.equal(b1.grad, b2.grad)
    assert g1.grad.abs().sum() > 0 and b1.grad.abs().sum() > 0


def test_mix_rows_gradient_is_the_formulas():
    g = torch.Generator().manual_seed(4)
    w = torch.rand(6, 3, generator=g)
    rows = torch.randn(5, 37, generator=g)
    ids = torch.randint(0, 5, (6, 3), generator=g)
    w1, r1 = w.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    w2, r2 = w.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    out = act.mix_rows(w1, r1, ids)
    assert torch.equal(out.detach(), act.mix_rows(w, rows, ids))
    weight = torch.randn(out.shape, generator=g)
    (out * weight).sum().backward()
    (act.mix_rows_formula(w2, r2, ids) * weight).sum().backward()
    assert torch.equal(w1.grad, w2.grad) and torch.equal(r1.grad, r2.grad)


def test_swiglu_float64_is_the_formula():
    gate_up, bias, ids = _inputs(5, 37, 3, torch.float64, torch.float64, seed=13)
    assert torch.equal(act.gpt_oss_swiglu(gate_up, bias, ids, LIMIT, ALPHA),
                       act.gpt_oss_swiglu_formula(gate_up, bias, ids, LIMIT, ALPHA))


def test_swiglu_refuses_bad_input():
    gate_up, bias, ids = _inputs(4, 37, 3, torch.float32, torch.float32, seed=1)
    with pytest.raises(IndexError, match="ids"):
        act.gpt_oss_swiglu(gate_up, bias, torch.tensor([0, 1, 3, 0]), LIMIT, ALPHA)
    with pytest.raises(IndexError, match="ids"):
        act.gpt_oss_swiglu(gate_up, bias, torch.tensor([0, -1, 2, 0]), LIMIT, ALPHA)
    with pytest.raises(ValueError, match="gate_up"):
        act.gpt_oss_swiglu(gate_up[:, :73], None, ids, LIMIT, ALPHA)
    with pytest.raises(ValueError, match="bias"):
        act.gpt_oss_swiglu(gate_up, bias[:, :72], ids, LIMIT, ALPHA)
    with pytest.raises(ValueError, match="ids"):
        act.gpt_oss_swiglu(gate_up, bias, ids[:3], LIMIT, ALPHA)
    with pytest.raises(ValueError, match="out_dtype"):
        _cpu.gpt_oss_swiglu(gate_up.numpy(), "float32", None, "float32", None,
                            torch.empty(4, 37).numpy(), "int8", LIMIT, ALPHA)


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [1, 37, 300])
def test_mix_rows_against_float64(rows_dtype, d):
    g = torch.Generator().manual_seed(d)
    k, n_rows = 4, 7
    weights = torch.rand(29, k, generator=g)
    rows = torch.randn(n_rows, d, generator=g).to(rows_dtype)
    ids = torch.randint(0, n_rows, (29, k), generator=g)
    out = act.mix_rows(weights, rows, ids)
    ref = (weights.double().unsqueeze(-1) * rows.double()[ids]).sum(1)
    # k products and k sums in float32, relative to the sum of the magnitudes
    mag = (weights.double().unsqueeze(-1) * rows.double()[ids]).abs().sum(1)
    assert ((out.double() - ref).abs() <= 2 * k * ULP * mag + 1e-30).all()
    assert torch.allclose(out, act.mix_rows_formula(weights, rows, ids), rtol=0,
                          atol=(4 * k * ULP * mag.max()).item())
    for isa in ISAS:
        for threads in (1, 3):
            assert torch.equal(act.mix_rows(weights, rows, ids, num_threads=threads, isa=isa),
                               out)
    with pytest.raises(IndexError, match="ids"):
        act.mix_rows(weights, rows, torch.full((29, k), n_rows))


BETA, BETA_LIN = 4.0, 25.0


def _situ_inputs(rows, k, d, dtype, seed):
    """gate and up as a gate/up product holds them: (rows, 2k, d), the gate slots first."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * k, d, generator=g) * 6
    gu[..., ::5] *= 20  # sigmoid's and tanh's tails, and past e^x's range
    gu[..., 1::7] *= 1e-3  # tanh's polynomial near 0
    gu = gu.to(dtype)
    return gu[:, :k], gu[:, k:]


def _situ_reference(gate, up, beta_lin):
    g, u = gate.float().double(), up.float().double()
    if beta_lin is not None:
        u = beta_lin * torch.tanh(u / beta_lin)
    return BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * u


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("beta_lin", [None, BETA_LIN])
@pytest.mark.parametrize("d", [1, 37, 300])
def test_situ_within_ulps_of_float64(dtype, beta_lin, d):
    gate, up = _situ_inputs(13, 3, d, dtype, seed=d)
    out = act.situ_glu(gate, up, BETA, beta_lin)
    assert out.dtype == torch.float32 and out.shape == (13, 3, d)
    ref = _situ_reference(gate, up, beta_lin)
    # eleven roundings, two tanh and a sigmoid, each relative to the result; a subnormal
    # sigmoid's 2^-150 times beta (4) and |clip(u)| (< 2^10) in absolute terms
    err = (out.double() - ref).abs()
    assert (err <= 16 * ULP * ref.abs() + 2.0 ** -136).all(), \
        (err / (ref.abs() * ULP + 2.0 ** -136)).max()
    formula = act.situ_glu_formula(gate, up, BETA, beta_lin)
    assert torch.allclose(out, formula, rtol=32 * ULP, atol=2.0 ** -110, equal_nan=True)


def test_situ_rows_alone_as_in_any_layout_and_out_dtype():
    gate, up = _situ_inputs(11, 4, 300, torch.bfloat16, seed=2)
    out = act.situ_glu(gate, up, BETA, BETA_LIN)
    # contiguous copies, 2-D rows, a row alone: the same bits
    assert torch.equal(act.situ_glu(gate.contiguous(), up.contiguous(), BETA, BETA_LIN), out)
    flat = act.situ_glu(gate.reshape(44, 300), up.reshape(44, 300), BETA, BETA_LIN)
    assert torch.equal(flat, out.reshape(44, 300))
    assert torch.equal(act.situ_glu(gate[5, 2], up[5, 2], BETA, BETA_LIN), out[5, 2])
    assert torch.equal(act.situ_glu(gate, up, BETA, BETA_LIN, torch.bfloat16),
                       out.to(torch.bfloat16))
    # gate and up with different strides (not one tensor's slots)
    assert torch.equal(act.situ_glu(gate, up.contiguous(), BETA, BETA_LIN), out)


@pytest.mark.parametrize("isa", ISAS)
def test_situ_bits_on_every_isa_and_thread_count(isa):
    gate, up = _situ_inputs(17, 4, 300, torch.bfloat16, seed=8)
    base = act.situ_glu(gate, up, BETA, BETA_LIN, num_threads=1, isa=ISAS[0])
    for threads in (1, 2, 3):
        out = act.situ_glu(gate, up, BETA, BETA_LIN, num_threads=threads, isa=isa)
        assert torch.equal(out.view(torch.int32), base.view(torch.int32))


def test_situ_special_values_as_the_formula():
    vals = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.6, 0.65, -0.62, 9.5, -9.5, 88.0, -88.0,
                         -95.0, -110.0, 1e30, -1e30, math.inf, -math.inf, math.nan])
    gate, up = torch.meshgrid(vals, vals, indexing="ij")
    # torch's sigmoid is 0 where e^-g overflows (g < -88.7), ours the true subnormal down
    # to g = -103.9: times a huge up branch torch gives 0 there (NaN for an infinite one),
    # ours the product (an infinity for an infinite one)
    subnormal = (gate < -88.7) & (gate > -103.9) & (up.abs() > 1e20)
    for beta_lin in (None, BETA_LIN):
        out = act.situ_glu(gate, up, BETA, beta_lin)
        ref = act.situ_glu_formula(gate, up, BETA, beta_lin)
        assert not out[subnormal].isnan().any() and (out[subnormal] != 0).all() \
            if beta_lin is None else not out[subnormal].isnan().any()
        out, ref = out[~subnormal], ref[~subnormal]
        assert torch.equal(out.isnan(), ref.isnan())
        fin = ref.isfinite()
        assert torch.equal(out.isinf(), ref.isinf())
        assert torch.allclose(out[fin], ref[fin], rtol=32 * ULP, atol=2.0 ** -110)


def test_situ_gradient_is_the_formulas_and_compiled_bits_are_eager():
    gate, up = _situ_inputs(5, 2, 37, torch.float32, seed=6)
    with torch.no_grad():
        plain = act.situ_glu(gate, up, BETA, BETA_LIN)
    g1, u1 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    g2, u2 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    out = act.situ_glu(g1, u1, BETA, BETA_LIN)
    assert torch.equal(out.detach(), plain)
    weight = torch.randn(out.shape)
    (out * weight).sum().backward()
    (act.situ_glu_formula(g2, u2, BETA, BETA_LIN) * weight).sum().backward()
    assert torch.equal(g1.grad, g2.grad) and torch.equal(u1.grad, u2.grad)
    torch._dynamo.reset()
    compiled = torch.compile(lambda g, u: act.situ_glu(g, u, BETA, BETA_LIN),
                             fullgraph=True)(gate, up)
    assert torch.equal(compiled, plain)


def test_situ_refuses_bad_input():
    gate, up = _situ_inputs(3, 2, 37, torch.float32, seed=1)
    with pytest.raises(ValueError, match="beta"):
        act.situ_glu(gate, up, 0.0, BETA_LIN)
    with pytest.raises(ValueError, match="beta"):
        act.situ_glu(gate, up, BETA, -1.0)
    with pytest.raises(ValueError, match="gate, up"):
        _cpu.situ_glu(gate.numpy(), up[:, :1].numpy(), "float32",
                      torch.empty(6, 37).numpy(), "float32", BETA, BETA_LIN)


# ---- gpt-oss's RMS norm (activation.h's mxfp4x_rms_norm)

def _norm_inputs(rows, d, dtype, weight_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * torch.logspace(-3, 3, rows).unsqueeze(1)
    x[:, ::5] *= 16
    w = torch.randn(d, generator=g) * 0.5 + 1
    return x.to(dtype), w.to(weight_dtype)


def _norm_reference(x, w, eps):
    """float64 of the formula from the float32 inputs."""
    xd = x.double()
    return w.double() * xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 7, 37, 300, 2880])
def test_rms_norm_within_ulps_of_float64_and_as_transformers(dtype, weight_dtype, d):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    x, w = _norm_inputs(13, d, dtype, weight_dtype, seed=d)
    with torch.no_grad():
        out = act.gpt_oss_rms_norm(x, w, 1e-5)
    assert out is not None and out.dtype == dtype and out.shape == x.shape
    ref = _norm_reference(x, w, 1e-5)
    unit, tiny = {torch.bfloat16: (2.0 ** -8, 2.0 ** -133),  # unit roundoff, subnormal step
                  torch.float16: (2.0 ** -11, 2.0 ** -24),
                  torch.float32: (2.0 ** -24, 2.0 ** -149)}[dtype]
    # float32 roundings (the mean, the sum with eps, the root, its reciprocal, two
    # products), then one to the out dtype (unit: its unit roundoff)
    err = (out.double() - ref).abs()
    assert (err <= (unit + 8 * 2.0 ** -24) * ref.abs() + tiny).all(), err.max()
    norm = GptOssRMSNorm(d, 1e-5).to(weight_dtype)
    norm.weight.data.copy_(w)
    with torch.no_grad():
        theirs = norm(x)
    # torch's float32 mean may differ from the correctly rounded one by a few ulps, which
    # rarely moves a 16-bit result
    assert torch.allclose(out.double(), theirs.double(), rtol=2 * unit + 16 * 2.0 ** -24,
                          atol=tiny)
    if dtype != torch.float32:
        assert (out != theirs).float().mean() <= 0.05


@pytest.mark.parametrize("isa", ISAS)
def test_rms_norm_bits_on_every_isa_thread_count_and_batch(isa):
    x, w = _norm_inputs(300, 2880, torch.bfloat16, torch.bfloat16, seed=5)
    with torch.no_grad():
        base = act.gpt_oss_rms_norm(x, w, 1e-6, num_threads=1, isa=ISAS[0])
        for threads in (1, 2, 3):
            out = act.gpt_oss_rms_norm(x, w, 1e-6, num_threads=threads, isa=isa)
            assert torch.equal(out.view(torch.int16), base.view(torch.int16))
        alone = act.gpt_oss_rms_norm(x[200:201], w, 1e-6, isa=isa)
        assert torch.equal(alone.view(torch.int16), base[200:201].view(torch.int16))
        lead = act.gpt_oss_rms_norm(x.view(3, 100, 2880), w, 1e-6, isa=isa)
        assert torch.equal(lead.view(300, 2880).view(torch.int16), base.view(torch.int16))


def test_rms_norm_special_values_and_what_it_leaves_to_the_caller():
    w = torch.ones(4)
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e-30, -1e-30, 0.0, 0.0], [math.inf, 1, 1, 1],
                      [math.nan, 1, 1, 1], [3e38, 3e38, 3e38, 3e38]])
    with torch.no_grad():
        out = act.gpt_oss_rms_norm(x, w, 1e-6)
        # torch's formula: an infinite square makes the row's scale 0 (inf * 0 is NaN),
        # and so does a mean of squares past float32's range (3e38: the row is 0)
        ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    # what the pass does not take: the caller's formula runs (None)
    assert act.gpt_oss_rms_norm(x.double(), w, 1e-6) is None
    assert act.gpt_oss_rms_norm(x, w[:3], 1e-6) is None
    xg = x.clone().requires_grad_()
    assert act.gpt_oss_rms_norm(xg, w, 1e-6) is None


def test_rms_norm_refuses_bad_input():
    x = torch.randn(2, 8)
    out = torch.empty(2, 8)
    with pytest.raises(ValueError, match="in_dtype"):
        _cpu.rms_norm(x.numpy(), "float64", torch.ones(8).numpy(), "float32", out.numpy(),
                      "float32", 1e-6)
    with pytest.raises(ValueError, match="weight"):
        _cpu.rms_norm(x.numpy(), "float32", torch.ones(7).numpy(), "float32", out.numpy(),
                      "float32", 1e-6)
    with pytest.raises(ValueError, match="eps"):
        _cpu.rms_norm(x.numpy(), "float32", torch.ones(8).numpy(), "float32", out.numpy(),
                      "float32", -1.0)
    with pytest.raises(ValueError, match="out"):
        _cpu.rms_norm(x.numpy(), "float32", torch.ones(8).numpy(), "float32",
                      torch.empty(2, 7).numpy(), "float32", 1e-6)
