"""The ISAs with a bf16 dot-product unit: bfloat16 latents on AMX tiles ("amx",
include/mxfp4x/amx.h) and on AVX512-BF16's vdpbf16ps ("avx512bf16", avx512bf16.h).

Every token of a bf16 call takes the unit's arithmetic at any batch size (amx: up to 4
tokens per expert a register gemv that replays the tiles, bit for bit; avx512bf16: up to 12
(32 on an AMD Zen 4 or 5) a fused gemv, then a decoded panel, the same instructions on the
same operands); a token with a nonzero latent under 2^-60 or one of 2^64 or more, and rows
with a nonzero code under a scale byte < 69 or any scale byte >= 160 (amx: their block of
16), leave the unit: small values for vdpbf16ps's arithmetic in float32 FMAs (no flush;
amx too), values that could overflow for the float64 exact path.  Checked against the
float64 reference within the documented bound, bit for bit across batches (amx: the gemv
gives way to the tiles above 4 tokens, whose shapes change at 16, 32 and 48; avx512bf16:
fused blocks of 4 tokens, the panel above its switch in blocks of 6), in float32 before
the result's rounding, across threads and token positions, on both arrangements.  Each
ISA skipped where the CPU (or the OS) cannot run it."""
import re

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x._core.reference import error_bound, mxfp4_experts_reference
from mxfp4x.testing.layers import gguf_blocks_of
from mxfp4x.testing.layers import random_layer as _random_layer

UNITS = ("amx", "avx512bf16")


@pytest.fixture(params=[pytest.param(u, marks=pytest.mark.skipif(
    u not in _cpu.runnable_isas(), reason=f"this CPU or OS cannot run {u}")) for u in UNITS])
def unit(request):
    """Each ISA with a bf16 unit that this CPU can run."""
    return request.param


def test_each_unit_takes_bf16_latents():
    for u in set(UNITS) & set(_cpu.runnable_isas()):
        assert _cpu.has_bf16_unit(u)
    assert not _cpu.has_bf16_unit("avx512")


def random_layer(*a, **k):
    return tuple(_random_layer(*a, **k).values())


def _near(got, other, x, packed, scales, sel, mix, shared):
    """Two results of the same call, each within the documented bound of the reference:
    within twice that bound of each other."""
    mag = mxfp4x.mxfp4_experts(x.double().abs(), packed & 0x77, scales, sel,
                               mix.double().abs(), shared.double().abs()).numpy()
    other = other.double().numpy()
    bound = error_bound(mag, x.shape[-1] + sel.shape[1] + 1, reference=other, out="bfloat16")
    assert (np.abs(got.double().numpy() - other) <= 2 * bound).all()


def _check(args, got, d_in):
    x, packed, scales, sel, mix, shared = args
    x, mix, shared = (t.double().numpy() for t in (x, mix, shared))
    ref = mxfp4_experts_reference(x, packed.numpy(), scales.numpy(), sel.numpy(), mix, shared)
    mag = mxfp4_experts_reference(abs(x), packed.numpy(), scales.numpy(), sel.numpy(),
                                  abs(mix), abs(shared), absolute=True)
    bound = error_bound(mag, d_in + sel.shape[1] + 1, reference=ref, out="bfloat16")
    got = got.double().numpy()
    # where a term passes float32's range (scale bytes 253, 254), the kernels overflow as
    # every float32 path does: only NaN in the reference is held there
    finite = mag < 2.0 ** 127
    assert np.isnan(got[np.isnan(ref)]).all()
    err = np.abs(got - ref)[finite]
    assert (err <= bound[finite]).all(), (err.max(), bound[finite].min())


@pytest.mark.parametrize("n_tokens", [3, 40])
def test_rows_of_no_groups_give_the_shared_output(unit, rng, n_tokens):
    """I = 0: every product is an empty sum, through the fused path (3 tokens) and the
    panel (40 tokens per expert); the panel's slicing once divided by zero here."""
    x = torch.zeros(n_tokens, 0, dtype=torch.bfloat16)
    packed = torch.zeros(2, 53, 0, 16, dtype=torch.uint8)
    scales = torch.zeros(2, 53, 0, dtype=torch.uint8)
    sel = torch.from_numpy(rng.integers(0, 2, (n_tokens, 2)))
    mix = torch.from_numpy(rng.random((n_tokens, 2))).bfloat16()
    shared = torch.from_numpy(rng.standard_normal((n_tokens, 53))).bfloat16()
    got = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, isa=unit)
    assert torch.equal(got, shared)


@pytest.mark.parametrize("n_tokens", [1, 15, 17, 33, 70])
@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_against_the_reference(unit, rng, n_tokens, form):
    args = random_layer(rng, n_tokens, 3, 5, 37, 3, dtype=torch.bfloat16)
    x, packed, scales, *rest = args
    if form == "gguf":
        blocks = torch.from_numpy(gguf_blocks_of(packed.numpy(), scales.numpy()))
        got = mxfp4x.mxfp4_experts(x, blocks, None, *rest, isa=unit)
    else:
        got = mxfp4x.mxfp4_experts(*args, isa=unit)
    assert got.dtype == torch.bfloat16
    _check(args, got, 96)
    # beside avx512's float32 FMAs (safetensors form)
    other = mxfp4x.mxfp4_experts(x, packed, scales, *rest, isa="avx512")
    _near(got, other, x, packed, scales, *rest)


def test_bit_identical_across_batches_threads_and_positions(unit, rng):
    """Every token alone, in slices that cross the token blocks (16) and the tile shapes
    (4 x 1, 2 x 2, 1 x 4 C tiles), reversed, and on 1, 2 and 3 threads: the same bits."""
    args = random_layer(rng, 70, 4, 3, 131, 5, dtype=torch.bfloat16)
    x, packed, scales, sel, mix, shared = args
    full = mxfp4x.mxfp4_experts(*args, isa=unit, num_threads=2)
    for n in (1, 3):
        assert torch.equal(mxfp4x.mxfp4_experts(*args, isa=unit, num_threads=n), full)
    for t0, t1 in ((0, 1), (5, 6), (69, 70), (0, 16), (3, 20), (10, 43), (7, 70)):
        part = mxfp4x.mxfp4_experts(x[t0:t1], packed, scales, sel[t0:t1], mix[t0:t1],
                                    shared[t0:t1], isa=unit)
        assert torch.equal(part, full[t0:t1]), (t0, t1)
    rev = torch.arange(69, -1, -1)
    back = mxfp4x.mxfp4_experts(x[rev], packed, scales, sel[rev], mix[rev], shared[rev],
                                isa=unit)
    assert torch.equal(back, full[rev])


def test_exact_path_for_tiny_latents_and_small_scales(unit, rng):
    """Tokens with bf16 subnormals or latents under 2^-60, rows whose scale bytes are 0, 1,
    68 leave the unit (float32 FMAs, subnormals kept; 255: NaN on either path):
    within the bound, nothing flushed, and the same bits alone as in a batch."""
    args = random_layer(rng, 40, 3, 4, 50, 4, dtype=torch.bfloat16)
    x, packed, scales, sel, mix, shared = args
    x = x.clone()
    x[3, 5] = 2.0 ** -130       # a bf16 subnormal
    x[7] = x[7] * 2.0 ** -118   # every latent tiny: products under 2^-126
    x[11, :] = 2.0 ** -61
    scales = scales.clone()
    scales[0, 2, 1] = 0         # 2^-127 under nonzero codes
    scales[1, 17, 0] = 1
    scales[2, 33, 3] = 68
    scales[3, 49, 2] = 160      # large, in range
    scales[3, 20, 1] = 255
    packed = packed.clone()
    packed[0, 2, 1] = 0x13      # nonzero codes where the scale is 0
    args = (x, packed, scales, sel, mix, shared)
    # the tiny tokens alone (their outputs scaled up to where the bound is not all noise)
    got = mxfp4x.mxfp4_experts(*args, isa=unit)
    _check(args, got, 128)
    for t in (3, 7, 11, 12):
        one = mxfp4x.mxfp4_experts(x[t:t + 1], packed, scales, sel[t:t + 1], mix[t:t + 1],
                                   shared[t:t + 1], isa=unit)
        assert torch.equal(one.view(torch.int16), got[t:t + 1].view(torch.int16)), t
    # a tiny token's own dot products (no shared output to hide them): not flushed
    tiny = x[7:8]
    dots = mxfp4x.mxfp4_experts_slots(tiny, packed, scales, sel[7:8], isa=unit).double()
    ref = mxfp4x.mxfp4_experts_slots(tiny.double(), packed, scales, sel[7:8]).double()
    # where the result is a normal bf16 (a dot product can cancel to below that, rarely)
    ok = ref.isfinite() & (ref.abs() >= 2.0 ** -126)
    assert ok.sum() >= ref.isfinite().sum() - 3 and (dots[ok] != 0).all()
    assert ((dots - ref).abs()[ok] <= 2.0 ** -8 * ref.abs()[ok]).all()
    assert torch.equal(dots.isnan(), ref.isnan())


@pytest.mark.skipif("avx512bf16" not in _cpu.runnable_isas(),
                    reason="this CPU or OS cannot run avx512bf16")
@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_avx512bf16_float32_path_gives_the_units_bits(rng, form):
    """avx512bf16 sends a token with a latent under 2^-60 to the unit's arithmetic in
    float32 FMAs (vdpbf16ps without its flushes).  Where nothing is subnormal that is the
    unit's own result, bit for bit: here one latent of 2^-100, the last product of its lane
    (even element of the last, odd-numbered group), is absorbed by every row's nonzero
    partial sum, so each token with it (off the unit) gives in float32 the bits the same
    token with a 0 there gets on the unit -- alone, and among others on the fused gemv and
    on the panel.  A wrong order of the two products, of the chunks or of the reduction
    would miss on some of the cells."""
    m = _cpu.gemv_max_tokens("avx512bf16", bf16=True)
    n_tok, d_out, n_groups = m + 9, 37, 7
    x = torch.from_numpy(rng.standard_normal((n_tok, 32 * n_groups))).bfloat16()
    packed = torch.from_numpy(rng.integers(0, 256, (2, d_out, n_groups, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(115, 135, (2, d_out, n_groups), dtype=np.uint8))
    if form == "gguf":
        packed = torch.from_numpy(gguf_blocks_of(packed.numpy(), scales.numpy()))
        scales = None
    # element 6 of the last group (pairs: byte 3's low nibble; GGUF halves: element 3 is
    # that lane's even word) is the last product of its lane
    at = 32 * (n_groups - 1) + (6 if form == "safetensors" else 3)
    tiny = x.clone()
    tiny[:, at] = 2.0 ** -100
    zero = x.clone()
    zero[:, at] = 0
    sel = torch.from_numpy(rng.integers(0, 2, (n_tok, 2)))
    unit = _dots_f32("avx512bf16", zero, packed, scales, sel, n_threads=2)
    for t in (0, 5):
        one = _dots_f32("avx512bf16", tiny[t:t + 1], packed, scales, sel[t:t + 1])
        assert np.array_equal(one, unit[2 * t:2 * t + 2]), t
    # every token off the unit, 4 at a time; and a batch where only some are
    mixed = zero.clone()
    mixed[::3] = tiny[::3]
    for xs in (tiny, mixed):
        assert np.array_equal(_dots_f32("avx512bf16", xs, packed, scales, sel), unit)
        assert np.array_equal(_dots_f32("avx512bf16", xs[:6], packed, scales, sel[:6]),
                              unit[:12])


@pytest.mark.parametrize("latent,scale", [(2.0 ** 120, 134), (2.0 ** 60, 200)],
                         ids=["latent-2^120", "scale-200"])
def test_huge_latents_and_scales_take_the_exact_path(unit, rng, latent, scale):
    """+6 and -6 under one scale times the same huge latent: the tiles (scale folded into
    the weights) would overflow each product to inf and give inf - inf = NaN, the gemv
    (scale taken out of the group's sums) 0.  A token with a latent of 2^64 or more and a
    block with a scale byte of 160 or more take the exact path: the same bits alone (the
    gemv) as among 19 others (the tiles), and the reference's value."""
    n_tok, d_out, n_groups = 20, 16, 2
    x = torch.from_numpy(rng.standard_normal((n_tok, 32 * n_groups))).bfloat16()
    packed = torch.from_numpy(rng.integers(0, 256, (1, d_out, n_groups, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(120, 135, (1, d_out, n_groups), dtype=np.uint8))
    x[5] = 0
    x[5, 0] = x[5, 2] = latent  # elements 0 and 2 (the low nibbles of bytes 0 and 1)
    packed[0, 3, 0, :2] = torch.tensor([0x07, 0x0F], dtype=torch.uint8)  # +6, -6
    scales[0, 3, 0] = scale
    sel = torch.zeros((n_tok, 1), dtype=torch.int64)
    batch = mxfp4x.mxfp4_experts_slots(x, packed, scales, sel, isa=unit)
    alone = mxfp4x.mxfp4_experts_slots(x[5:6], packed, scales, sel[5:6], isa=unit)
    assert torch.equal(alone.view(torch.int16), batch[5:6].view(torch.int16))
    ref = mxfp4x.mxfp4_experts_slots(x[5:6].double(), packed, scales, sel[5:6])
    assert ref[0, 0, 3] == 0 and batch[5, 0, 3] == 0
    finite = ref.abs() < 2.0 ** 127
    assert ((alone.double() - ref).abs()[finite] <= 2.0 ** -8 * ref.abs()[finite]).all()


def test_float32_latents_run_avx512s_kernels(unit, rng):
    """Only bf16 latents take the tiles: float32 and float16 give avx512's bits."""
    for dtype in (torch.float32, torch.float16):
        args = random_layer(rng, 20, 2, 3, 40, 3, dtype=dtype)
        assert torch.equal(mxfp4x.mxfp4_experts(*args, isa=unit),
                           mxfp4x.mxfp4_experts(*args, isa="avx512"))


def test_tiles_and_exact_path_agree_where_the_sums_are_exact(unit, rng):
    """Small-integer latents and weights at scale 1: every partial sum is exact in float32,
    so the tiles, the path off the unit (the same token scaled by 2^-118, whose products
    the unit would flush) and the reference all give the same bits."""
    n_tok, d_out, n_groups = 21, 40, 3
    x = torch.from_numpy(rng.integers(-8, 9, (n_tok, 32 * n_groups)).astype(np.float32))
    x = x.bfloat16()
    packed = torch.from_numpy(rng.integers(0, 256, (2, d_out, n_groups, 16), dtype=np.uint8))
    scales = torch.full((2, d_out, n_groups), 127, dtype=torch.uint8)
    sel = torch.from_numpy(rng.integers(0, 2, (n_tok, 1)))
    tiles = mxfp4x.mxfp4_experts_slots(x, packed, scales, sel, isa=unit)
    exact = mxfp4x.mxfp4_experts_slots(x * 2.0 ** -118, packed, scales, sel, isa=unit)
    ref = mxfp4x.mxfp4_experts_slots(x.double(), packed, scales, sel)
    assert (ref.abs() < 2.0 ** 24).all() and (ref != 0).any()
    assert torch.equal(tiles, ref.bfloat16())
    assert torch.equal(exact, (ref * 2.0 ** -118).bfloat16())


def test_per_slot_latents(unit, rng):
    """One latent row per (token, slot), as gpt-oss's down projection takes them."""
    x, packed, scales, sel, mix, shared = random_layer(rng, 19, 3, 4, 45, 3,
                                                       dtype=torch.bfloat16)
    per_slot = torch.from_numpy(rng.standard_normal((19, 3, 96))).bfloat16()
    got = mxfp4x.mxfp4_experts(per_slot, packed, scales, sel, mix, shared, isa=unit)
    other = mxfp4x.mxfp4_experts(per_slot, packed, scales, sel, mix, shared, isa="avx512")
    _near(got, other, per_slot, packed, scales, sel, mix, shared)
    one = mxfp4x.mxfp4_experts(per_slot[4:5], packed, scales, sel[4:5], mix[4:5],
                               shared[4:5], isa=unit)
    assert torch.equal(one, got[4:5])


def _dots_f32(unit, x, packed, scales, sel, n_threads=1):
    """The float32 dot products of every (token, slot) before any rounding to bf16: the
    driver called as the op calls it, its result left in float32."""
    from mxfp4x._core import cpu_impl as _cpu_impl
    ex = _cpu_impl.experts_of(packed, scales)
    out = np.full((sel.numel(), ex.d_out), np.nan, dtype=np.float32)
    _cpu.Call(ex, product="forward", compute="float32", selected=sel.to(torch.int64).numpy(),
              mix=None, src=x.view(torch.int16).numpy(), src_dtype="bfloat16",
              src_rows="token", dst=out, dst_rows="slot", isa=unit,
              n_threads=n_threads).run()
    return out.view(np.uint32)


@pytest.mark.parametrize("n_groups", [37, 3, 90])
@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_gemv_gives_the_tiles_float32_bits(unit, rng, form, n_groups):
    """amx: up to MXFP4X_AMX_GEMV_MAX_TOKENS (4) tokens per expert take a register gemv
    that replays tdpbf16ps's arithmetic, up to 64 the tiles fed from L1, more the tiles
    through the panel; avx512bf16: up to its switch
    (12 tokens, 32 on an AMD Zen 5) the fused gemv, more the panel.  In float32, before the
    result's one rounding: every token alone (the gemv) gives the bits it gets among 30 or
    more tokens of one expert (the tiles), for both arrangements, tiny and huge latents
    (off the unit) included; rows past a multiple of 16 included (d_out 45); 37 groups
    (the scale bytes read 16 groups at a time, then 5; amx's steps of 4 groups, then 1),
    3 (fewer than a step) and 90 (gpt-oss's rows)."""
    m = _cpu.gemv_max_tokens(unit, bf16=True)
    n_tok, n_exp, d_out = max(80, m + 12), 3, 45
    x = torch.from_numpy(rng.standard_normal((n_tok, 32 * n_groups))).bfloat16()
    x[4] *= 2.0 ** -100          # tiny: off the unit on both
    x[9, 3] = 2.0 ** 70          # huge: the float64 exact path on both
    packed = torch.from_numpy(rng.integers(0, 256, (n_exp, d_out, n_groups, 16),
                                           dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(110, 135, (n_exp, d_out, n_groups), dtype=np.uint8))
    scales[1, 17, n_groups - 1] = 200  # large: the float64 exact path (amx: its 16-row block)
    # expert 0 gets every token and experts 1 and 2 about half each: the tiles
    sel = torch.zeros((n_tok, 2), dtype=torch.int64)
    sel[:, 1] = torch.from_numpy(rng.integers(1, 3, n_tok))
    if form == "gguf":
        packed = torch.from_numpy(gguf_blocks_of(packed.numpy(), scales.numpy()))
        scales = None
    full = _dots_f32(unit, x, packed, scales, sel, n_threads=2)
    assert not np.isnan(full.view(np.float32)).any()
    for t in range(n_tok):
        one = _dots_f32(unit, x[t:t + 1], packed, scales, sel[t:t + 1])
        assert np.array_equal(one, full[2 * t:2 * t + 2]), t
    # and 2 to 5 tokens at once (the gemv's blocks of 2, 3, 4 tokens, amx's tiles from
    # L1), each side of the unit's own switch (avx512bf16: m fused, m + 1 on the panel)
    # and amx's shapes of C tiles fed from L1 (4 x 1 to 16 tokens, 2 x 2 to 32, 1 x 4 to
    # 64) and its switch to the panel (64, 65)
    for n in sorted({2, 3, 4, 5, m, m + 1, 16, 17, 33, 64, 65}):
        part = _dots_f32(unit, x[10:10 + n], packed, scales, sel[10:10 + n])
        assert np.array_equal(part, full[20:20 + 2 * n]), n


def _amd_family():
    """This host's CPU family if /proc/cpuinfo names an AMD CPU, 0 for another vendor,
    None where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    family = re.search(r"^cpu family\s*:\s*(\d+)", text, re.M)
    return int(family.group(1)) if "AuthenticAMD" in text and family else 0


@pytest.mark.skipif("avx512bf16" not in _cpu.runnable_isas() or _amd_family() is None,
                    reason="needs avx512bf16 and /proc/cpuinfo")
def test_avx512bf16_switch_follows_the_core():
    """avx512bf16's fused/panel switch is a property of the core (avx512bf16.h): 32 tokens
    per expert on an AMD Zen 4 or Zen 5 (family 25 or 26, 19h or 1Ah), where the fused gemv
    outran the panel up to ~40 tokens; 12 on every other CPU (an Intel Xeon)."""
    expected = 32 if _amd_family() in (25, 26) else 12
    assert _cpu.gemv_max_tokens("avx512bf16", bf16=True) == expected


@pytest.mark.skipif("avx512" not in _cpu.runnable_isas() or _amd_family() is None,
                    reason="needs avx512 and /proc/cpuinfo")
def test_avx512_float32_switch_follows_the_core():
    """The AVX-512 float32 gemv/panel switch (dispatch.h's mxfp4x_gemv_switch): 256 tokens
    per expert on an AMD Zen 4 or Zen 5, where the gemv outran or matched decode +
    panel_dot at every batch measured; the entry's own 32 elsewhere.  The entries that
    reuse avx512's float32 kernels (avx512bf16, amx) follow it; avx2 keeps 8."""
    expected = 256 if _amd_family() in (25, 26) else 32
    for isa in ("avx512", "avx512bf16", "amx"):
        if isa in _cpu.runnable_isas():
            assert _cpu.gemv_max_tokens(isa) == expected, isa
    if "avx2" in _cpu.runnable_isas():
        assert _cpu.gemv_max_tokens("avx2") == 8
