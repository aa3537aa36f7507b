"""Kimi K3's sigmoid router (:class:`KimiK3Router`): the biased choice of the top-k
experts, grouped where the config asks, and their unbiased, renormalised scores."""
from typing import Optional

import torch
import torch.nn.functional as F

from ..._core import dense as _dense
from ..._core.format import accumulation_dtype
from .._common import _flag, _real, check_routing


class KimiK3Router(torch.nn.Module):
    """The sigmoid router: ``forward(x (T, H)) -> (selected (T, K) int64, weights (T, K))``.

    scores = sigmoid(x W^T) in float32 (float64 for float64 x); the choice ranks
    scores + ``e_score_correction_bias`` (grouped when ``n_group > topk_group > 0``: the
    ``topk_group`` groups with the best two-expert sums); the weights are the unbiased
    scores of the chosen experts, renormalised to sum to 1 (``renormalize``), times
    ``scaling``.  Ties go to the lower expert id (a stable sort), so the choice is
    deterministic.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                 renormalize: bool = True, scaling: float = 1.0, n_group: int = 1,
                 topk_group: int = 1):
        super().__init__()
        if weight.dim() != 2 or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"router: expected a weight (n_experts, hidden) and a bias "
                             f"(n_experts,), got {tuple(weight.shape)} and "
                             f"{tuple(bias.shape)}")
        routing = check_routing(weight.shape[0], top_k, n_group, topk_group, "router")
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = routing
        self.renormalize = _flag("router: renormalize", renormalize)
        self.scaling = _real("router: scaling", scaling)
        self._wide: tuple = ()  # (what the weight was, it in the accumulation dtype, its memory)

    def _weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The router weight in the accumulation dtype, converted once (not per call: at
        one token, converting the bf16 weight cost more than the product) and again only
        when the weight is replaced or modified in place."""
        w = self.weight
        if w.dtype == dtype or (w.requires_grad and torch.is_grad_enabled()):
            return w.to(dtype)
        key = (w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape), dtype)
        wide = self._wide  # read once: a call in another thread may replace it meanwhile
        if not wide or wide[0] != key:
            # the entry keeps the converted weight's source memory alive: a weight put in
            # its place later cannot reuse that address and pass for it
            wide = self._wide = (key, w.detach().to(dtype), w.detach())
        return wide[1]

    def __getstate__(self):
        """Copies and pickles leave the converted weight out (made again when needed)."""
        state = self.__dict__.copy()
        state["_wide"] = ()
        return state

    def forward(self, x: torch.Tensor, num_threads: Optional[int] = None):
        """``num_threads``: the CPU threads of the scores' compiled product (None:
        torch.get_num_threads()); :class:`KimiK3MoE` passes its experts' count."""
        acc = accumulation_dtype(x.dtype)
        if acc == torch.float32 and _dense.takes(x, self.weight):
            # a few tokens, bf16 weight: the product of the float32-widened weight, read
            # as bf16 at the memory's rate (mxfp4x._core.dense)
            scores = torch.sigmoid(_dense.linear(x, self.weight, num_threads=num_threads,
                                                 out_dtype=acc))
        else:
            scores = torch.sigmoid(F.linear(x.to(acc), self._weight_in(acc)))
        choice = scores + self.bias.to(acc)
        n_tok, n_exp = choice.shape
        if self.n_group > 1 and self.n_group > self.topk_group:
            groups = choice.view(n_tok, self.n_group, -1)
            group_score = groups.topk(2, dim=-1).values.sum(-1)
            keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool)
            mask.scatter_(1, keep[:, :self.topk_group], True)
            choice = choice.masked_fill(~mask.repeat_interleave(n_exp // self.n_group, 1),
                                        float("-inf"))
        selected = torch.sort(choice, dim=-1, descending=True, stable=True).indices
        selected = selected[:, :self.top_k]
        weights = scores.gather(1, selected)
        if self.top_k > 1 and self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return selected, weights * self.scaling
