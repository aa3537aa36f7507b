"""Decode, exhaustively and bit for bit: 256 byte values x 256 scale bytes, per ISA."""
import numpy as np
import torch

from mxfp4x._core import probes as _probes
from mxfp4x._core import reference as _reference
from mxfp4x._core import torch_impl as _torch_impl


def _all_bytes_all_scales():
    # row s holds all 256 byte values in 16 groups; every group of row s has scale s
    packed = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1, 1))
    scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 16))
    return packed, scales


def _same_bits(a, b):
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_decode_kernel_exhaustive(isa):
    packed, scales = _all_bytes_all_scales()
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows float32 to inf, as the kernels do
        ref = _reference.decode_expert(packed, scales).astype(np.float32)
    got = _probes.decode_rows(packed, scales, isa=isa)
    # the reference is float64; each value (a code times a power of two) is exact in
    # float32 except that NaN payloads and code 8 (-0.0) must keep their bits
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert nan.sum() == 16 * 32  # exactly the row with scale byte 255
    _same_bits(got[~nan], ref[~nan])


def test_decode_signed_zero_and_subnormal_scale(isa):
    packed = np.array([[[0x08] + [0x80] + [0x11] * 14]], dtype=np.uint8)
    scales = np.zeros((1, 1), dtype=np.uint8)
    got = _probes.decode_rows(packed, scales, isa=isa)[0]
    assert got[0] == 0 and np.signbit(got[0])        # code 8 -> -0.0
    assert got[1] == 0 and not np.signbit(got[1])    # code 0 -> +0.0
    assert got[3] == 0 and np.signbit(got[3])        # high nibble 8 -> -0.0
    assert got[4] == np.float32(0.5 * 2.0 ** -127) and got[4] != 0  # not flushed


def test_float64_decode_kernel_exhaustive(isa):
    """Every ISA's float64 decode (AVX-512's vector form included) gives the reference's
    bits for every byte under every scale byte."""
    packed, scales = _all_bytes_all_scales()
    ref = _reference.decode_expert(packed, scales)
    got = _probes.decode_rows(packed, scales, isa=isa, compute="float64")
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint64), ref[~nan].view(np.uint64))


def test_torch_decode_exhaustive():
    packed, scales = _all_bytes_all_scales()
    ref = _reference.decode_expert(packed, scales)
    got = _torch_impl.decode_expert(torch.from_numpy(packed), torch.from_numpy(scales),
                                    torch.float32).numpy()
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    with np.errstate(over="ignore"):
        _same_bits(got[~nan], ref[~nan].astype(np.float32))
    got64 = _torch_impl.decode_expert(torch.from_numpy(packed), torch.from_numpy(scales),
                                      torch.float64).numpy()
    np.testing.assert_array_equal(got64[~nan], ref[~nan])


def test_reference_decode_layout():
    # byte 0x21: element 0 = low nibble 1 (0.5), element 1 = high nibble 2 (1.0)
    packed = np.zeros((1, 1, 16), dtype=np.uint8)
    packed[0, 0, 0] = 0x21
    packed[0, 0, 15] = 0xF7
    w = _reference.decode_expert(packed, np.full((1, 1), 128, dtype=np.uint8))[0]
    assert w[0] == 1.0 and w[1] == 2.0     # times scale 2
    assert w[30] == 12.0 and w[31] == -12.0
    assert np.all(w[2:30] == 0)
