"""llama.cpp's GGUF MXFP4 blocks, read in place (``scale_bytes=None``).

``block_mxfp4 { uint8_t e; uint8_t qs[16]; }``: 17 bytes per 32 weights, the E8M0 scale
byte first; element j is the low nibble of qs[j], element j + 16 its high nibble.  The
independent oracle is the ``gguf`` package (``gguf.quants.dequantize``), which decodes the
scale byte 255 as a finite number where mxfp4x's rule is NaN: values are compared where
the scale byte is not 255, and 255 is checked separately.
"""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import cpu as _cpu
from mxfp4x._core import cpu_impl as _cpu_impl
from mxfp4x._core import probes as _probes
from mxfp4x._core.format import E2M1_TABLE
from mxfp4x._core.reference import error_bound
from mxfp4x.nn import MXFP4Experts
from mxfp4x.testing.layers import acc_name, dtype_name

gguf = pytest.importorskip("gguf")

BLOCK = 17
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
RUNNABLE = set(_cpu.runnable_isas())
# (backend, isa): the compiled kernels of every ISA, and the torch backend once
ENGINES = [pytest.param(("cpu", isa), id=f"cpu-{isa}", marks=() if isa in RUNNABLE else
                        pytest.mark.skip(reason=f"this CPU cannot run {isa}"))
           for isa in _cpu.compiled_isas()] + [pytest.param(("torch", None), id="torch")]
# the largest scale byte whose products and sums stay finite in the result's dtype (the
# oracle decodes in float32, so 252 at most: 6 * 2^125 < FLT_MAX)
MAX_SCALE = {torch.float16: 130, torch.bfloat16: 200, torch.float32: 200,
             torch.float64: 252}


# ---- inputs and the oracle --------------------------------------------------------------

def gguf_blocks(rng, n_experts, d_out, n_groups, max_scale=200):
    """Random GGUF blocks (E, O, G, 17): fresh random bytes; each row a base scale byte
    (mostly near 127, some rows at 0 (2^-127: subnormal weights), some up to max_scale)
    jittered per group, and a few groups with scale byte 0 inside other rows."""
    blocks = rng.integers(0, 256, (n_experts, d_out, n_groups, BLOCK), dtype=np.uint8)
    kind = rng.integers(0, 8, (n_experts, d_out, 1))
    base = np.where(kind == 0, 0, np.where(kind == 1, rng.integers(0, max_scale + 1,
                                                                   kind.shape), 127))
    scales = base + rng.integers(-4, 5, (n_experts, d_out, n_groups))
    scales = np.where(rng.random(scales.shape) < 0.05, 0, scales)
    blocks[..., 0] = np.clip(scales, 0, max_scale)
    blocks[-1, -1, :, 0] = 0  # always one row of subnormal weights ...
    if n_experts * d_out > 1:
        blocks[0, 0, 0, 0] = 127  # ... and one group at scale 1
    return blocks


def oracle(blocks):
    """(E, O, G, 17) blocks -> (E, O, 32 G) float64 weights through gguf.quants (float32
    there, exact for scale bytes up to 252), NaN where the scale byte is 255 (our rule)."""
    e, o, g, _ = blocks.shape
    with np.errstate(over="ignore"):  # scale bytes 253, 254 overflow float32 there
        w = gguf.quants.dequantize(np.ascontiguousarray(blocks).reshape(e * o, g * BLOCK),
                                   gguf.GGMLQuantizationType.MXFP4).astype(np.float64)
    w = w.reshape(e, o, g, 32)
    w[blocks[..., 0] == 255] = np.nan
    return w.reshape(e, o, g * 32)


def to_safetensors(blocks):
    """The same matrices in gpt-oss's arrangement: packed (E, O, G, 16) with byte j holding
    elements 2j (low) and 2j+1 (high), and the scale bytes (E, O, G)."""
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # elements 0..31
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed), np.ascontiguousarray(blocks[..., 0])


def layer(rng, n_tokens, top_k, blocks, dtype, per_slot_latents=False):
    n_experts, d_out, n_groups, _ = blocks.shape
    d_in = 32 * n_groups
    shape = (n_tokens, top_k, d_in) if per_slot_latents else (n_tokens, d_in)
    return dict(latent_tokens=torch.from_numpy(rng.standard_normal(shape)).to(dtype),
                packed_weights=torch.from_numpy(blocks), scale_bytes=None,
                selected_experts=torch.from_numpy(rng.integers(0, n_experts,
                                                               (n_tokens, top_k))),
                mixture_weights=torch.from_numpy(rng.random((n_tokens, top_k))).to(dtype),
                shared_output=torch.from_numpy(rng.standard_normal((n_tokens, d_out))).to(dtype))


def _np64(t):
    return t.detach().double().numpy()


def forward_reference(lay, weights):
    """(float64 reference, bound) of mxfp4_experts for the layer, W from the oracle."""
    x, sel = _np64(lay["latent_tokens"]), lay["selected_experts"].numpy()
    mix, shared = _np64(lay["mixture_weights"]), _np64(lay["shared_output"])
    ref, mag = shared.copy(), np.abs(shared)
    with np.errstate(invalid="ignore", over="ignore"):
        for k in range(sel.shape[1]):
            xk = x[:, k] if x.ndim == 3 else x
            w = weights[sel[:, k]]
            ref += mix[:, k, None] * np.einsum("toi,ti->to", w, xk)
            mag += np.abs(mix[:, k, None]) * np.einsum("toi,ti->to", np.abs(w), np.abs(xk))
    out = lay["latent_tokens"].dtype
    bound = error_bound(mag, x.shape[-1] + sel.shape[1] + 2, acc_name(out), ref,
                        dtype_name(out))
    return ref, bound


def assert_within(got, ref, bound):
    got = got.detach().double().numpy()
    assert got.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    err = np.abs(got[ok] - ref[ok])
    worst = np.argmax(err - bound[ok]) if err.size else 0
    assert np.all(err <= bound[ok]), (f"error {err[worst]:.3g} > bound {bound[ok][worst]:.3g}"
                                      f" (reference {ref[ok][worst]:.6g})")


def listed(blocks, flat=False):
    """Each expert in its own allocation, (O, G, 17) or (O, G*17)."""
    return [torch.from_numpy(blocks[e].copy()).flatten(1) if flat else
            torch.from_numpy(blocks[e].copy()) for e in range(blocks.shape[0])]


# ---- decode: every byte x every scale byte ------------------------------------------------

@pytest.mark.parametrize("compute", ["float32", "float64"])
def test_decode_matches_gguf_bit_for_bit(isa, compute):
    """All 256 byte values x all 256 scale bytes through each ISA's decode kernel (and the
    float64 path's): gguf's values exactly where the scale byte is not 255, NaN where it
    is; and the same bits as the matrix converted to the gpt-oss arrangement.  (Code 8 is
    -0.0 here, +0.0 in ggml's table: zeros compare by value, and their signs by the
    code.)"""
    blocks = np.empty((256, 16, BLOCK), np.uint8)  # row s: bytes 0..255, all scale s
    blocks[..., 0] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[..., 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    got = _probes.decode_rows(blocks, None, isa=isa, compute=compute)
    want = oracle(blocks[None])[0]
    finite_scale = np.arange(256) != 255
    codes = np.concatenate([blocks[..., 1:] & 0xF, blocks[..., 1:] >> 4], -1).reshape(256, -1)
    zero = want == 0
    assert (got[zero] == 0).all()
    np.testing.assert_array_equal(np.signbit(got[zero]), codes[zero] == 8)
    want = np.where(zero, got, want)  # (the signs of zeros are checked above)
    if compute == "float32":
        np.testing.assert_array_equal(got[finite_scale].view(np.uint32),
                                      want[finite_scale].astype(np.float32).view(np.uint32))
    else:
        # exact binary64 values; the float32 oracle overflows only for scale bytes 253, 254
        exact = np.isfinite(want)
        assert exact[:253].all() and not exact[253:255].all()
        np.testing.assert_array_equal(got[exact], want[exact])
        big = E2M1_TABLE[codes[253:255]] * np.ldexp(1.0, np.arange(253, 255) - 127)[:, None]
        np.testing.assert_array_equal(got[253:255], big)
    assert np.isnan(got[255]).all()
    assert np.abs(got[0][got[0] != 0]).min() == 2.0 ** -128  # 0.5 * 2^-127, not flushed
    packed, scales = to_safetensors(blocks)
    same = _probes.decode_rows(packed, scales, isa=isa, compute=compute)
    np.testing.assert_array_equal(got.view(np.uint64 if compute == "float64" else np.uint32),
                                  same.view(np.uint64 if compute == "float64" else np.uint32))


def test_decode_rejects_a_wrong_block_width():
    with pytest.raises(ValueError, match=r"\(R, G, 17\) and None"):
        _probes.decode_rows(np.zeros((2, 3, 16), np.uint8), None)


# ---- the product against the oracle -----------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 4, 70])
def test_matches_gguf_reference(rng, engine, dtype, n_tokens):
    """Stacked GGUF blocks, odd sizes (O = 37, G = 3), gemv (T = 1..4) and panel (T = 70)
    paths, every latent dtype, against the float64 product of gguf's decoded weights."""
    backend, isa = engine
    blocks = gguf_blocks(rng, 5, 37, 3, MAX_SCALE[dtype])
    lay = layer(rng, n_tokens, 2, blocks, dtype)
    got = mxfp4x.mxfp4_experts(**lay, backend=backend, isa=isa)
    assert got.dtype == dtype and got.shape == (n_tokens, 37)
    ref, bound = forward_reference(lay, oracle(blocks))
    assert_within(got, ref, bound)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("flat", [False, True], ids=["OG17", "OGx17"])
@pytest.mark.parametrize("n_tokens", [3, 70])
def test_list_form_is_bit_identical_to_stacked(rng, engine, flat, n_tokens):
    backend, isa = engine
    blocks = gguf_blocks(rng, 4, 37, 3)
    lay = layer(rng, n_tokens, 3, blocks, torch.float32)
    lay["selected_experts"][0, 1] = lay["selected_experts"][0, 0]  # a repeated expert
    want = mxfp4x.mxfp4_experts(**lay, backend=backend, isa=isa)
    got = mxfp4x.mxfp4_experts(**dict(lay, packed_weights=listed(blocks, flat)),
                               backend=backend, isa=isa)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert_within(got, *forward_reference(lay, oracle(blocks)))
    slots = mxfp4x.mxfp4_experts_slots(lay["latent_tokens"], listed(blocks, flat), None,
                                       lay["selected_experts"], backend=backend, isa=isa)
    assert torch.equal(slots, mxfp4x.mxfp4_experts_slots(
        lay["latent_tokens"], lay["packed_weights"], None, lay["selected_experts"],
        backend=backend, isa=isa))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_gguf_and_safetensors_forms_agree(rng, engine, dtype):
    """The same matrices in the two arrangements: each within the bound of the float64
    reference, so within twice the bound of each other (not bit for bit: the kernels'
    lanes hold different elements)."""
    backend, isa = engine
    blocks = gguf_blocks(rng, 3, 41, 5, MAX_SCALE[dtype])
    packed, scales = to_safetensors(blocks)
    for n_tokens in (1, 4, 70):
        lay = layer(rng, n_tokens, 2, blocks, dtype)
        ref, bound = forward_reference(lay, oracle(blocks))
        a = mxfp4x.mxfp4_experts(**lay, backend=backend, isa=isa)
        b = mxfp4x.mxfp4_experts(**dict(lay, packed_weights=torch.from_numpy(packed),
                                        scale_bytes=torch.from_numpy(scales)),
                                 backend=backend, isa=isa)
        assert_within(a, ref, bound)
        assert_within(b, ref, bound)
        assert torch.all((a.double() - b.double()).abs() <= torch.from_numpy(2 * bound))


@pytest.mark.parametrize("engine", ENGINES)
def test_per_slot_latents(rng, engine):
    backend, isa = engine
    blocks = gguf_blocks(rng, 4, 29, 2)
    lay = layer(rng, 9, 3, blocks, torch.float32, per_slot_latents=True)
    got = mxfp4x.mxfp4_experts(**lay, backend=backend, isa=isa)
    assert_within(got, *forward_reference(lay, oracle(blocks)))


def test_no_tokens_and_one_group(rng, isa):
    blocks = gguf_blocks(rng, 2, 1, 1)
    lay = layer(rng, 0, 2, blocks, torch.float32)
    assert mxfp4x.mxfp4_experts(**lay, isa=isa).shape == (0, 1)
    lay = layer(rng, 6, 1, blocks, torch.float32)
    assert_within(mxfp4x.mxfp4_experts(**lay, isa=isa), *forward_reference(lay, oracle(blocks)))


# ---- determinism within the GGUF arrangement ------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=dtype_name)
def test_bit_identical_across_threads_and_batches(rng, isa, dtype):
    """Any thread count, any batch a token sits in: the same bits (gemv for a few tokens,
    panels for many: 300 tokens give every expert more than any ISA's crossover)."""
    blocks = gguf_blocks(rng, 3, 101, 4)
    lay = layer(rng, 300, 2, blocks, dtype)
    runs = [mxfp4x.mxfp4_experts(**lay, isa=isa, num_threads=n) for n in (1, 2, 3)]
    bits = torch.int64 if dtype == torch.float64 else (
        torch.int32 if dtype == torch.float32 else torch.int16)
    for r in runs[1:]:
        assert torch.equal(r.view(bits), runs[0].view(bits))
    for t0, t1 in ((0, 1), (7, 9), (20, 24), (100, 300)):
        part = {k: (v[t0:t1] if isinstance(v, torch.Tensor) and v.dim() and
                    k not in ("packed_weights",) else v) for k, v in lay.items()}
        got = mxfp4x.mxfp4_experts(**part, isa=isa, num_threads=2)
        assert torch.equal(got.view(bits), runs[0][t0:t1].view(bits)), (t0, t1)
    assert_within(runs[0], *forward_reference(lay, oracle(blocks)))


# ---- the transposed product and autograd ----------------------------------------------

def grad_reference(lay, weights, grad):
    """(float64 d loss / d latents, bound) for loss = sum(y * grad)."""
    x, sel = _np64(lay["latent_tokens"]), lay["selected_experts"].numpy()
    mix, g = _np64(lay["mixture_weights"]), _np64(grad)
    ref, mag = np.zeros_like(x), np.zeros_like(x)
    for k in range(sel.shape[1]):
        w = weights[sel[:, k]]
        ref += mix[:, k, None] * np.einsum("toi,to->ti", w, g)
        mag += np.abs(mix[:, k, None]) * np.einsum("toi,to->ti", np.abs(w), np.abs(g))
    out = lay["latent_tokens"].dtype
    n_terms = sel.shape[1] * (weights.shape[1] + 2) + 2
    return ref, error_bound(mag, n_terms, acc_name(out), ref, dtype_name(out))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("n_tokens", [2, 70])
def test_gradients_through_gguf_blocks(rng, engine, dtype, n_tokens):
    """The gradient of the latents (the transposed product, which undoes the GGUF
    permutation; 11 groups span two of its column tasks) and of the mixture weights,
    against float64."""
    backend, isa = engine
    blocks = gguf_blocks(rng, 4, 37, 11, MAX_SCALE[dtype])
    lay = layer(rng, n_tokens, 2, blocks, dtype)
    x = lay["latent_tokens"].clone().requires_grad_(True)
    mix = lay["mixture_weights"].clone().requires_grad_(True)
    y = mxfp4x.mxfp4_experts(**dict(lay, latent_tokens=x, mixture_weights=mix),
                             backend=backend, isa=isa)
    grad = torch.from_numpy(rng.standard_normal(y.shape)).to(dtype)
    y.backward(grad)
    weights = oracle(blocks)
    assert_within(x.grad, *grad_reference(lay, weights, grad))
    # d/dp_tk = g_t . W x_t
    xs, sel, g = _np64(lay["latent_tokens"]), lay["selected_experts"].numpy(), _np64(grad)
    wx = np.einsum("tkoi,ti->tko", weights[sel], xs)
    ref = np.einsum("tko,to->tk", wx, g)
    mag = np.einsum("tkoi,ti,to->tk", np.abs(weights[sel]), np.abs(xs), np.abs(g))
    assert_within(mix.grad, ref, error_bound(mag, xs.shape[1] + weights.shape[1] + 2,
                                             acc_name(dtype), ref, dtype_name(dtype)))


@pytest.mark.parametrize("listed_form", [False, True], ids=["stacked", "list"])
def test_grad_latents_op_and_gradcheck(rng, isa, listed_form):
    blocks = gguf_blocks(rng, 3, 23, 2)
    lay = layer(rng, 5, 2, blocks, torch.float64)
    packed = listed(blocks) if listed_form else lay["packed_weights"]
    # gradcheck's finite differences need moderate weights: scales near 1
    moderate = blocks.copy()
    moderate[..., 0] = rng.integers(124, 131, moderate.shape[:3])
    moderate_packed = listed(moderate) if listed_form else torch.from_numpy(moderate)
    op = torch.ops.mxfp4x.mxfp4_experts_grad_latents_list if listed_form else \
        torch.ops.mxfp4x.mxfp4_experts_grad_latents
    grad = torch.from_numpy(rng.standard_normal((5, 23)))
    got = op(grad, packed, None, lay["selected_experts"], lay["mixture_weights"],
             lay["latent_tokens"], 2, isa)
    assert_within(got, *grad_reference(lay, oracle(blocks), grad))

    def f(x, p, s):
        return mxfp4x.mxfp4_experts(x, moderate_packed, None, lay["selected_experts"], p, s,
                                    isa=isa)

    assert torch.autograd.gradcheck(f, tuple(lay[k].clone().requires_grad_(True) for k in
                                             ("latent_tokens", "mixture_weights",
                                              "shared_output")))


def test_ops_opcheck_and_compile(rng):
    blocks = gguf_blocks(rng, 3, 24, 2)
    lay = layer(rng, 5, 2, blocks, torch.float32)
    sel = lay["selected_experts"]
    for packed, suffix in ((lay["packed_weights"], ""), (listed(blocks), "_list")):
        args = (lay["latent_tokens"], packed, None, sel, lay["mixture_weights"],
                lay["shared_output"], 1)
        torch.library.opcheck(getattr(torch.ops.mxfp4x, f"mxfp4_experts{suffix}").default,
                              args)
        torch.library.opcheck(
            getattr(torch.ops.mxfp4x, f"mxfp4_experts_slots{suffix}").default,
            (args[0], packed, None, sel, 1))
        torch.library.opcheck(
            getattr(torch.ops.mxfp4x, f"mxfp4_experts_grad_latents{suffix}").default,
            (torch.randn(5, 24), packed, None, sel, args[4], args[0], 1))
        compiled = torch.compile(lambda x, mix, shared, p=packed: mxfp4x.mxfp4_experts(
            x, p, None, sel, mix, shared), fullgraph=True)
        assert torch.equal(compiled(args[0], args[4], args[5]), mxfp4x.mxfp4_experts(**lay))


# ---- the NaN scale byte ----------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n_tokens", [2, 70])
def test_scale_byte_255_gives_nan_rows(rng, engine, n_tokens):
    """Byte 255 is NaN here (ggml decodes it as a number): a row with one such group is NaN
    for every token that selects its expert; every other row matches the reference."""
    backend, isa = engine
    blocks = gguf_blocks(rng, 3, 37, 3)
    blocks[1, 5, 2, 0] = 255
    blocks[2, [0, 36], 0, 0] = 255
    lay = layer(rng, n_tokens, 2, blocks, torch.float32)
    lay["selected_experts"][0] = torch.tensor([1, 2])
    lay["selected_experts"][1] = torch.tensor([0, 0])  # neither
    got = mxfp4x.mxfp4_experts(**lay, backend=backend, isa=isa)
    ref, bound = forward_reference(lay, oracle(blocks))
    sel = lay["selected_experts"]
    uses = {e: (sel == e).any(1).numpy() for e in (1, 2)}
    assert np.isnan(ref[uses[1], 5]).all() and np.isnan(ref[uses[2]][:, [0, 36]]).all()
    assert np.isfinite(ref[~uses[1], 5]).all() and np.isfinite(ref[~uses[2]][:, [0, 36]]).all()
    assert np.isfinite(np.delete(ref, [0, 5, 36], axis=1)).all()
    assert_within(got, ref, bound)  # NaN exactly where the reference has it


# ---- read in place ----------------------------------------------------------------------

def test_memory_mapped_blocks_are_read_in_place(rng, tmp_path, isa):
    """A view of a file (a numpy memmap, read-only; a torch.from_file tensor at an odd
    offset, as a tensor's data inside a GGUF file): the driver's table points into the
    mapping, the results equal those of the blocks in memory, and the file is unchanged."""
    blocks = gguf_blocks(rng, 3, 37, 3)
    header = 37
    path = tmp_path / "experts.gguf-like"
    path.write_bytes(b"H" * header + blocks.tobytes())
    before = path.read_bytes()
    lay = layer(rng, 6, 2, blocks, torch.float32)
    want = mxfp4x.mxfp4_experts(**lay, isa=isa)

    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=header, shape=blocks.shape)
    got = mxfp4x.mxfp4_experts(**dict(lay, packed_weights=mm), isa=isa)
    assert torch.equal(got, want)
    from mxfp4x._core.coerce import as_tensor
    t = as_tensor("packed_weights", mm)
    assert t.data_ptr() == mm.ctypes.data
    assert _cpu_impl.experts_of(t, None).owner.data_ptr() == mm.ctypes.data

    mapped = torch.from_file(str(path), shared=False, size=header + blocks.size,
                             dtype=torch.uint8)
    view = mapped[header:].view(blocks.shape)
    assert view.data_ptr() % 2 == 1  # an unaligned tensor, read where it lies
    ex = _cpu_impl.experts_of(view, None)
    assert ex.owner.data_ptr() == view.data_ptr() and ex.form == "gguf"
    assert torch.equal(mxfp4x.mxfp4_experts(**dict(lay, packed_weights=view), isa=isa), want)
    per_expert = list(view.unbind(0))
    assert torch.equal(mxfp4x.mxfp4_experts(**dict(lay, packed_weights=per_expert), isa=isa),
                       want)
    assert _cpu_impl.experts_of(per_expert, None).owner[1] == []  # nothing copied
    assert path.read_bytes() == before


def test_module_from_gguf_blocks(rng, isa):
    blocks = gguf_blocks(rng, 4, 37, 3)
    module = MXFP4Experts.from_packed(torch.from_numpy(blocks), None)
    assert module.scale_bytes is None and "d_in=96" in repr(module)
    lay = layer(rng, 7, 2, blocks, torch.float32)
    got = module(lay["latent_tokens"], lay["selected_experts"], lay["mixture_weights"],
                 lay["shared_output"])
    assert torch.equal(got, mxfp4x.mxfp4_experts(**lay))
    assert_within(got, *forward_reference(lay, oracle(blocks)))
    with pytest.raises(ValueError, match=r"expected \(E, d_out, G, 17\) GGUF blocks"):
        MXFP4Experts.from_packed(torch.from_numpy(blocks[..., :16]), None)
    # an expert-parallel module on GGUF blocks runs (tests/distributed); it needs its range
    with pytest.raises(ValueError, match="expert_range: an expert-parallel module"):
        MXFP4Experts.from_packed(torch.from_numpy(blocks), None, group=object())


# ---- errors that name the argument -----------------------------------------------------

@pytest.mark.parametrize("bad,exc,match", [
    (lambda p, s: (p[..., :16], None), ValueError,
     r"packed_weights: scale_bytes is None, so packed_weights holds GGUF .*\(n_experts, "
     r"d_out, 3, 17\).*16 bytes per group: pass their scale_bytes"),
    (lambda p, s: (p, s), ValueError,
     r"packed_weights: expected shape \(n_experts, d_out, 3, 16\).*GGUF block_mxfp4 blocks "
     r"are passed with scale_bytes=None"),
    (lambda p, s: (p[:, :, :2], None), ValueError, r"packed_weights: .*\(n_experts, d_out, 3, "
     r"17\) for d_in = 96, got \(4, 8, 2, 17\)"),
    (lambda p, s: (p[0], None), ValueError, r"packed_weights: expected a 4-D tensor"),
    (lambda p, s: (p.float(), None), TypeError, r"packed_weights: expected an integer"),
    (lambda p, s: (list(p[:3]) + [p[3, :, :2]], None), ValueError,
     r"packed_weights\[3\]: scale_bytes is None, so each entry holds GGUF"),
    (lambda p, s: (list(p[..., :16]), None), ValueError,
     r"packed_weights\[0\]: .*16 bytes per group: pass their scale_bytes"),
    (lambda p, s: (list(p), [None] * 4), ValueError,
     r"scale_bytes\[0\]: None in a list: GGUF blocks are passed with scale_bytes=None"),
    (lambda p, s: (list(p), list(s)), ValueError,
     r"packed_weights\[0\]: expected shape \(8, 3, 16\).*scale_bytes=None"),
], ids=["16-wide", "17-wide-with-scales", "groups", "rank", "float", "list-entry",
        "list-16-wide", "list-of-none", "list-17-wide-with-scales"])
def test_errors_name_the_argument(rng, bad, exc, match):
    blocks = gguf_blocks(rng, 4, 8, 3)
    lay = layer(rng, 3, 2, blocks, torch.float32)
    p, s = bad(lay["packed_weights"], torch.from_numpy(blocks[..., 0].copy()))
    with pytest.raises(exc, match=match):
        mxfp4x.mxfp4_experts(**dict(lay, packed_weights=p, scale_bytes=s))


def test_experts_table_checks_the_gguf_form():
    with pytest.raises(ValueError, match="form: expected 'split' or 'gguf'"):
        _cpu.Experts(np.array([[2, 1, 51, 51]], np.int64), d_out=1, n_groups=3, owner=None,
                     form="ggml")
    with pytest.raises(ValueError, match="packed address one past the scale address"):
        _cpu.Experts(np.array([[1, 1, 51, 51]], np.int64), d_out=1, n_groups=3, owner=None,
                     form="gguf")
    with pytest.raises(ValueError, match="equal row strides"):
        _cpu.Experts(np.array([[2, 1, 48, 3]], np.int64), d_out=1, n_groups=3, owner=None,
                     form="gguf")


def test_gguf_blocks_of_is_the_inverse_of_the_conversion(rng):
    """mxfp4x.testing's converter (used by the benchmark) against this file's own."""
    from mxfp4x.testing.layers import gguf_blocks_of
    blocks = gguf_blocks(rng, 2, 5, 3)
    packed, scales = to_safetensors(blocks)
    np.testing.assert_array_equal(gguf_blocks_of(packed, scales), blocks)
