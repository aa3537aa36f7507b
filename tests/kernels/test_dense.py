"""The dense bfloat16 product (mxfp4x._core.dense.linear, the kernels' dense_bf16): against a
float64 reference within the documented bound on every runnable ISA, at widths off every
lane count; bit-identical across thread counts, batches and row splits; torch's own
F.linear wherever it does not apply; inputs untouched."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mxfp4x._core import cpu as _cpu
from mxfp4x._core import dense as _dense
from mxfp4x._core.reference import error_bound

ISAS = _cpu.runnable_isas()


def bf16_weight(rng, rows, cols):
    w = torch.from_numpy(rng.standard_normal((rows, cols)) * 0.7).bfloat16()
    w.view(-1)[::11] = 0.0                                  # zeros
    w.view(-1)[5::17] = torch.tensor(1e-39).bfloat16()      # bf16 subnormals
    return w


def reference(x, w):
    xd, wd = x.double().numpy(), w.double().numpy()
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


def run(x, w, isa=None, threads=1):
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    _cpu.dense_bf16(x.numpy(), w.view(torch.uint16).numpy(), out, isa=isa, n_threads=threads)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,cols,tokens", [(1, 1, 1), (5, 7, 3), (67, 100, 4),
                                              (130, 257, 2), (9, 1031, 5), (64, 16, 1)])
def test_against_float64(isa, rows, cols, tokens, rng):
    w = bf16_weight(rng, rows, cols)
    x = torch.from_numpy(rng.standard_normal((tokens, cols))).float()
    got = run(x, w, isa)
    ref, mag = reference(x, w)
    bound = error_bound(mag, cols)
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / (bound + 1e-300))


@pytest.mark.parametrize("isa", ISAS)
def test_bits_do_not_depend_on_threads_batch_or_rows(isa, rng):
    w = bf16_weight(rng, 203, 333)
    x = torch.from_numpy(rng.standard_normal((7, 333))).float()
    full = run(x, w, isa, threads=1)
    assert np.array_equal(run(x, w, isa, threads=2).view(np.uint32), full.view(np.uint32))
    for t in range(7):
        one = run(x[t:t + 1].contiguous(), w, isa)
        assert np.array_equal(one[0].view(np.uint32), full[t].view(np.uint32))
    top = run(x, w[:100].contiguous(), isa)       # the same rows in another split
    assert np.array_equal(top.view(np.uint32), full[:, :100].view(np.uint32))


@pytest.mark.parametrize("isa", ISAS)
def test_runs_of_tiles_per_task_give_the_same_bits(isa, rng):
    """A matrix of 28 tiles (the last short): runs of 7, of 3 or 4 and of 2 or 3
    consecutive tiles on 1, 2 and 3 threads, with the bias and a bf16 result, the same
    bits as each row computed alone, within the float64 bound."""
    rows, cols = 64 * 27 + 13, 96
    w = bf16_weight(rng, rows, cols)
    x = torch.from_numpy(rng.standard_normal((2, cols))).bfloat16()
    b = torch.from_numpy(rng.standard_normal(rows)).float()
    xb, wb = x.view(torch.uint16).numpy(), w.view(torch.uint16).numpy()
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(2, rows, dtype=torch.bfloat16)
        _cpu.dense_bf16(xb, wb, _dense._bits(out), isa=isa, n_threads=threads, bias=b.numpy(),
                        out_dtype="bfloat16")
        outs.append(out)
    sums = torch.empty(2, rows)
    for r0 in range(0, rows, 100):  # the rows in other splits, one thread
        part = np.empty((2, min(rows, r0 + 100) - r0), np.float32)
        _cpu.dense_bf16(xb, wb[r0:r0 + 100].copy(), part, isa=isa)
        sums[:, r0:r0 + 100] = torch.from_numpy(part)
    want = (sums + b).bfloat16()
    for out in outs:
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    ref, mag = reference(x.float(), w)
    assert np.all(np.abs(sums.numpy() - ref) <= error_bound(mag, cols))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,cols", [(1, 1), (9, 31), (17, 32), (70, 33), (5, 1031),
                                       (66, 7168)])
def test_bf16_tokens_give_the_bits_of_their_float32_widening(isa, rows, cols, rng):
    """bf16 tokens passed as their bits (dense_bf16x where the ISA has it, else widened in
    the wrapper) against the same tokens widened to float32, bit for bit, at 1-6 tokens
    (every blocking of rows and tokens), and each token alone as in the batch."""
    w = bf16_weight(rng, rows, cols)
    xb = torch.from_numpy(rng.standard_normal((6, cols)) * 3).bfloat16()
    xb.view(-1)[3::13] = torch.tensor(-1e-39).bfloat16()    # subnormal tokens
    xb.view(-1)[7::29] = 0.0
    for n in range(1, 7):
        bits = np.empty((n, rows), np.float32)
        _cpu.dense_bf16(xb[:n].view(torch.uint16).numpy(), w.view(torch.uint16).numpy(), bits,
                        isa=isa)
        wide = run(xb[:n].float(), w, isa)
        assert np.array_equal(bits.view(np.uint32), wide.view(np.uint32)), n
        ref, mag = reference(xb[:n].float(), w)
        assert np.all(np.abs(bits - ref) <= error_bound(mag, cols))
    for t in range(6):
        one = np.empty((1, rows), np.float32)
        _cpu.dense_bf16(xb[t:t + 1].view(torch.uint16).numpy(), w.view(torch.uint16).numpy(),
                        one, isa=isa, n_threads=2)
        assert np.array_equal(one[0].view(np.uint32), bits[t].view(np.uint32))


@pytest.mark.parametrize("isa", ISAS)
def test_rows_anywhere_in_a_line_give_the_same_bits(isa, rng):
    """A weight that starts at any byte of a cache line (a checkpoint's tensors start
    wherever the header and the tensors before them end; the bf16 paths join 64-byte
    aligned loads), odd addresses included, 1-4 tokens, rows that share their offset in a
    line (widths of 32, 64, 96) and rows that do not: the bits of the same weight aligned,
    and of the tokens widened to float32."""
    for cols, n_tok in ((7, 1), (32, 4), (45, 2), (64, 3), (100, 1), (333, 4), (96, 2),
                        (333, 2)):
        w = bf16_weight(rng, 9, cols).view(torch.uint16).numpy()
        x = torch.from_numpy(rng.standard_normal((n_tok, cols))).bfloat16().view(torch.uint16)
        want = np.empty((n_tok, 9), np.float32)
        _cpu.dense_bf16(x.numpy(), np.ascontiguousarray(w), want, isa=isa)
        buf = np.zeros(w.nbytes + 128, np.uint8)
        lead = (-buf.ctypes.data) % 64
        for at in range(64):
            placed = np.frombuffer(buf, np.uint16, count=w.size,
                                   offset=lead + at).reshape(w.shape)
            placed[...] = w
            got = np.full((n_tok, 9), np.nan, np.float32)
            _cpu.dense_bf16(x.numpy(), placed, got, isa=isa)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (cols, at)
            wide = np.empty((n_tok, 9), np.float32)
            _cpu.dense_bf16((x.numpy().astype(np.uint32) << 16).view(np.float32), placed, wide,
                            isa=isa)
            assert np.array_equal(wide.view(np.uint32), want.view(np.uint32)), (cols, at)


def test_linear_reads_bf16_tokens_as_they_are(rng):
    """_dense.linear of bf16 tokens: out_dtype float32 gives the float32-widened product
    unrounded (the router's scores), the default rounds it to bf16 once."""
    w = bf16_weight(rng, 40, 96)
    x = torch.from_numpy(rng.standard_normal((3, 96))).bfloat16()
    wide = _dense.linear(x, w, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, _dense.linear(x.float(), w))
    assert torch.equal(_dense.linear(x, w), wide.bfloat16())
    with pytest.raises(ValueError, match="out_dtype"):
        _dense.linear(x, w, out_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_matches_f_linear_within_the_bound(dtype, rng):
    w = bf16_weight(rng, 96, 160)
    x = torch.from_numpy(rng.standard_normal((2, 2, 160))).to(dtype)  # leading dims kept
    x0, w0 = x.clone(), w.clone()
    assert _dense.takes(x, w)
    got = _dense.linear(x, w)
    assert got.dtype == dtype and got.shape == (2, 2, 96)
    assert torch.equal(x, x0) and torch.equal(w, w0)
    ref, mag = reference(x.reshape(-1, 160).float(), w)
    u_out = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dtype]
    bound = error_bound(mag, 160) + u_out * np.abs(ref) + 1e-38
    err = np.abs(got.reshape(-1, 96).double().numpy() - ref)
    assert np.all(err <= bound)
    # the same tokens one at a time: the same bits
    for t in range(2):
        assert torch.equal(_dense.linear(x[1, t:t + 1], w)[0], got[1, t])


def test_torch_wherever_it_does_not_apply(rng):
    w = bf16_weight(rng, 40, 64)
    many = torch.randn(_dense.MAX_TOKENS + 1, 64).bfloat16()
    assert not _dense.takes(many, w)
    assert torch.equal(_dense.linear(many, w), F.linear(many, w))
    half = torch.randn(2, 64).half()                          # another input dtype
    assert not _dense.takes(half, w)
    assert torch.equal(_dense.linear(half, w), F.linear(half, w.half()))
    wf = w.float()                                            # a float32 weight
    x = torch.randn(1, 64)
    assert not _dense.takes(x, wf)
    assert torch.equal(_dense.linear(x, wf), F.linear(x, wf))
    xg = torch.randn(1, 64, requires_grad=True)               # autograd: torch's
    assert not _dense.takes(xg, w)
    y = _dense.linear(xg, w)
    y.sum().backward()
    assert xg.grad is not None
    with torch.no_grad():
        assert _dense.takes(xg, w)


def test_bad_arrays_are_refused():
    w = np.zeros((4, 8), np.uint16)
    with pytest.raises(ValueError, match="x"):
        _cpu.dense_bf16(np.zeros((1, 7), np.float32), w, np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="out"):
        _cpu.dense_bf16(np.zeros((1, 8), np.float32), w, np.zeros((1, 5), np.float32))
    with pytest.raises(ValueError, match="x: expected float32 tokens or bfloat16 bits"):
        _cpu.dense_bf16(np.zeros((1, 8), np.int32), w, np.zeros((1, 4), np.float32))
    with pytest.raises(ValueError, match="out: expected a writable float32"):
        _cpu.dense_bf16(np.zeros((1, 8), np.uint16), w, np.zeros((1, 4), np.int32))


# ---- 5 to 32 bf16 tokens on the bf16 unit (dense_bf16(..., unit=True)) ----

UNIT_ISAS = [isa for isa in ISAS if _cpu.dense_unit(isa)]
needs_unit = pytest.mark.skipif(not UNIT_ISAS, reason="no entry with a dense bf16 unit "
                                "product runs on this CPU (AVX512-BF16)")


def _f32(bits):
    """bf16 bits (uint16 numpy) as float32 values, subnormals read as zero (the unit's
    inputs)."""
    v = (bits.astype(np.uint32) << 16).view(np.float32)
    return np.where(np.abs(v) < np.float32(2.0 ** -126), np.float32(0), v)


def _ftz(v):
    return np.where(np.abs(v) < np.float32(2.0 ** -126), np.float32(0), v).astype(np.float32)


def unit_emulated(x_bits, w_bits):
    """The unit kernel's arithmetic in numpy float32: per (row, token) 16 lanes, chunk by
    chunk acc + odd product, then + even product, each rounded and flushed where
    subnormal; then hsum16's tree (8 + 8, 4 + 4, 2 + 2, 1 + 1)."""
    d = x_bits.shape[1]
    pad = (-d) % 32
    x = np.pad(_f32(x_bits), ((0, 0), (0, pad)))
    w = np.pad(_f32(w_bits), ((0, 0), (0, pad)))
    m = (d + pad) // 32
    x = x.reshape(x.shape[0], 1, m, 16, 2)
    w = w.reshape(1, w.shape[0], m, 16, 2)
    prod = _ftz(x * w)                                   # exact where normal
    acc = np.zeros(prod.shape[:2] + (16,), np.float32)
    for c in range(m):
        acc = _ftz(acc + prod[:, :, c, :, 1])
        acc = _ftz(acc + prod[:, :, c, :, 0])
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]


def run_unit(x, w, isa, threads=1):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    _cpu.dense_bf16(x.view(torch.uint16).numpy(), w.view(torch.uint16).numpy(), out, isa=isa,
                    n_threads=threads, unit=True)
    return out


@needs_unit
@pytest.mark.parametrize("isa", UNIT_ISAS)
@pytest.mark.parametrize("rows,cols,tokens", [(1, 1, 5), (9, 31, 6), (67, 100, 7),
                                              (130, 257, 13), (5, 1031, 16), (64, 32, 8)])
def test_unit_against_float64_and_its_own_arithmetic(isa, rows, cols, tokens, rng):
    """Within the float32 bound of the float64 product (bf16 subnormal weights and tokens
    included: the unit reads them as zero), and bit for bit the unit's arithmetic as
    emulated in numpy on the normal values."""
    w = bf16_weight(rng, rows, cols)
    x = torch.from_numpy(rng.standard_normal((tokens, cols)) * 3).bfloat16()
    x.view(-1)[3::13] = torch.tensor(-1e-39).bfloat16()
    got = run_unit(x, w, isa)
    ref, mag = reference(x.float(), w)
    bound = error_bound(mag, cols) + cols * 2.0 ** -126 * 8
    assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)
    want = unit_emulated(x.view(torch.uint16).numpy(), w.view(torch.uint16).numpy())
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@needs_unit
@pytest.mark.parametrize("isa", UNIT_ISAS)
def test_unit_bits_do_not_depend_on_threads_batch_or_rows(isa, rng):
    w = bf16_weight(rng, 203, 333)
    x = torch.from_numpy(rng.standard_normal((_cpu.DENSE_UNIT_MAX_TOKENS, 333))).bfloat16()
    full = run_unit(x, w, isa)
    for threads in (2, 3):
        assert np.array_equal(run_unit(x, w, isa, threads).view(np.uint32), full.view(np.uint32))
    others = torch.from_numpy(rng.standard_normal((4, 333))).bfloat16()
    for t in (0, 5, 9, len(x) - 1):  # alone among 4 others, and in batches of 5 on
        one = run_unit(torch.cat([x[t:t + 1], others]), w, isa)
        assert np.array_equal(one[0].view(np.uint32), full[t].view(np.uint32)), t
    for n in (5, 6, 7, 8, 9, 13):  # one pass of two rows to 8, two of four rows past
        assert np.array_equal(run_unit(x[:n], w, isa).view(np.uint32),
                              full[:n].view(np.uint32)), n
    top = run_unit(x, w[:101].contiguous(), isa)   # the same rows in another split
    assert np.array_equal(top.view(np.uint32), full[:, :101].view(np.uint32))


def test_unit_refuses_what_it_cannot_take(rng):
    w = bf16_weight(rng, 4, 64)
    x = torch.randn(8, 64).bfloat16()
    out = np.empty((8, 4), np.float32)
    for isa in ISAS:
        if not _cpu.dense_unit(isa):
            with pytest.raises(ValueError, match="unit: the .* entry has no dense bf16 unit"):
                _cpu.dense_bf16(x.view(torch.uint16).numpy(), w.view(torch.uint16).numpy(),
                                out, isa=isa, unit=True)
    for isa in UNIT_ISAS:
        with pytest.raises(ValueError, match="unit: expected bfloat16 tokens"):
            _cpu.dense_bf16(x.float().numpy(), w.view(torch.uint16).numpy(), out, isa=isa,
                            unit=True)
        for n in (_cpu.DENSE_UNIT_MIN_TOKENS - 1, _cpu.DENSE_UNIT_MAX_TOKENS + 1):
            xn = torch.randn(n, 64).bfloat16()
            with pytest.raises(ValueError, match=f"x: expected {_cpu.DENSE_UNIT_MIN_TOKENS} to "
                               f"{_cpu.DENSE_UNIT_MAX_TOKENS} tokens on the unit"):
                _cpu.dense_bf16(xn.view(torch.uint16).numpy(), w.view(torch.uint16).numpy(),
                                np.empty((n, 4), np.float32), isa=isa, unit=True)


def test_linear_on_the_unit_where_asked(rng):
    """``unit=True``: bf16 tokens past MAX_TOKENS up to UNIT_MAX_TOKENS go to the unit where
    the default entry has it (its bits, the bias added in float32, one rounding), torch's
    F.linear elsewhere and past the range; ``unit=False`` keeps torch's."""
    w = bf16_weight(rng, 70, 96)
    b = torch.from_numpy(rng.standard_normal(70)).bfloat16()
    for n in (_dense.MAX_TOKENS, _dense.UNIT_MIN_TOKENS, 9, _dense.UNIT_MAX_TOKENS,
              _dense.UNIT_MAX_TOKENS + 1):
        x = torch.from_numpy(rng.standard_normal((1, n, 96))).bfloat16()
        got = _dense.linear(x, w, b, unit=True)
        assert got.shape == (1, n, 70) and got.dtype == torch.bfloat16
        on_unit = _dense.UNIT_MIN_TOKENS <= n <= _dense.UNIT_MAX_TOKENS and _cpu.dense_unit()
        assert _dense.takes(x, w, unit=True) == (on_unit or n <= _dense.MAX_TOKENS)
        if on_unit:
            want = (torch.from_numpy(run_unit(x[0], w, None)) + b.float()).bfloat16()
            assert torch.equal(got[0], want)
            assert not _dense.takes(x, w)          # unit=False: torch's
        elif n > _dense.MAX_TOKENS:
            assert torch.equal(got, F.linear(x, w, b))
    many = torch.randn(8, 96)                       # float32 tokens: torch's
    assert not _dense.takes(many, w, unit=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_bias_is_added_on_every_path(dtype, rng):
    """A bias in the input's dtype or another, on the kernels and on torch's path (too many
    tokens, a float32 weight): F.linear's result, the bias never dropped."""
    w = bf16_weight(rng, 24, 64)
    for bias_dtype in (torch.bfloat16, torch.float32):
        b = torch.from_numpy(rng.standard_normal(24) * 4).to(bias_dtype)
        for n in (1, _dense.MAX_TOKENS + 1, 40):
            x = torch.from_numpy(rng.standard_normal((n, 64))).to(dtype)
            got = _dense.linear(x, w, b)
            want = F.linear(x, w.to(dtype), b.to(dtype))
            ref, mag = reference(x.float(), w)
            ref = ref + b.double().numpy()
            bound = (error_bound(mag, 64) + 2.0 ** -7 * np.abs(ref) + 2.0 ** -7 * np.abs(
                b.double().numpy()) + 1e-30)
            assert np.all(np.abs(got.double().numpy() - ref) <= bound), (bias_dtype, n)
            if not _dense.takes(x, w):
                assert torch.equal(got, want), (bias_dtype, n)
            wf = w.float()                      # a float32 weight: torch's path
            assert torch.equal(_dense.linear(x, wf, b), F.linear(x, wf.to(dtype), b.to(dtype)))


@pytest.mark.parametrize("isa", ISAS)
def test_the_epilogue_adds_the_bias_and_rounds_once_in_the_tasks(isa, rng):
    """dense_bf16's bias and 16-bit out: the float32 sums plus the bias, rounded once,
    the same bits as the sums written out and finished by torch, at 1-16 tokens (the unit's
    too where the entry has one); more tokens are refused."""
    w = bf16_weight(rng, 131, 100)  # 131 rows: three tasks, the last one short
    wb = w.view(torch.uint16).numpy()
    for n in (1, 3, 5, 16):
        x = torch.from_numpy(rng.standard_normal((n, 100))).bfloat16()
        xb = x.view(torch.uint16).numpy()
        unit = n >= _cpu.DENSE_UNIT_MIN_TOKENS and _cpu.dense_unit(isa)
        if n >= _cpu.DENSE_UNIT_MIN_TOKENS and not unit:
            continue
        sums = torch.empty(n, 131)
        _cpu.dense_bf16(xb, wb, sums.numpy(), isa=isa, unit=unit, n_threads=2)
        for bias_dtype in (None, torch.float32, torch.bfloat16, torch.float16):
            b = None if bias_dtype is None else \
                torch.from_numpy(rng.standard_normal(131) * 8).to(bias_dtype)
            want = sums if b is None else sums + b.float()
            for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                out = torch.empty(n, 131, dtype=out_dtype)
                _cpu.dense_bf16(xb, wb, _dense._bits(out), isa=isa, unit=unit, n_threads=3,
                                bias=None if b is None else _dense._bits(b),
                                bias_dtype=_dense._C_DTYPES[b.dtype] if b is not None
                                else "float32", out_dtype=_dense._C_DTYPES[out_dtype])
                assert torch.equal(out, want.to(out_dtype)), (n, bias_dtype, out_dtype)
    x = torch.from_numpy(rng.standard_normal((17, 100))).bfloat16().view(torch.uint16).numpy()
    with pytest.raises(ValueError, match="at most 16 tokens"):
        _cpu.dense_bf16(x, wb, np.empty((17, 131), np.uint16), isa=isa, out_dtype="bfloat16")
    with pytest.raises(ValueError, match="bias"):
        _cpu.dense_bf16(x[:2], wb, np.empty((2, 131), np.float32), isa=isa,
                        bias=np.zeros(130, np.float32))


def test_linear_past_the_epilogue_finishes_in_torch(rng):
    """More tokens than the epilogue takes (max_tokens raised past 16): the sums come back
    in float32 and the bias and the rounding are torch's, the same bits."""
    w = bf16_weight(rng, 40, 64)
    b = torch.from_numpy(rng.standard_normal(40)).bfloat16()
    x = torch.from_numpy(rng.standard_normal((20, 64))).bfloat16()
    got = _dense.linear(x, w, b, max_tokens=32)
    parts = torch.cat([_dense.linear(x[i:i + 4], w, b) for i in range(0, 20, 4)])
    assert torch.equal(got, parts)
