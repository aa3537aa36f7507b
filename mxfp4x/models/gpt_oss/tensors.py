"""gpt-oss's tensors: the checkpoint's names of a layer's experts (:func:`tensor_names`,
from the family's registry entry ``mxfp4x.checkpoints.families.GPT_OSS``) and the shapes
the experts' and the router's tensors must have, from either file format
(:func:`check_experts`, :func:`check_router`)."""
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import torch

from ..._core.arguments import ExpertRange, parse_expert_range
from ..._core.format import GGUF_BLOCK_BYTES, GROUP, GROUP_BYTES
from ...checkpoints.families import GPT_OSS
from .._common import check_tensor

if TYPE_CHECKING:
    from .experts import GptOssExperts

# the experts' tensors by constructor argument (split layout, then llama.cpp's GGUF form)
_SPLIT = ("gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks", "down_scales",
          "down_bias")
_GGUF = ("gate_blocks", "up_blocks", "gate_bias", "up_bias", "down_blocks", "down_bias")


def tensor_names(prefix: str, layer: int) -> Dict[str, str]:
    """Constructor argument -> the checkpoint's name of that tensor of layer ``layer``
    (``gate_up_blocks``: ``model.layers.L.mlp.experts.gate_up_proj_blocks``), from the
    family's entry in the registry (``mxfp4x.checkpoints.families.GPT_OSS``)."""
    kinds = {"blocks": GPT_OSS.packed, "scales": GPT_OSS.scale, "bias": str(GPT_OSS.bias)}
    return {arg: GPT_OSS.tensor(prefix, layer, None, *_role_kind(arg, kinds))
            for arg in _SPLIT}


def _role_kind(arg: str, kinds: Dict[str, str]) -> Tuple[str, str]:
    role, kind = arg.rsplit("_", 1)
    return role, kinds[kind]


def _bias_rows(name: str, bias, width: int, e_local: int,
               expert_range: Optional[ExpertRange]) -> int:
    """The experts a gate/up bias holds (all of them: a module of a range indexes the
    biases by global id), checked against the blocks' ``e_local`` and ``expert_range``."""
    check_tensor(name, bias, (None, width), "n_experts by the blocks' rows")
    rows = bias.shape[0]
    if expert_range is None and rows != e_local:
        raise ValueError(f"{name}: expected shape {(e_local, width)} (a row per expert of "
                         f"the blocks), got {tuple(bias.shape)}")
    if expert_range is not None and expert_range.e1 > rows:
        raise ValueError(f"{name}: {rows} experts, fewer than expert_range "
                         f"{tuple(expert_range)} needs")
    return rows


def check_experts(tensors: Dict[str, torch.Tensor], expert_range=None,
                  names: Optional[Dict[str, str]] = None) -> Tuple[int, int, int]:
    """(n_experts, hidden, intermediate) of a gpt-oss experts block's tensors, each one
    checked against the shapes the others imply: the split layout (``gate_up_blocks``
    (E, 2F, H/32, 16), ``gate_up_scales`` (E, 2F, H/32), ``down_blocks`` (E, H, F/32,
    16), ``down_scales`` (E, H, F/32)) or llama.cpp's (``gate_blocks`` and ``up_blocks``
    (E, F, H/32, 17), ``down_blocks`` (E, H, F/32, 17)); the biases (n_experts, 2F) (or
    gate and up (n_experts, F)) and (n_experts, H), n_experts = E or, with
    ``expert_range``, at least its end.  A ValueError naming the tensor (``names``: the
    file's names for the arguments), its shape and the shape expected."""
    expert_range = None if expert_range is None else parse_expert_range(expert_range)
    n = {k: (names or {}).get(k, k) for k in tensors}
    gguf = "gate_blocks" in tensors
    width = GGUF_BLOCK_BYTES if gguf else GROUP_BYTES
    first = "gate_blocks" if gguf else "gate_up_blocks"
    blocks = check_tensor(n[first], tensors[first], (None, None, None, width),
                          f"MXFP4 blocks: n_experts, rows, hidden/32, {width}",
                          floating=False)
    e, rows, g_h, _ = blocks.shape
    if gguf:
        f = rows
        check_tensor(n["up_blocks"], tensors["up_blocks"], tuple(blocks.shape),
                     "the up experts, as the gate's", floating=False)
    else:
        if rows % 2:
            raise ValueError(f"{n[first]}: {rows} rows (shape {tuple(blocks.shape)}), "
                             f"expected an even number (gate and up rows interleaved)")
        f = rows // 2
        check_tensor(n["gate_up_scales"], tensors["gate_up_scales"], (e, rows, g_h),
                     "a scale byte per group of the blocks", floating=False)
    h = GROUP * g_h
    if f % GROUP:
        raise ValueError(f"{n[first]}: an intermediate size of {f} (shape "
                         f"{tuple(blocks.shape)}), expected a multiple of {GROUP} (the down "
                         f"experts' groups)")
    check_tensor(n["down_blocks"], tensors["down_blocks"], (e, h, f // GROUP, width),
                 f"MXFP4 blocks: n_experts, hidden, intermediate/32, {width}, the "
                 f"gate/up blocks' sizes", floating=False)
    if gguf:
        total = _bias_rows(n["gate_bias"], tensors["gate_bias"], f, e, expert_range)
        check_tensor(n["up_bias"], tensors["up_bias"], (total, f), "as the gate's bias")
    else:
        check_tensor(n["down_scales"], tensors["down_scales"], (e, h, f // GROUP),
                     "a scale byte per group of the down blocks", floating=False)
        total = _bias_rows(n["gate_up_bias"], tensors["gate_up_bias"], 2 * f, e,
                           expert_range)
    check_tensor(n["down_bias"], tensors["down_bias"], (total, h),
                 "n_experts by hidden, as the gate/up bias and the blocks")
    return total, h, f


def check_router(weight: torch.Tensor, bias: torch.Tensor, experts: "GptOssExperts",
                 names: Sequence[str] = ("router weight", "router bias")) -> None:
    """The router's weight (n_experts, hidden) and bias (n_experts,) against the experts
    they route to: a row per expert the experts' biases hold, the blocks' hidden size (a
    row short and an expert is never chosen; a row over and a token routed there fails,
    or reaches an expert of another rank)."""
    n, h = experts.n_experts, experts.hidden_size
    check_tensor(names[0], weight, (n, h), "n_experts by hidden, as the experts hold")
    check_tensor(names[1], bias, (n,), "one per expert")
