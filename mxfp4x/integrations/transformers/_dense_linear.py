"""The model's bfloat16 linear layers on mxfp4x's dense kernel at a few tokens
(:class:`DenseLinear`, :func:`use_dense_kernels`)."""
from typing import Optional

import torch

from ..._core import dense as _dense


class DenseLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward, for bfloat16 weights at up to 4 tokens on CPU
    without autograd, runs mxfp4x's dense kernel (``mxfp4x._core.dense.linear``: the weight
    widened to float32 exactly, float32 products and sums, the bias added in float32,
    one rounding; torch's bf16 matrix-vector product reads the weight at about half the
    memory's rate), and bf16 tokens at 5 to 16 on the bf16 unit where the CPU's default
    entry has one (``unit=True``: torch's arithmetic there, in a fixed order).  Anything
    else is ``F.linear``.  Modules become this class in place
    (:func:`use_dense_kernels`): same parameters, same state dict."""

    _mxfp4x_threads: Optional[int] = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _dense.takes(input, self.weight, unit=True):
            return _dense.linear(input, self.weight, self.bias,
                                 num_threads=self._mxfp4x_threads, unit=True)
        return torch.nn.functional.linear(input, self.weight, self.bias)


def use_dense_kernels(model: torch.nn.Module, num_threads: Optional[int] = None) -> int:
    """Every plain ``nn.Linear`` of ``model`` with a bfloat16 weight becomes a
    :class:`DenseLinear` in place; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16:
            module.__class__ = DenseLinear
            module._mxfp4x_threads = num_threads  # type: ignore[assignment]
            n += 1
    return n
