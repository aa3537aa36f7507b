"""quantize / dequantize: OCP MX v1.0 rules, ties, round trips, cross-checks."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core.format import E2M1_VALUES
from mxfp4x._core.reference import decode_expert, error_bound

GRID = np.array(E2M1_VALUES[:8])


def _brute_force_codes(q):
    """Nearest E2M1 code of each q (already divided by the scale), ties to the code
    with an even mantissa bit, saturating at 6; -0.0 and negatives get the sign bit."""
    mag = np.minimum(np.abs(q), 6.0)
    dist = np.abs(mag[..., None] - GRID)
    best = dist.min(-1, keepdims=True)
    cand = dist == best
    # among equal candidates prefer an even code (mantissa bit 0), i.e. even index
    score = np.where(cand, (np.arange(8) % 2) * 10 + np.arange(8) * 0, 99)
    codes = np.argmin(score + np.where(cand, 0, 99), axis=-1)
    return codes | (np.signbit(q).astype(np.int64) << 3)


def _codes(packed):
    p = packed.numpy().astype(np.int64)
    out = np.empty(p.shape[:-1] + (32,), np.int64)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def test_ties_round_to_even_and_saturate():
    # scale exponent 0: amax must have floor(log2) = 2, so put a 4.0 in each group
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    near = [(0.2500001, 0.5), (0.2499999, 0.0), (4.9999, 4.0), (5.0001, 6.0), (6.5, 6.0),
            (7.99, 6.0)]
    vals = mids + [v for v, _ in near]
    want = expect + [w for _, w in near]
    for sign in (1.0, -1.0):
        row = np.zeros(32)
        row[0] = 4.0
        row[1:1 + len(vals)] = sign * np.array(vals)
        packed, scales = mxfp4x.quantize(torch.tensor(row)[None])
        assert scales.item() == 127
        got = mxfp4x.dequantize(packed, scales, torch.float64)[0].numpy()
        np.testing.assert_array_equal(got[1:1 + len(vals)], sign * np.array(want))


def test_signed_zero_nan_inf_and_all_zero_groups():
    w = torch.zeros(4, 32, dtype=torch.float64)
    w[0, 3] = -0.0
    w[1, 5] = float("nan")
    w[2, 7] = float("-inf")
    w[3, :] = 1.0
    packed, scales = mxfp4x.quantize(w)
    assert scales[:, 0].tolist() == [0, 255, 255, 125]  # amax 1 -> 2^(floor(0) - 2)
    codes = _codes(packed)[:, 0]
    assert codes[0, 3] == 8 and codes[0, 2] == 0  # -0.0 keeps its sign
    assert (codes[1:3] == 0).all()
    assert (codes[3] == 6).all()  # 1.0 / 2^-2 = 4.0: code 6

def test_against_brute_force_on_random_values(rng):
    w = rng.standard_normal((64, 128)) * np.exp2(rng.integers(-20, 20, (64, 1)))
    w[::7, ::5] = 0.0
    # exact ties, scaled into the groups
    w[3, :32] = np.array([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        t = torch.from_numpy(w).to(dtype)
        packed, scales = mxfp4x.quantize(t)
        v = t.double().numpy().reshape(64, 4, 32)
        amax = np.abs(v).max(-1)
        with np.errstate(divide="ignore"):
            exp = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127).clip(-127, 127)
        np.testing.assert_array_equal(scales.numpy(), exp + 127)
        want = _brute_force_codes(v / np.exp2(exp)[..., None])
        np.testing.assert_array_equal(_codes(packed), want)


def test_canonical_round_trip_exhaustive_scales(rng):
    """quantize(dequantize(p, s)) == (p, s) for every canonical input: each group's
    largest code is 4.0 or 6.0 (so floor(log2(amax)) - 2 is its own exponent), all 255
    scale values but 255, plus NaN groups and all-zero groups."""
    n = 254
    codes = rng.integers(0, 16, (n, 4, 32))
    codes[..., 0] = rng.choice([6, 7, 14, 15], (n, 4))  # +-4 or +-6 somewhere
    scales = np.repeat(np.arange(254)[:, None], 4, axis=1)
    codes[0, 1] = rng.choice([0, 8], 32)  # an all-zero group (signed zeros): scale 0
    scales[0, 1] = 0
    codes[5, 2] = 0  # a NaN group
    scales[5, 2] = 255
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    p = torch.from_numpy(packed)
    s = torch.from_numpy(scales.astype(np.uint8))
    values = mxfp4x.dequantize(p, s, torch.float64)  # 6 * 2^127 needs float64
    p2, s2 = mxfp4x.quantize(values)
    assert torch.equal(s2, s)
    assert torch.equal(p2, p)


def test_dequantize_matches_torch_e8m0_and_the_reference(rng):
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1)
    ones = torch.full((256, 1, 16), 0x22, dtype=torch.uint8)  # code 2 = 1.0 everywhere
    got = mxfp4x.dequantize(ones, scales, torch.float32)[:, 0]
    if hasattr(torch, "float8_e8m0fnu"):
        theirs = scales[:, 0].view(torch.float8_e8m0fnu).float()
        assert torch.equal(torch.isnan(got), torch.isnan(theirs))
        ok = ~torch.isnan(theirs)
        assert torch.equal(got[ok], theirs[ok])
    packed = rng.integers(0, 256, (5, 3, 16), dtype=np.uint8)
    sc = rng.integers(0, 256, (5, 3), dtype=np.uint8)
    ref = decode_expert(packed, sc)
    got = mxfp4x.dequantize(packed, sc, torch.float64).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(got[~np.isnan(ref)], ref[~np.isnan(ref)])


def test_scale_rules(rng):
    w = torch.from_numpy(rng.standard_normal((50, 64)))
    w[0, 0] = 7.9  # floor: 2^0, saturates at 6; ceil and even: 2^1
    p_floor, s_floor = mxfp4x.quantize(w, "floor")
    p_ceil, s_ceil = mxfp4x.quantize(w, "ceil")
    p_even, s_even = mxfp4x.quantize(w, "even")
    assert s_floor[0, 0] == 127 and s_ceil[0, 0] == 128 and s_even[0, 0] == 128
    d_ceil = mxfp4x.dequantize(p_ceil, s_ceil, torch.float64)
    amax = w.view(50, 2, 32).abs().amax(-1)
    assert (amax <= 6 * torch.exp2(s_ceil.double() - 127)).all()  # ceil never saturates
    assert ((d_ceil - w).abs() <= torch.exp2(s_ceil.double() - 127).repeat_interleave(32, 1)
            ).all()
    assert (s_even >= s_floor).all() and (s_even <= s_floor + 1).all()
    with pytest.raises(ValueError, match="scale_rule"):
        mxfp4x.quantize(w, "nearest")


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4x.quantize(torch.randn(3, 33))
    with pytest.raises(TypeError, match="float"):
        mxfp4x.quantize(torch.ones(2, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="packed_weights"):
        mxfp4x.dequantize(torch.zeros(2, 3, 8, dtype=torch.uint8),
                          torch.zeros(2, 3, dtype=torch.uint8))


def test_quantized_layer_runs_through_the_op(rng):
    w = torch.from_numpy(rng.standard_normal((4, 24, 96))).float()  # (E, O, I)
    packed, scales = mxfp4x.quantize(w)
    assert packed.shape == (4, 24, 3, 16) and scales.shape == (4, 24, 3)
    dense = mxfp4x.dequantize(packed, scales)
    x = torch.randn(5, 96)
    sel = torch.tensor([[0, 3], [1, 1], [2, 0], [3, 2], [0, 0]])
    mix = torch.rand(5, 2)
    y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, torch.zeros(5, 24))
    d, xd, md = dense.double(), x.double(), mix.double()
    want = sum(md[:, k:k + 1] * torch.einsum("toi,ti->to", d[sel[:, k]], xd) for k in range(2))
    mag = sum(md[:, k:k + 1] * torch.einsum("toi,ti->to", d[sel[:, k]].abs(), xd.abs())
              for k in range(2))
    # the documented float32 bound against float64, not a fixed tolerance
    bound = error_bound(mag.numpy(), 96 + 2 + 1, "float32", reference=want.numpy(),
                        out="float32")
    assert (np.abs(y.double().numpy() - want.numpy()) <= bound).all()


def test_exponent_is_exact_just_below_a_power_of_two():
    # torch.log2(8 * (1 - 2^-53)) rounds to 3.0; the scale must still be 2^(2 - 2)
    w = torch.zeros(1, 32, dtype=torch.float64)
    w[0, 0] = 8 * (1 - 2.0 ** -53)
    assert mxfp4x.quantize(w)[1].item() == 127
    w[0, 0] = 6.0
    assert mxfp4x.quantize(w, "ceil")[1].item() == 127  # 6 fits 6 * 2^0 exactly
    w[0, 0] = 6.0 * (1 + 2.0 ** -52)
    assert mxfp4x.quantize(w, "ceil")[1].item() == 128


def test_quantize_in_chunks_matches_one_shot(rng):
    # more groups than one chunk (2^20): the chunked loop must stitch exactly
    w = torch.from_numpy(rng.standard_normal((2**20 + 77, 32)).astype(np.float32))
    packed, scales = mxfp4x.quantize(w)
    tail_p, tail_s = mxfp4x.quantize(w[-100:])
    assert torch.equal(packed[-100:], tail_p) and torch.equal(scales[-100:], tail_s)
