"""Kimi K3's tensors: the checkpoint's names of the block's dense tensors
(:data:`DENSE_PARTS`; the experts' are the registry's, ``mxfp4x.checkpoints.families.
KIMI_K3``), the shapes each must have, checked from either file format
(:func:`check_block`), and the experts' tensors by checkpoint name (:func:`expert_tensors`,
for ``verify``)."""
from typing import Dict, Mapping, Optional

import torch

from ...checkpoints import families as ck
from .._common import check_tensor
from .experts import KimiK3Experts

# the block's dense tensors: KimiK3MoE's arguments, what each is, and the checkpoint's name
DENSE_PARTS = {
    "down_proj": ("the latent down projection", "routed_expert_down_proj.weight"),
    "norm_weight": ("the latent norm", "routed_expert_norm.weight"),
    "up_proj": ("the latent up projection", "routed_expert_up_proj.weight"),
    "shared_gate": ("the shared experts' gate", "shared_experts.gate_proj.weight"),
    "shared_up": ("the shared experts' up", "shared_experts.up_proj.weight"),
    "shared_down": ("the shared experts' down", "shared_experts.down_proj.weight"),
}


def dense_shapes(hidden: int, latent: int, d_shared: int) -> Dict[str, tuple]:
    """The shape of each dense tensor of a block (by :data:`DENSE_PARTS` name) that the
    router's hidden size, the routed experts' latent size and the shared experts' width
    imply: what a checkpoint's tensors are checked against, from either file format."""
    return {"down_proj": (latent, hidden), "norm_weight": (latent,),
            "up_proj": (hidden, latent), "shared_gate": (d_shared, hidden),
            "shared_up": (d_shared, hidden), "shared_down": (hidden, d_shared)}


def check_block(router_weight: torch.Tensor, experts: "KimiK3Experts",
                dense: Mapping[str, Optional[torch.Tensor]],
                names: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """Every dense tensor of a block (``dense``: by :data:`DENSE_PARTS` name, the norm
    None for none) against the shape the router (n_experts, hidden), the routed experts'
    latent size and the shared experts' gate (d_shared, hidden) imply; the router's
    experts against the ids ``experts`` holds.  A ValueError naming the tensor (``names``:
    as the file names it), its shape and the shape expected: a tensor of one row would
    broadcast, silently, in the forward.  Returns the sizes (hidden, latent, d_shared)."""
    def name(k):
        return (names or {}).get(k, k)

    rows, hidden = check_tensor(name("router"), router_weight, (None, None),
                                "the router: n_experts by hidden").shape
    if experts.expert_range[1] > rows:
        raise ValueError(f"{name('router')}: the router scores {rows} experts, but the "
                         f"routed experts hold ids {experts.expert_range[0]} to "
                         f"{experts.expert_range[1] - 1}")
    gate = check_tensor(name("shared_gate"), dense["shared_gate"], (None, hidden),
                        DENSE_PARTS["shared_gate"][0] + ": d_shared by hidden")
    shapes = dense_shapes(hidden, experts.d_latent, gate.shape[0])
    for k, (what, _) in DENSE_PARTS.items():
        if dense[k] is not None or k != "norm_weight":
            check_tensor(name(k), dense[k], shapes[k], what)
    return dict(hidden=hidden, latent=experts.d_latent, d_shared=gate.shape[0])


def expert_tensors(experts: KimiK3Experts, prefix: str, layer: int) -> dict:
    """Checkpoint name -> the tensor a :class:`KimiK3Experts` hands to the kernels (for
    ``verify``)."""
    layout, n = ck.KIMI_K3, experts.n_local
    if experts.gate_up_scales is None or experts.down_scales is None:
        raise ValueError("expert_tensors: the module holds GGUF blocks, not a safetensors "
                         "checkpoint's tensors (verify a GGUF file with verify_gguf_experts)")
    out = {}
    for i, e in enumerate(experts.expert_ids):
        for role, packed, scales in (
                ("gate", experts.gate_up_packed[i], experts.gate_up_scales[i]),
                ("up", experts.gate_up_packed[n + i], experts.gate_up_scales[n + i]),
                ("down", experts.down_packed[i], experts.down_scales[i])):
            out[layout.tensor(prefix, layer, e, role, layout.packed)] = packed
            out[layout.tensor(prefix, layer, e, role, layout.scale)] = scales
    return out
