"""Dense bfloat16 projections at a few tokens: ``linear(x, weight)`` is ``F.linear``
for the dense matrices around the routed experts (Kimi K3's latent projections, shared
experts), which checkpoints ship in bfloat16.

At one to a few tokens such a product only streams the weight, and torch's CPU bfloat16
matrix-vector product reads it at about half the machine's memory rate.  Up to
``MAX_TOKENS`` tokens, on CPU, without autograd, a bfloat16 weight goes through the
compiled kernels instead (mxfp4x.h, ``mxfp4x_dense_bf16_fn``): the weight widened to
float32 exactly, products and sums in float32, the result rounded to the input's dtype
once -- what ``F.linear`` on the float32-widened weight computes, with the kernels'
fixed order, so a token's bits depend neither on the thread count nor on the other
tokens of the call (up to ``MAX_TOKENS``; above it the product is torch's).  Anything
else is ``F.linear`` itself (a float32 input upcasts the weight, as before).

``unit=True`` (the transformers door's linear layers, Kimi K3's dense products) also sends
bfloat16 tokens past ``MAX_TOKENS``, up to ``UNIT_MAX_TOKENS``, to the compiled kernels
where this CPU's default entry has the dense product on a bf16 unit (AVX512-BF16's
``vdpbf16ps``: the AMD CPUs, whose default it is): what torch's bf16 product computes there
(products exact, float32 sums in the unit's order, subnormals flushed), in a fixed order,
so a token's bits depend neither on the threads nor on the other tokens of a call of
``UNIT_MIN_TOKENS`` to ``UNIT_MAX_TOKENS`` tokens."""
from typing import Optional

import torch
import torch.nn.functional as F

from . import cpu as _cpu
from . import threads as _threads
from .activation import _C_DTYPES, _bits

# Kimi K3's 3584 x 7168 and 7168 x 3584 bf16 weights, AMD EPYC Zen 4, medians of 25:
# on 2 threads the kernel read them at 23 GB/s at 1 token (torch 14-16), 19-21 at 2,
# 16-19 at 4 (torch 13-15) and 13 at 8, where torch's 13-16 overtook it.
MAX_TOKENS = 4
# The bf16 unit's calls (mxfp4x.h, dense_bf16_unit): this many tokens
UNIT_MIN_TOKENS = _cpu.DENSE_UNIT_MIN_TOKENS
UNIT_MAX_TOKENS = _cpu.DENSE_UNIT_MAX_TOKENS


def takes(x: torch.Tensor, weight: torch.Tensor, max_tokens: Optional[int] = None,
          unit: bool = False) -> bool:
    """Whether :func:`linear` runs this product through the compiled kernels
    (``max_tokens``: default ``MAX_TOKENS``; ``unit``: see the module docstring)."""
    return _kernel(x, weight, max_tokens, unit) is not None


def _kernel(x: torch.Tensor, weight: torch.Tensor, max_tokens: Optional[int],
            unit: bool) -> Optional[str]:
    """Which compiled kernel :func:`linear` runs: ``"exact"`` (up to ``max_tokens``),
    ``"unit"`` (the bf16 unit's, past them) or None (torch's product)."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return None
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or x.dtype not in (
            torch.bfloat16, torch.float32):
        return None
    if x.dim() == 0 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    if _cpu.default_isa() == "scalar":  # torch's own product is faster than scalar C
        return None
    n = x.numel() // x.shape[-1]
    if n <= (MAX_TOKENS if max_tokens is None else max_tokens):
        return "exact"
    if (unit and x.dtype == torch.bfloat16 and UNIT_MIN_TOKENS <= n <= UNIT_MAX_TOKENS
            and _cpu.dense_unit()):
        return "unit"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           num_threads: Optional[int] = None, max_tokens: Optional[int] = None,
           out_dtype: Optional[torch.dtype] = None, unit: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, the weight (and bias) brought to the input's dtype
    as ``.to(x.dtype)`` would; bfloat16 weights at up to ``max_tokens`` tokens on CPU
    through the compiled kernels (see the module docstring; a bias is added in float32
    before the one rounding, both in the kernel's tasks).  ``out_dtype`` float32 (None:
    x's dtype): ``F.linear`` of x widened to float32, without the rounding to x's dtype
    (a bf16 x is read as it is: half the bytes of its widened copy, and the same bits);
    ``unit``: bf16 tokens past ``max_tokens`` on the bf16 unit where there is one (the
    module docstring)."""
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype: expected None, {x.dtype} or torch.float32, got "
                         f"{out_dtype}")
    wide = out_dtype == torch.float32 and x.dtype != torch.float32
    kernel = _kernel(x, weight, max_tokens, unit)
    if kernel is None or (bias is not None and (
            bias.device.type != "cpu" or bias.shape != (weight.shape[0],)
            or (torch.is_grad_enabled() and bias.requires_grad))):
        if wide:
            x = x.to(torch.float32)
        return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype),
                        bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype))
    d_in = weight.shape[1]
    x2 = x.reshape(-1, d_in)
    n_tok = x2.shape[0]
    # bf16 tokens go as their bits (the kernels widen them exactly): half the bytes
    x2 = (x2.contiguous().view(torch.uint16) if x2.dtype == torch.bfloat16
          else x2.to(torch.float32).contiguous())
    w = weight.contiguous()
    dtype = torch.float32 if wide else x.dtype
    # the bias and the rounding in the kernel's tasks (up to UNIT_MAX_TOKENS tokens)
    epilogue = n_tok <= UNIT_MAX_TOKENS
    out = torch.empty((n_tok, weight.shape[0]),
                      dtype=dtype if epilogue else torch.float32)
    b = None if bias is None else bias.detach()
    bias_bits, bias_dtype = None, "float32"
    if b is not None and epilogue:
        b = b if b.dtype in _C_DTYPES else b.to(torch.float32)
        bias_bits, bias_dtype = _bits(b), _C_DTYPES[b.dtype]
    _cpu.dense_bf16(x2.numpy(), w.view(torch.uint16).numpy(), _bits(out),
                    n_threads=_threads.resolve(num_threads), unit=kernel == "unit",
                    bias=bias_bits, bias_dtype=bias_dtype, out_dtype=_C_DTYPES[out.dtype])
    if not epilogue:
        if b is not None:
            out += b.to(torch.float32)
        out = out.to(dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])

