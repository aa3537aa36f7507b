"""quantize / dequantize between float weights and MXFP4 (OCP MX v1.0, gpt-oss layout).

quantize, per group of 32 values along the last axis (OCP MX v1.0, section 6.3):

* shared exponent X = floor(log2(amax)) - 2 (2 = emax of E2M1, whose largest value is
  6 = 1.5 * 2^2), clamped to the E8M0 range [-127, 127]; an all-zero group gets X = -127
  (scale byte 0).  Other rules met in practice, by ``scale_rule``:
  ``"ceil"``: X = ceil(log2(amax / 6)), the smallest scale that never saturates;
  ``"even"``: amax is first rounded to E2M1's precision (1 mantissa bit, round half to
  even), then floor(log2(.)) - 2 (as torchao's EVEN mode): a group whose amax rounds up
  to the next power of two takes the larger scale instead of saturating.
* elements v / 2^X rounded to the nearest E2M1 value, ties to even (to the value whose
  mantissa bit is 0), saturating to +-6; the sign is kept (-0.0 is code 8);
* a group holding NaN or +-Inf gets scale byte 255 (NaN) and codes 0.

dequantize is the decoding of SPEC: code value * 2^(s - 127), NaN for s = 255.
"""
from typing import Any, Tuple

import torch

from .format import E2M1_VALUES, GROUP, GROUP_BYTES, accumulation_dtype

SCALE_RULES = ("floor", "ceil", "even")
_E2M1_EMAX = 2


def _floor_log2(a):
    """floor(log2(a)) for float64 a > 0, exactly (torch.log2 rounds just below 2^k up)."""
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    return (e - 1).to(torch.float64)


def _round_half_even_to_1_mantissa_bit(a):
    """float64 a >= 0 rounded to 2 significant bits, ties to even (exact arithmetic)."""
    m, e = torch.frexp(a)
    return torch.ldexp(torch.round(m * 4) / 4, e)  # torch.round: half to even


def _quantize_groups(v, scale_rule):
    """float64 (N, 32) -> (codes (N, 32) uint8, scale bytes (N,) uint8)."""
    special = ~torch.isfinite(v).all(-1)
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    amax = v.abs().amax(-1)
    positive = amax > 0
    safe = torch.where(positive, amax, torch.ones_like(amax))
    if scale_rule == "even":
        safe = _round_half_even_to_1_mantissa_bit(safe)
    exp = _floor_log2(safe) - _E2M1_EMAX
    if scale_rule == "ceil":  # the smallest X with amax <= 6 * 2^X: X0 or X0 + 1
        exp = exp + (safe > 6 * torch.ldexp(torch.ones_like(exp), exp.to(torch.int32))).double()
    exp = torch.where(positive, exp, torch.full_like(exp, -127)).clamp(-127, 127)
    q = v / torch.ldexp(torch.ones_like(exp), exp.to(torch.int32)).unsqueeze(-1)  # exact
    mag = q.abs()
    # round half to even on the E2M1 grid: steps of 0.5 below 2, 1 below 4, 2 up to 6
    r = torch.where(mag < 2, torch.round(mag * 2) / 2,
                    torch.where(mag < 4, torch.round(mag), torch.round(mag / 2) * 2))
    r = r.clamp(max=6.0)
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64, device=v.device)
    codes = torch.searchsorted(grid, r.contiguous())  # r is on the grid: exact index
    codes = codes | (torch.signbit(q).to(codes.dtype) << 3)
    codes = torch.where(special.unsqueeze(-1), torch.zeros_like(codes), codes)
    scales = torch.where(special, torch.full_like(exp, 255), exp + 127)
    return codes.to(torch.uint8), scales.to(torch.uint8)


def quantize(weights: Any, scale_rule: str = "floor") -> Tuple[torch.Tensor, torch.Tensor]:
    """Float weights (..., I), I a multiple of 32 -> (packed (..., I/32, 16) uint8,
    scale_bytes (..., I/32) uint8), on the weights' device.  Groups run along the last
    axis (for (E, out, in) expert matrices: along ``in``).  Works in float64 in chunks of
    2^20 groups, so memory stays bounded whatever the tensor size."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule: expected one of {SCALE_RULES}, got {scale_rule!r}")
    w = torch.as_tensor(weights)
    if not w.is_floating_point():
        raise TypeError(f"weights: expected a float tensor, got dtype {w.dtype}")
    if w.dim() < 1 or w.shape[-1] % GROUP:
        raise ValueError(f"weights: the last dimension must be a multiple of {GROUP}, got "
                         f"shape {tuple(w.shape)}")
    lead = tuple(w.shape[:-1])
    n_groups = w.shape[-1] // GROUP
    flat = w.detach().reshape(-1, GROUP)
    packed = torch.empty((flat.shape[0], GROUP_BYTES), dtype=torch.uint8, device=w.device)
    scales = torch.empty((flat.shape[0],), dtype=torch.uint8, device=w.device)
    chunk = 1 << 20
    for i in range(0, flat.shape[0], chunk):
        codes, sc = _quantize_groups(flat[i:i + chunk].to(torch.float64), scale_rule)
        packed[i:i + chunk] = codes[:, 0::2] | (codes[:, 1::2] << 4)  # 2j low, 2j+1 high
        scales[i:i + chunk] = sc
    return packed.reshape(lead + (n_groups, GROUP_BYTES)), scales.reshape(lead + (n_groups,))


def dequantize(packed_weights: Any, scale_bytes: Any,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., G, 16) bytes and (..., G) scale bytes -> (..., 32 G) values of ``dtype``
    (decoded exactly in float32, float64 for float64, then cast)."""
    from .coerce import as_tensor, byte_tensor
    from .torch_impl import decode_expert, exact_on_cpu

    packed = byte_tensor("packed_weights", as_tensor("packed_weights", packed_weights))
    scales = byte_tensor("scale_bytes", as_tensor("scale_bytes", scale_bytes))
    if packed.dim() < 2 or packed.shape[-1] != GROUP_BYTES or \
            tuple(scales.shape) != tuple(packed.shape[:-1]):
        raise ValueError(f"packed_weights (..., G, 16) and scale_bytes (..., G) expected, got "
                         f"{tuple(packed.shape)} and {tuple(scales.shape)}")
    lead = tuple(packed.shape[:-2])
    n_groups = packed.shape[-2]
    compute = accumulation_dtype(dtype)
    flat = exact_on_cpu(decode_expert)(packed.reshape(-1, n_groups, GROUP_BYTES),
                                       scales.reshape(-1, n_groups), compute)
    return flat.reshape(lead + (n_groups * GROUP,)).to(dtype)
