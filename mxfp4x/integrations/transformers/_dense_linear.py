"""The model's bfloat16 linear layers on mxfp4x's dense kernel at a few tokens
(:class:`DenseLinear`, :func:`use_dense_kernels`), and gpt-oss's router and RMS norms on
mxfp4x's compiled passes (:class:`DenseRouter`, :class:`CompiledRMSNorm`)."""
from typing import Optional

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm, GptOssTopKRouter

from ..._core import activation as _activation
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


class DenseRouter(GptOssTopKRouter):
    """transformers' ``GptOssTopKRouter`` whose logits, for a bfloat16 weight on CPU
    without autograd, come from mxfp4x's dense kernels as :class:`DenseLinear`'s do: the
    exact kernel at up to 4 tokens (float32 products and sums, the bias added in float32,
    one rounding to the input's dtype), the bf16 unit's at 5 to 16 bf16 tokens where the
    CPU's default entry has one (torch's arithmetic, a fixed order), in place of torch's
    bf16 product, slow on a decoding step's cold caches (docs/performance.md); the top-k
    and the softmax are transformers' own.  Anything else is transformers' forward."""

    _mxfp4x_threads: Optional[int] = None

    def forward(self, hidden_states):
        if not _dense.takes(hidden_states, self.weight, unit=True):
            return super().forward(hidden_states)
        router_logits = _dense.linear(hidden_states, self.weight, self.bias,
                                      num_threads=self._mxfp4x_threads, unit=True)
        top_value, indices = torch.topk(router_logits, self.top_k, dim=-1)
        scores = torch.nn.functional.softmax(top_value, dim=1, dtype=top_value.dtype)
        return router_logits, scores, indices


class CompiledRMSNorm(GptOssRMSNorm):
    """transformers' ``GptOssRMSNorm`` on mxfp4x's compiled pass
    (``mxfp4x._core.activation.gpt_oss_rms_norm``: the same float32 operations in one pass
    over rows, where torch runs six ops a norm) wherever it takes the call; else
    transformers' forward."""

    _mxfp4x_threads: Optional[int] = None

    def forward(self, hidden_states):
        out = _activation.gpt_oss_rms_norm(hidden_states, self.weight, self.variance_epsilon,
                                           num_threads=self._mxfp4x_threads)
        return super().forward(hidden_states) if out is None else out


def use_dense_kernels(model: torch.nn.Module, num_threads: Optional[int] = None) -> int:
    """Every plain ``nn.Linear`` of ``model`` with a bfloat16 weight becomes a
    :class:`DenseLinear` in place, every gpt-oss router with a bfloat16 weight a
    :class:`DenseRouter` and every gpt-oss RMS norm a :class:`CompiledRMSNorm` (each
    keeping its parameters and state dict); returns how many modules changed."""
    n = 0
    for module in model.modules():
        bf16 = getattr(module, "weight", None) is not None and \
            module.weight.dtype == torch.bfloat16
        if type(module) is torch.nn.Linear and bf16:
            module.__class__ = DenseLinear
        elif type(module) is GptOssTopKRouter and bf16:
            module.__class__ = DenseRouter
        elif type(module) is GptOssRMSNorm:
            module.__class__ = CompiledRMSNorm
        else:
            continue
        module._mxfp4x_threads = num_threads  # type: ignore[assignment]
        n += 1
    return n
