"""gpt-oss's router (:class:`GptOssRouter`): the top-k of the logits, a softmax over the
chosen ones."""
import torch

from .._common import check_routing, check_tensor


class GptOssRouter(torch.nn.Module):
    """gpt-oss's router: ``forward(x (T, H)) -> (selected (T, K) int64, weights (T, K))``,
    the top-k of ``x W^T + b`` in float32, a softmax over the chosen logits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int):
        super().__init__()
        check_tensor("router weight", weight, (None, None), "n_experts by hidden")
        check_tensor("router bias", bias, (weight.shape[0],), "one per row of the weight")
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.top_k = check_routing(weight.shape[0], top_k, 1, 1, "router")[0]

    def forward(self, x: torch.Tensor):
        logits = torch.nn.functional.linear(x.float(), self.weight.float(), self.bias.float())
        values, idx = torch.topk(logits, self.top_k, dim=-1)
        return idx, torch.softmax(values, dim=-1)
