"""The MXFP4 format, written once (OCP Microscaling Formats (MX) v1.0).

One group is 32 elements: 16 bytes and one E8M0 scale byte.  In the gpt-oss
layout byte j holds element 2j in its low nibble and element 2j+1 in its high
nibble::

    byte j:  [ hi nibble | lo nibble ]    element 2j   = byte & 0xF
                bits 7..4   bits 3..0     element 2j+1 = byte >> 4

llama.cpp's GGUF files store each group as one 17-byte ``block_mxfp4``: the scale
byte first, then 16 bytes in which byte j holds element j in its low nibble and
element j+16 in its high nibble (not 2j and 2j+1).  mxfp4x reads those blocks in
place (``scale_bytes=None``); the values and the E8M0 rule are the same (byte 255 is
NaN here, whatever ggml does).
"""
import numpy as np

GROUP = 32
"""Elements per scale group (the MX block size k)."""

GROUP_BYTES = 16
"""Packed bytes per group: two 4-bit codes per byte."""

GGUF_BLOCK_BYTES = 17
"""Bytes of one GGUF ``block_mxfp4``: the E8M0 scale byte, then the group's 16 bytes."""

E8M0_BIAS = 127
E8M0_NAN = 255
"""Scale byte that encodes NaN (OCP MX v1.0, 5.4.1; as torch.float8_e8m0fnu)."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""E2M1 code -> value; bit 3 is the sign (code 8 is -0.0)."""

E2M1_TABLE = np.array(E2M1_VALUES, dtype=np.float64)


def accumulation_dtype(dtype, *others):
    """The dtype results are accumulated in for latents of ``dtype``: float64 for float64,
    float32 for every other float (the result is rounded to the latents' dtype once, at the
    end).  With ``others`` (the mixture weights' dtype, for their gradient), float64 where
    any of them is float64.  Torch dtypes give a torch dtype, names (``"bfloat16"``) a
    name."""
    dtypes = (dtype, *others)
    if isinstance(dtype, str):
        return "float64" if "float64" in dtypes else "float32"
    import torch  # here, not at the top: the QEMU probes import this module without torch

    return torch.float64 if torch.float64 in dtypes else torch.float32


def torch_e8m0_dtype():
    """``torch.float8_e8m0fnu`` (scale bytes typed as E8M0), or None on a torch without it."""
    import torch

    return getattr(torch, "float8_e8m0fnu", None)


def e8m0_to_float64(scale_bytes):
    """2^(s - 127) for s in 0..254, NaN for 255, exactly, as float64."""
    s = np.asarray(scale_bytes, dtype=np.int64)
    out = np.ldexp(1.0, s - E8M0_BIAS)
    return np.where(s == E8M0_NAN, np.nan, out)


def e8m0_table_f32():
    """The 256 scale values as float32, bit-exact (0 -> 2^-127, a subnormal)."""
    return e8m0_to_float64(np.arange(256)).astype(np.float32)


def matrix_bytes(d_out: int, d_in: int) -> int:
    """Bytes of one (d_out, d_in) MXFP4 matrix: a packed group and its scale byte per
    32 elements of a row (Python ints: an expert bank passes 2^31 bytes)."""
    return int(d_out) * (int(d_in) // GROUP) * (GROUP_BYTES + 1)
