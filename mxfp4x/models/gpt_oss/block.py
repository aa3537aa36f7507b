"""One gpt-oss MoE layer (:class:`GptOssMoE`): the router, then the experts;
``from_checkpoint`` reads either file format (loading.py, gguf.py)."""
from typing import Optional

import torch

from ..._core.arguments import num_threads_arg, parse_expert_range
from .experts import GptOssExperts
from .gguf import _gguf_of, from_gguf
from .loading import from_safetensors
from .router import GptOssRouter
from .tensors import check_router


class GptOssMoE(torch.nn.Module):
    """One gpt-oss MoE layer: ``forward(x (T, H)) -> (T, H)``, the router then the experts
    (:class:`GptOssRouter`, :class:`GptOssExperts`)."""

    def __init__(self, router: GptOssRouter, experts: GptOssExperts):
        super().__init__()
        check_router(router.weight, router.bias, experts)
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.group is not None:
            # the router inside the ranks' agreement too: its failure on one rank reaches
            # every rank (mxfp4x.distributed._scope)
            from ...distributed import _scope
            return _scope.run(self.experts.group, self, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        selected, weights = self.router(x)
        return self.experts(x, selected, weights)

    @classmethod
    def from_checkpoint(cls, path, layer: int, top_k: Optional[int] = None,
                        expert_range=None, num_threads: Optional[int] = None,
                        group=None) -> "GptOssMoE":
        """Layer ``layer`` of a gpt-oss checkpoint (a file or a folder); ``top_k`` from its
        config.json unless given (``num_experts_per_tok``, transformers' name, or
        ``experts_per_token``, openai's; the release states both), and the activation's
        ``swiglu_limit`` and ``swiglu_alpha`` (:func:`activation`), every key read as
        transformers' GptOssConfig reads it; ``expert_range=(e0, e1)`` maps
        only those experts' bytes (expert-parallel with ``group``). A GGUF file (or split
        set) gives the router, the biases and ``top_k`` (``gpt-oss.expert_used_count``)
        too."""
        num_threads_arg(num_threads)  # what is given, checked before any file is read
        rng = None if expert_range is None else parse_expert_range(expert_range)
        gguf = _gguf_of(path)
        if gguf is not None:
            return from_gguf(cls, gguf, layer, top_k, expert_range=rng,
                             num_threads=num_threads, group=group)
        return from_safetensors(cls, path, layer, top_k, expert_range=rng,
                                num_threads=num_threads, group=group)
