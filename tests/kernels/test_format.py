"""The format constants against independent sources."""
import numpy as np
import pytest
import torch

from mxfp4x._core import format as _format


def test_e2m1_table_is_the_ocp_table():
    # E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        exp, man = (code >> 1) & 3, code & 1
        mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
        assert _format.E2M1_VALUES[code] == sign * mag
        assert np.signbit(_format.E2M1_VALUES[code]) == bool(code & 8)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch lacks float8_e8m0fnu")
def test_e8m0_matches_torch_bit_for_bit():
    s = torch.arange(256, dtype=torch.uint8)
    theirs = s.view(torch.float8_e8m0fnu).to(torch.float32).numpy()
    ours = _format.e8m0_table_f32()
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    assert np.isnan(ours[255])
    ok = ~np.isnan(ours)
    np.testing.assert_array_equal(ours[ok].view(np.uint32), theirs[ok].view(np.uint32))


def test_e8m0_special_values():
    t = _format.e8m0_table_f32()
    assert t[0].view(np.uint32) == 0x00400000  # 2^-127, a float32 subnormal
    assert t[0] == np.float32(2.0 ** -127) and t[0] != 0
    assert t[127] == 1.0 and t[128] == 2.0 and t[254] == 2.0 ** 127
    assert np.isnan(t[255])
