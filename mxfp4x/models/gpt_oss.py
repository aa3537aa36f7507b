"""gpt-oss (openai/gpt-oss-20b and -120b): its tensor names, router, experts, block and
``from_checkpoint``, the experts kept in MXFP4.

The checkpoint as released: layer L's experts are stacked tensors
``model.layers.L.mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`` (blocks uint8
(E, out, in/32, 16), scales uint8 (E, out, in/32), the gate/up rows interleaved: gate
rows even, up rows odd), the router ``model.layers.L.mlp.router.{weight,bias}``.
"""
import functools
from typing import List, Optional, Sequence

import torch

from .._api import mxfp4_experts, mxfp4_experts_slots
from .._format import GROUP, accumulation_dtype
from .._progress import Progress
from .._validation import bytes_by_view as as_bytes
from ..checkpoints.safetensors import SafeTensorsCheckpoint
from ._common import bytes_of, expert_range_of

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                   experts_per_token=4, num_hidden_layers=24, swiglu_limit=7.0)
EXPERTS = "model.layers.{layer}.mlp.experts."  # + {gate_up,down}_proj_{blocks,scales,bias}
ROUTER = "model.layers.{layer}.mlp.router."    # + {weight,bias}


class GptOssRouter(torch.nn.Module):
    """gpt-oss's router: ``forward(x (T, H)) -> (selected (T, K) int64, weights (T, K))``,
    the top-k of ``x W^T + b`` in float32, a softmax over the chosen logits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.top_k = int(top_k)

    def forward(self, x: torch.Tensor):
        logits = torch.nn.functional.linear(x.float(), self.weight.float(), self.bias.float())
        values, idx = torch.topk(logits, self.top_k, dim=-1)
        return idx, torch.softmax(values, dim=-1)


class GptOssExperts(torch.nn.Module):
    """The experts block of gpt-oss, with its expert matrices in MXFP4.

    forward(hidden_states (T, H), router_indices (T, K), routing_weights (T, K)) -> (T, H):

        gate_up = W_gu[e] h + b_gu[e]                  per slot, (T, K, 2F), rows interleaved
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = min(gate, limit); up = clamp(up, -limit, limit)
        a = (up + 1) * gate * sigmoid(alpha * gate)     (float32, float64 for float64 input)
        out = sum_k p_k (W_down[e] a_k + b_down[e])

    Buffers: ``gate_up_blocks`` (E, 2F, H/32, 16), ``gate_up_scales`` (E, 2F, H/32),
    ``down_blocks`` (E, H, F/32, 16), ``down_scales`` (E, H, F/32); parameters
    ``gate_up_bias`` (E, 2F) and ``down_bias`` (E, H).

    Expert-parallel: with ``expert_range=(e0, e1)`` and ``group``, the block buffers hold
    experts e0..e1-1 (the biases, small, stay whole) and both projections run through
    :mod:`mxfp4x.distributed` (the gate/up per slot, the down combined).
    """

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor

    def __init__(self, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                 gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                 down_scales: torch.Tensor, down_bias: torch.Tensor, limit: float = 7.0,
                 alpha: float = 1.702, num_threads: Optional[int] = None, expert_range=None,
                 group=None):
        super().__init__()
        e, two_f, g_h, _ = gate_up_blocks.shape
        self.expert_range, self.group = expert_range_of(expert_range, e, group), group
        if two_f % 2 or down_blocks.shape[:2] != (e, GROUP * g_h) or \
                down_blocks.shape[2] * GROUP != two_f // 2 or (expert_range is None and
                                                                gate_up_bias.shape[0] != e):
            raise ValueError(f"gate_up_blocks {tuple(gate_up_blocks.shape)} and down_blocks "
                             f"{tuple(down_blocks.shape)} do not form a gpt-oss block")
        self.limit, self.alpha, self.num_threads = float(limit), float(alpha), num_threads
        self.register_buffer("gate_up_blocks", bytes_of("gate_up_blocks", gate_up_blocks))
        self.register_buffer("gate_up_scales", bytes_of("gate_up_scales", gate_up_scales))
        self.register_buffer("down_blocks", bytes_of("down_blocks", down_blocks))
        self.register_buffer("down_scales", bytes_of("down_scales", down_scales))
        bias_dtype = accumulation_dtype(gate_up_bias.dtype)
        self.gate_up_bias = torch.nn.Parameter(gate_up_bias.detach().to(bias_dtype, copy=True),
                                               requires_grad=False)
        self.down_bias = torch.nn.Parameter(down_bias.detach().to(bias_dtype, copy=True),
                                            requires_grad=False)

    @classmethod
    def from_checkpoint(cls, path, layer: int, prefix: str = EXPERTS,
                        **kwargs) -> "GptOssExperts":
        """One layer's experts from a gpt-oss safetensors checkpoint (a file, a directory,
        or an open SafeTensorsCheckpoint), packed bytes memory-mapped, not copied; with
        ``expert_range=(e0, e1)`` only those experts' bytes are mapped."""
        ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
        p = prefix.format(layer=layer)
        rng = kwargs.get("expert_range")

        def experts(name):  # bytes typed U8, I8 or F8_E8M0, read by view
            t = ckpt.get(p + name) if rng is None else ckpt.get_rows(p + name, *rng)
            return as_bytes(p + name, t)

        return cls(experts("gate_up_proj_blocks"), experts("gate_up_proj_scales"),
                   ckpt.get(p + "gate_up_proj_bias"), experts("down_proj_blocks"),
                   experts("down_proj_scales"), ckpt.get(p + "down_proj_bias"), **kwargs)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        return gpt_oss_experts(hidden_states, router_indices, routing_weights,
                               (self.gate_up_blocks, self.gate_up_scales), self.gate_up_bias,
                               (self.down_blocks, self.down_scales), self.down_bias,
                               limit=self.limit, alpha=self.alpha,
                               num_threads=self.num_threads, expert_range=self.expert_range,
                               group=self.group)


def gpt_oss_experts(hidden_states: torch.Tensor, router_indices: torch.Tensor,
                    routing_weights: torch.Tensor, gate_up, gate_up_bias: torch.Tensor, down,
                    down_bias: torch.Tensor, limit: float = 7.0, alpha: float = 1.702,
                    num_threads: Optional[int] = None, expert_range=None,
                    group=None) -> torch.Tensor:
    """The forward of :class:`GptOssExperts` as a function: ``gate_up`` and ``down`` are
    (blocks, scales) pairs of uint8 tensors in the checkpoint's layout; the modules that
    hold these tensors under other names (``mxfp4x.integrations.transformers``) call it."""
    slots, combined = mxfp4_experts_slots, mxfp4_experts
    if group is not None:
        from .. import distributed
        slots = functools.partial(distributed.mxfp4_experts_slots,
                                  expert_range=expert_range, group=group)
        combined = functools.partial(distributed.mxfp4_experts,
                                     expert_range=expert_range, group=group)
    gate_up_out = slots(hidden_states, gate_up[0], gate_up[1], router_indices,
                        num_threads=num_threads)  # checks the inputs
    out_dtype = gate_up_out.dtype  # the latents' (integer latents: the default float dtype)
    try:
        acc = accumulation_dtype(out_dtype)
        gate_up_out = gate_up_out.to(acc) + gate_up_bias.to(acc)[router_indices]
        gate, up = gate_up_out[..., 0::2], gate_up_out[..., 1::2]
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        weights = torch.as_tensor(routing_weights).to(acc)
        bias = (weights.unsqueeze(-1) * down_bias.to(acc)[router_indices]).sum(1)
    except BaseException as exc:
        if group is None:
            raise
        distributed.fail_on_every_rank(exc, group)  # the others wait in `combined`
    out = combined(act, down[0], down[1], router_indices, weights, bias,
                   num_threads=num_threads)
    return out.to(out_dtype)


class GptOssMoE(torch.nn.Module):
    """One gpt-oss MoE layer: ``forward(x (T, H)) -> (T, H)``, the router then the experts
    (:class:`GptOssRouter`, :class:`GptOssExperts`)."""

    def __init__(self, router: GptOssRouter, experts: GptOssExperts):
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        selected, weights = self.router(x)
        return self.experts(x, selected, weights)

    @classmethod
    def from_checkpoint(cls, path, layer: int, top_k: Optional[int] = None,
                        expert_range=None, num_threads: Optional[int] = None,
                        group=None) -> "GptOssMoE":
        """Layer ``layer`` of a gpt-oss checkpoint (a file or a folder); ``top_k`` from its
        config.json (``experts_per_token``) unless given; ``expert_range=(e0, e1)`` maps
        only those experts' bytes (expert-parallel with ``group``)."""
        ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
        if top_k is None:
            from ..checkpoints.families import read_config
            top_k = int(read_config(ckpt.root)["experts_per_token"])
        r = ROUTER.format(layer=layer)
        router = GptOssRouter(ckpt.get(r + "weight"), ckpt.get(r + "bias"), top_k)
        experts = GptOssExperts.from_checkpoint(ckpt, layer, expert_range=expert_range,
                                                num_threads=num_threads, group=group)
        return cls(router, experts)


def load_gpt_oss_experts(path: str, layers: Optional[Sequence[int]] = None,
                         progress: bool = True, **kwargs) -> List[GptOssExperts]:
    """Every (or the given) layer's experts of a gpt-oss checkpoint, memory-mapped, with a
    progress bar on stderr (plain lines when it is not a terminal)."""
    ckpt = SafeTensorsCheckpoint(path)
    if layers is None:
        layers = []
        while EXPERTS.format(layer=len(layers)) + "down_proj_blocks" in ckpt:
            layers.append(len(layers))
    out = []
    bar = Progress(len(layers), "loading experts") if progress else None
    for i, layer in enumerate(layers):
        out.append(GptOssExperts.from_checkpoint(ckpt, layer, **kwargs))
        if bar is not None:
            bar.update(i + 1)
    return out
