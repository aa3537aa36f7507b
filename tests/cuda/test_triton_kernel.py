"""The GPU kernel (mxfp4x._core.triton_impl) against the float64 reference: on CUDA tensors
where a GPU is here, else on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
set before Triton is imported: CI runs this file so).  Skipped without Triton, or without
both a GPU and the interpreter; MXFP4X_REQUIRE_TRITON=1 makes that a failure."""
import os

import numpy as np
import pytest
import torch

from mxfp4x._core import triton_impl as ti
from mxfp4x._core.reference import decode_expert, mxfp4_experts_reference
from mxfp4x.testing.layers import (
    assert_matches_reference,
    gguf_blocks_of,
    random_layer,
    reference_and_bound,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
_missing = ("Triton is not installed" if not ti.available() else
            None if DEVICE == "cuda" or INTERPRETED else
            "no GPU here: run with TRITON_INTERPRET=1 for Triton's interpreter")
if _missing and os.environ.get("MXFP4X_REQUIRE_TRITON") == "1":
    raise RuntimeError(f"MXFP4X_REQUIRE_TRITON=1: {_missing}")
pytestmark = pytest.mark.skipif(_missing is not None, reason=str(_missing))

SIZES = [  # T, K, E, O, G: one token; odd rows; tiles past 16 pairs; more experts than pairs
    (1, 4, 6, 70, 5), (9, 4, 6, 70, 3), (20, 3, 2, 33, 2), (3, 2, 40, 17, 1)]


@pytest.fixture(params=["tile", "token"], autouse=True)
def kernel(request, monkeypatch):
    """Every test through both kernels: the tile kernel (tl.dot on a tile of pairs of an
    expert) and the token kernel (one token's slots, combined in the same launch)."""
    monkeypatch.setattr(ti, "TOKEN_KERNEL_PAIRS_PER_EXPERT",
                        0 if request.param == "tile" else 10 ** 9)
    if INTERPRETED:  # fewer programs, each run in Python (a row's bits do not depend on it)
        monkeypatch.setattr(ti, "TOKEN_BLOCK_O", 128)
    return request.param


def _on(layer):
    return {k: None if v is None else v.to(DEVICE) for k, v in layer.items()}


def _run(layer, packed=None, scales="same"):
    d = _on(layer)
    return ti.experts(d["latent_tokens"], d["packed_weights"] if packed is None else packed,
                      d["scale_bytes"] if scales == "same" else scales,
                      d["selected_experts"], d["mixture_weights"], d["shared_output"],
                      d["latent_tokens"].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_both_layouts_match_reference(rng, dtype, size):
    # scale bytes from 0 (2^-127, a float32 subnormal) up; float16 results stay in range
    scales = (0, 140) if dtype != torch.float16 else (119, 134)
    layer = random_layer(rng, *size, dtype=dtype, repeat_expert=True, scale_range=scales)
    y = _run(layer)
    assert y.dtype == dtype and y.device.type == DEVICE
    assert_matches_reference(y, layer)
    blocks = torch.from_numpy(gguf_blocks_of(layer["packed_weights"], layer["scale_bytes"]))
    assert_matches_reference(_run(layer, blocks.to(DEVICE), None), layer)


def test_per_slot_latents_and_slots(rng):
    """Slot outputs of per-slot latents (T, K, I) against float64 products."""
    layer = random_layer(rng, 7, 3, 4, 45, 2)
    d = _on(layer)
    per_slot = torch.randn(7, 3, 64, dtype=torch.float64)
    slots = ti.slots(per_slot.float().to(DEVICE), d["packed_weights"], d["scale_bytes"],
                     d["selected_experts"]).cpu()
    assert slots.shape == (7, 3, 45) and slots.dtype == torch.float32
    for t in range(7):
        for k in range(3):
            e = int(layer["selected_experts"][t, k])
            w = decode_expert(layer["packed_weights"][e].numpy(), layer["scale_bytes"][e].numpy())
            want = w @ per_slot[t, k].float().double().numpy()
            bound = 1e-6 * (np.abs(w) @ np.abs(per_slot[t, k].double().numpy())) + 1e-30
            assert np.all(np.abs(slots[t, k].double().numpy() - want) <= bound), (t, k)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's tl.dot is numpy's matmul, "
                    "whose rounding may follow the tile's other rows")
@pytest.mark.parametrize("gguf", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_token_has_the_same_bits_alone_in_a_batch_and_through_either_kernel(
        rng, kernel, monkeypatch, gguf, dtype):
    layer = random_layer(rng, 37, 4, 3, 70, 4, dtype=dtype)  # ~50 pairs per expert
    if gguf:
        blocks = gguf_blocks_of(layer["packed_weights"], layer["scale_bytes"])
        layer["packed_weights"], layer["scale_bytes"] = torch.from_numpy(blocks), None
    full = _run(layer)
    other = 10 ** 9 if kernel == "tile" else 0
    monkeypatch.setattr(ti, "TOKEN_KERNEL_PAIRS_PER_EXPERT", other)
    assert torch.equal(_run(layer), full)
    for t in (0, 5, 17, 36):
        one = {k: v[t:t + 1] if k not in ("packed_weights", "scale_bytes") else v
               for k, v in layer.items()}
        assert torch.equal(_run(one)[0], full[t]), t


def test_lists_give_the_bits_of_the_stacked_form(rng):
    layer = random_layer(rng, 11, 3, 5, 40, 3, scale_range=(0, 140))
    d = _on(layer)
    stacked = _run(layer)
    for form in ("3d", "2d"):
        packed = [p if form == "3d" else p.reshape(40, -1) for p in d["packed_weights"]]
        got = ti.experts(d["latent_tokens"], packed, list(d["scale_bytes"]),
                         d["selected_experts"], d["mixture_weights"], d["shared_output"],
                         torch.float32)
        assert torch.equal(got, stacked), form
    blocks = torch.from_numpy(gguf_blocks_of(layer["packed_weights"], layer["scale_bytes"]))
    blocks = blocks.to(DEVICE)
    got = ti.experts(d["latent_tokens"], list(blocks), None, d["selected_experts"],
                     d["mixture_weights"], d["shared_output"], torch.float32)
    assert torch.equal(got, _run(layer, blocks, None))
    if DEVICE == "cuda":
        assert ti.usable(d["latent_tokens"], list(d["packed_weights"]),
                         list(d["scale_bytes"]))
        mixed = [d["packed_weights"][0][:, ::1], d["packed_weights"][1][::2]]
        assert not ti.usable(d["latent_tokens"], mixed, list(d["scale_bytes"][:2]))


def test_scale_bytes_at_the_ends(rng):
    """0 (subnormal), 1, 254 and 255 (NaN): NaN where the reference has NaN; within the
    bound where no term passes float32's range and no weight decodes past it (the kernels
    decode a weight with its scale, as the torch backend does, so a value of 2^128 or more,
    scale bytes 253 and 254, is infinite there even when its product would not be)."""
    layer = random_layer(rng, 6, 2, 3, 20, 3)
    # 254 and 255 rare enough that most outputs stay finite, common enough to be met
    pick = torch.from_numpy(rng.choice(5, layer["scale_bytes"].shape,
                                       p=[0.2, 0.2, 0.5, 0.05, 0.05]))
    layer["scale_bytes"] = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)[pick]
    got = _run(layer).double().cpu().numpy()
    ref, bound = reference_and_bound(layer, torch.float32)
    args = [layer[k].double().numpy() if layer[k].is_floating_point() else layer[k].numpy()
            for k in ("latent_tokens", "packed_weights", "scale_bytes", "selected_experts",
                      "mixture_weights", "shared_output")]
    x, packed, scales, sel, mix, shared = args
    mag = mxfp4_experts_reference(abs(x), packed, scales, sel, abs(mix), abs(shared),
                                  absolute=True)
    with np.errstate(invalid="ignore"):  # NaN weights (scale byte 255)
        widest = np.stack([np.nan_to_num(np.abs(decode_expert(packed[e], scales[e])),
                                         nan=0.0).max(1) for e in range(len(packed))])
    decodes = (widest[sel] < 2.0 ** 128).all(1)  # (T, O): every selected row's weights
    assert np.isnan(ref).any() and np.isnan(got[np.isnan(ref)]).all()
    finite = (mag < 2.0 ** 127) & decodes
    bad = finite & ~(np.abs(got - ref) <= bound)
    assert finite.any() and not bad.any(), (got[bad], ref[bad], bound[bad], mag[bad])


def test_long_calls_run_in_chunks_with_the_same_bits(rng, monkeypatch, kernel):
    if kernel == "tile" and DEVICE != "cuda":
        pytest.skip("the interpreter's tl.dot is numpy's matmul, whose rounding may follow "
                    "the tile's other rows")
    layer = random_layer(rng, 23, 3, 4, 40, 2)
    whole = _run(layer)
    d = _on(layer)
    slots = ti.slots(d["latent_tokens"], d["packed_weights"], d["scale_bytes"],
                     d["selected_experts"])
    monkeypatch.setattr(ti, "CHUNK_BYTES", 5 * 3 * 40 * 4)  # 5 tokens a chunk
    assert len(ti._chunks(23, 3, 40)) == 5
    assert torch.equal(_run(layer), whole)
    assert torch.equal(ti.slots(d["latent_tokens"], d["packed_weights"], d["scale_bytes"],
                                d["selected_experts"]), slots)


def test_strided_views_and_latents(rng):
    """Every other expert (expert stride twice its size), groups padded to 20 bytes with
    strided scales, and latents whose rows are not contiguous."""
    layer = random_layer(rng, 5, 2, 8, 24, 2)
    d = _on(layer)
    sub = dict(layer, packed_weights=layer["packed_weights"][::2],
               scale_bytes=layer["scale_bytes"][::2],
               selected_experts=layer["selected_experts"] % 4)
    assert_matches_reference(_run(sub, d["packed_weights"][::2], d["scale_bytes"][::2]), sub)
    padded = torch.zeros(8, 24, 2, 20, dtype=torch.uint8, device=DEVICE)
    padded[..., :16] = d["packed_weights"]
    wide_scales = torch.zeros(8, 24, 4, dtype=torch.uint8, device=DEVICE)
    wide_scales[..., ::2] = d["scale_bytes"]
    want = _run(layer)
    assert torch.equal(_run(layer, padded[..., :16], wide_scales[..., ::2]), want)
    x_t = d["latent_tokens"].T.contiguous().T  # column-major rows
    got = ti.experts(x_t, d["packed_weights"], d["scale_bytes"], d["selected_experts"],
                     d["mixture_weights"], d["shared_output"], torch.float32)
    assert torch.equal(got, want)


def test_empty_calls(rng):
    layer = random_layer(rng, 5, 2, 8, 24, 2)
    none = {k: v[:0] if k not in ("packed_weights", "scale_bytes") else v
            for k, v in layer.items()}
    assert _run(none).shape == (0, 24)
    # no inputs (I = 0): every product an empty sum, the shared output as it is
    no_inputs = dict(layer, latent_tokens=layer["latent_tokens"][:, :0],
                     packed_weights=layer["packed_weights"][:, :, :0],
                     scale_bytes=layer["scale_bytes"][:, :, :0])
    assert torch.equal(_run(no_inputs).cpu(), layer["shared_output"])
    d = _on(no_inputs)
    assert not ti.slots(d["latent_tokens"], d["packed_weights"], d["scale_bytes"],
                        d["selected_experts"]).any()
    per_slot = _on(dict(layer, latent_tokens=torch.zeros(5, 2, 0)))
    assert torch.equal(ti.experts(per_slot["latent_tokens"], d["packed_weights"],
                                  d["scale_bytes"], d["selected_experts"],
                                  d["mixture_weights"], d["shared_output"],
                                  torch.float32).cpu(), layer["shared_output"])


def test_subnormal_scale_is_kept(rng):
    """Every scale byte 0 (2^-127), no shared output: the products alone, far below
    float32's normal range, must come out nonzero and within the bound."""
    layer = random_layer(rng, 4, 2, 3, 16, 2, scale_range=(0, 0))
    layer["shared_output"].zero_()
    layer["mixture_weights"].fill_(1.0)
    got = _run(layer)
    assert (got != 0).float().mean() > 0.9
    assert_matches_reference(got, layer)


def test_per_slot_latents_weighted_and_combined(rng):
    layer = random_layer(rng, 7, 3, 4, 45, 2)
    x = torch.from_numpy(rng.standard_normal((7, 3, 64))).float()
    got = _run(dict(layer, latent_tokens=x)).double().cpu().numpy()
    want = layer["shared_output"].double().numpy().copy()
    bound = np.abs(want).copy()
    for t in range(7):
        for k in range(3):
            e = int(layer["selected_experts"][t, k])
            w = decode_expert(layer["packed_weights"][e].numpy(), layer["scale_bytes"][e].numpy())
            p = float(layer["mixture_weights"][t, k])
            want[t] += p * (w @ x[t, k].double().numpy())
            bound[t] += abs(p) * (np.abs(w) @ np.abs(x[t, k].double().numpy()))
    assert np.all(np.abs(got - want) <= 1e-5 * bound)


def test_what_the_kernels_take(rng):
    """qualifies(): uint8 weights of the contract's shapes on the latents' device, groups
    contiguous; anything else is the torch path's (which checks and reports)."""
    layer = _on(random_layer(rng, 3, 2, 4, 8, 2))
    x, p, s = layer["latent_tokens"], layer["packed_weights"], layer["scale_bytes"]
    assert ti.qualifies(x, p, s) and ti.qualifies(x, list(p), list(s))
    assert ti.qualifies(x, [t.reshape(8, 32) for t in p], list(s))
    assert not ti.qualifies(x, p.transpose(2, 3).contiguous().transpose(2, 3), s)
    assert not ti.qualifies(x, p, s.view(torch.int8))  # 255 would read as -1
    assert not ti.qualifies(x, p.view(torch.int8), s)
    assert not ti.qualifies(x[:, :32], p, s)  # G does not match I
    assert not ti.qualifies(x, p, s[:, :, :1])
    assert not ti.qualifies(x, p, None)  # 16-byte groups are not GGUF blocks
    assert not ti.qualifies(x, list(p)[:1] + [p[1][:4]], list(s))
    assert not ti.qualifies(x, list(p), list(s)[:3])
    assert not ti.qualifies(x, [], [])


def test_a_triton_older_than_the_kernels_is_not_used(monkeypatch, kernel):
    """torch 2.1-2.3 bring Triton 2.x, which lacks what the kernels use: the torch path."""
    import triton

    monkeypatch.setattr(triton, "__version__", "2.3.1")
    ti.available.cache_clear()
    try:
        assert not ti.available()
        monkeypatch.setattr(triton, "__version__", "%d.%d.0" % ti.MIN_TRITON)
        ti.available.cache_clear()
        assert ti.available()
    finally:
        ti.available.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_token_has_the_same_bits_alone_and_in_a_batch_through_the_token_kernel(
        rng, kernel, dtype):
    """The token kernel's float32 path is fmas alone (no tl.dot), so this holds under the
    interpreter too; its 16-bit path a tensor-core tile of one real row."""
    if kernel != "token" or (dtype != torch.float32 and DEVICE != "cuda"):
        pytest.skip("the token kernel's fma chain (the interpreter's tl.dot is numpy's)")
    layer = random_layer(rng, 6, 4, 16, 70, 4, dtype=dtype)
    full = _run(layer)
    for t in (0, 3, 5):
        one = {k: v[t:t + 1] if k not in ("packed_weights", "scale_bytes") else v
               for k, v in layer.items()}
        assert torch.equal(_run(one)[0], full[t]), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_token_kernels_combine_rounds_as_the_torch_path(rng, kernel, dtype):
    """Combined in the launch, each slot's product rounded to float32, times its weight,
    then added in slot order (no contraction): the bits of the products combined in torch."""
    if kernel != "token":
        pytest.skip("the token kernel's combine")
    layer = _on(random_layer(rng, 5, 4, 12, 70, 3, dtype=dtype))
    x, p, s = layer["latent_tokens"], layer["packed_weights"], layer["scale_bytes"]
    sel, mix, shared = (layer[k] for k in ("selected_experts", "mixture_weights",
                                           "shared_output"))
    products = ti.pair_products(x, p, s, sel).view(5, 4, 70)
    want = shared.to(torch.float32)
    for k in range(4):
        want = want + products[:, k] * mix[:, k:k + 1].to(torch.float32)
    got = ti.experts(x, p, s, sel, mix, shared, dtype)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    slots = ti.slots(x, p, s, sel)
    assert slots.dtype == dtype and torch.equal(slots, products.to(dtype))


def test_unchecked_bad_ids_give_nan_rows_and_leave_the_others(rng, kernel):
    """While a CUDA graph is captured the ids are not checked on the host: a bad id's
    token comes out NaN (its rows read from expert 0, never from outside the weights), and
    every other token has the bits of a checked call."""
    layer = random_layer(rng, 9, 3, 4, 40, 2)
    if kernel == "tile":  # more pairs per expert than the token kernel takes
        layer = random_layer(rng, 40, 3, 4, 40, 2)
    good = _run(layer)
    d = _on(layer)
    sel = d["selected_experts"].clone()
    sel[1, 2], sel[4, 0] = -1, 4
    got = ti.experts(d["latent_tokens"], d["packed_weights"], d["scale_bytes"], sel,
                     d["mixture_weights"], d["shared_output"], torch.float32, checked=False)
    assert got[[1, 4]].isnan().all()
    rest = [t for t in range(len(sel)) if t not in (1, 4)]
    if kernel == "tile" and DEVICE != "cuda":  # numpy's matmul follows the tile's rows
        assert_matches_reference(got[rest], {
            k: v if k in ("packed_weights", "scale_bytes") else v[rest]
            for k, v in layer.items()})
    else:
        assert torch.equal(got[rest], good[rest])
    slots = ti.slots(d["latent_tokens"], d["packed_weights"], d["scale_bytes"], sel,
                     checked=False)
    assert slots[1, 2].isnan().all() and slots[4, 0].isnan().all()
    assert not slots[1, :2].isnan().any() and not slots[rest].isnan().any()
    if DEVICE == "cpu":
        assert ti.check_ids(d["selected_experts"], 4)
        with pytest.raises(IndexError, match="expert id -1 is outside"):
            ti.check_ids(sel, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_triton_without_batched_dots_decodes_16_bit_latents_on_tiles(
        rng, kernel, monkeypatch, dtype):
    """Triton 3.2 miscompiles a batched tl.dot in a loop: there 16-bit decoding calls take
    the tile kernel (float32 ones keep the token kernel), with results within the bound."""
    if kernel != "token":
        pytest.skip("the token kernel's calls")
    import triton

    ran = []
    for name in ("token_kernel", "tile_kernel"):
        real = getattr(ti._Call, name)
        monkeypatch.setattr(ti._Call, name, lambda self, *a, _real=real, _name=name, **k: (
            ran.append(_name), _real(self, *a, **k))[1])
    layer = random_layer(rng, 3, 4, 8, 40, 2, dtype=dtype)
    monkeypatch.setattr(triton, "__version__", "3.2.0")
    ti.batched_dot.cache_clear()
    try:
        assert not ti.batched_dot() and ti.available()
        assert_matches_reference(_run(layer), layer)
        assert ran == (["tile_kernel"] if dtype == torch.bfloat16 else ["token_kernel"])
        monkeypatch.setattr(triton, "__version__", "%d.%d.0" % ti.MIN_TRITON_BATCHED_DOT)
        ti.batched_dot.cache_clear()
        ran.clear()
        assert_matches_reference(_run(layer), layer)
        assert ran == ["token_kernel"]
    finally:
        ti.batched_dot.cache_clear()


def test_no_slots_and_no_inputs_with_unchecked_ids(rng):
    """K = 0 (per-slot latents (T, 0, I) too) gives the shared output; I = 0 with an id
    outside [0, E) while unchecked gives that token NaN, the others their shared output."""
    layer = _on(random_layer(rng, 5, 2, 8, 24, 2))
    p, s, shared = layer["packed_weights"], layer["scale_bytes"], layer["shared_output"]
    sel0 = layer["selected_experts"][:, :0]
    mix0 = layer["mixture_weights"][:, :0]
    for x in (layer["latent_tokens"], torch.zeros(5, 0, 64, device=DEVICE)):
        assert torch.equal(ti.experts(x, p, s, sel0, mix0, shared, torch.float32), shared)
    sel = layer["selected_experts"].clone()
    sel[2, 1] = 8
    got = ti.experts(layer["latent_tokens"][:, :0], p[:, :, :0], s[:, :, :0], sel,
                     layer["mixture_weights"], shared, torch.float32, checked=False)
    assert got[2].isnan().all()
    assert torch.equal(got[[0, 1, 3, 4]], shared[[0, 1, 3, 4]])


def test_list_tables_are_kept_by_content_and_pinned_once_captured(rng, monkeypatch):
    """An expert list's device table: one per content, the least recently used dropped past
    the bound, never one a captured graph uses (the graph holds its address)."""
    monkeypatch.setattr(ti, "_TABLES", ti.collections.OrderedDict())
    monkeypatch.setattr(ti, "_PINNED", {})
    monkeypatch.setattr(ti, "_TABLES_KEPT", 2)
    dev = torch.device(DEVICE)
    a = ti._table(((1, 2, 3),), dev)
    assert ti._table(((1, 2, 3),), dev) is a and a.tolist() == [[1, 2, 3]]
    ti._table(((4, 5, 6),), dev)
    ti._table(((7, 8, 9),), dev)  # past the bound: the least recently used goes
    assert len(ti._TABLES) == 2 and (str(dev), ((1, 2, 3),)) not in ti._TABLES
    ti._PINNED[(str(dev), ((1, 2, 3),))] = a  # as a capture leaves it
    for i in range(5):
        ti._table(((i, i, i),), dev)
    assert ti._table(((1, 2, 3),), dev) is a and len(ti._TABLES) == 2
