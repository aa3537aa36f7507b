"""The GGUF half of the families registry (llama.cpp's files): each architecture's tensor
names, one entry per architecture, and the experts read from them.  Re-exported by
:mod:`mxfp4x.checkpoints.families`, the registry's one public home."""
import re
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

import torch

from .._core.arguments import ExpertRange, check_range_within, parse_expert_range
from .gguf import MXFP4, GGUFCheckpoint


@dataclass(frozen=True)
class GGUFExpertNaming:
    """How llama.cpp names an architecture's MoE tensors in GGUF files (the module
    docstring says where each name comes from).  Patterns take ``layer`` (and ``proj``,
    the projection name of a role)."""

    name: str                        # mxfp4x's family name
    architectures: Tuple[str, ...]   # general.architecture values
    roles: Dict[str, str]            # role (gate, up, down) -> projection in the names
    experts: str = "blk.{layer}.ffn_{proj}_exps.weight"
    expert_bias: Optional[str] = None  # "blk.{layer}.ffn_{proj}_exps.bias" where any
    router: str = "blk.{layer}.ffn_gate_inp.weight"
    router_bias: Optional[str] = None
    shared: Optional[str] = None     # "blk.{layer}.ffn_{proj}_shexp.weight" where any
    other: Tuple[str, ...] = ()      # the block's other MoE tensors

    def tensor(self, layer: int, role: str) -> str:
        return self.experts.format(layer=layer, proj=self.roles[role])


_ROLES = {"gate": "gate", "up": "up", "down": "down"}

GGUF_GPT_OSS = GGUFExpertNaming(
    name="gpt-oss", architectures=("gpt-oss",), roles=_ROLES,
    expert_bias="blk.{layer}.ffn_{proj}_exps.bias",
    router_bias="blk.{layer}.ffn_gate_inp.bias",
    other=("blk.{layer}.attn_sinks.weight",),
)
GGUF_KIMI_K3 = GGUFExpertNaming(
    name="kimi-k3", architectures=("kimi-k3",), roles=_ROLES,
    router_bias="blk.{layer}.exp_probs_b.bias",
    shared="blk.{layer}.ffn_{proj}_shexp.weight",
    other=("blk.{layer}.ffn_routed_down.weight", "blk.{layer}.ffn_routed_up.weight",
           "blk.{layer}.ffn_routed_norm.weight"),
)
GGUF_DEEPSEEK2 = GGUFExpertNaming(
    name="deepseek2", architectures=("deepseek2", "kimi-linear"), roles=_ROLES,
    router_bias="blk.{layer}.exp_probs_b.bias",
    shared="blk.{layer}.ffn_{proj}_shexp.weight",
)
GGUF_FAMILIES = {arch: naming for naming in (GGUF_GPT_OSS, GGUF_KIMI_K3, GGUF_DEEPSEEK2)
                 for arch in naming.architectures}

# every llama.cpp architecture names its stacked experts so (gguf's TENSOR_NAMES:
# FFN_GATE_EXP, FFN_UP_EXP, FFN_DOWN_EXP, FFN_GATE_UP_EXP)
GGUF_EXPERT_NAME = re.compile(
    r"blk\.(?P<layer>0|[1-9][0-9]*)\.ffn_(?P<proj>gate|up|down|gate_up)_exps\.weight")


def gguf_naming(architecture: Optional[str]) -> GGUFExpertNaming:
    """The naming of an architecture; llama.cpp's common one (routed experts and router
    only) for an architecture mxfp4x has no entry for."""
    if architecture in GGUF_FAMILIES:
        return GGUF_FAMILIES[architecture]
    return GGUFExpertNaming(name=architecture or "unknown", architectures=(), roles=_ROLES)


def open_gguf(path) -> GGUFCheckpoint:
    return path if isinstance(path, GGUFCheckpoint) else GGUFCheckpoint(path)


def gguf_expert_tensors(ckpt: GGUFCheckpoint) -> Dict[int, Dict[str, str]]:
    """layer -> {role: name} of every stacked expert tensor the file(s) hold, found by
    name (roles gate, up, down, and gate_up where fused), whatever their type."""
    found: Dict[int, Dict[str, str]] = {}
    for name in ckpt.keys():
        m = GGUF_EXPERT_NAME.fullmatch(name)
        if m is not None:
            found.setdefault(int(m["layer"]), {})[m["proj"]] = name
    return dict(sorted(found.items()))


def load_gguf_experts(ckpt: GGUFCheckpoint, layer: int, expert_range=None,
                      roles: Iterable[str] = ("gate", "up", "down"),
                      naming: Optional[GGUFExpertNaming] = None) -> Dict[str, torch.Tensor]:
    """role -> uint8 ``(n_experts, d_out, n_groups, 17)`` GGUF MXFP4 blocks of layer
    ``layer``'s experts ``expert_range`` (a pair (e0, e1) or a range; None: all), each a
    view of a mapping of just those experts' bytes: what
    ``mxfp4x.mxfp4_experts(x, blocks, None, ...)`` takes.  A tensor that is missing,
    not MXFP4, or shaped unlike a stack of matrices is a ``ValueError`` naming it."""
    rng = None if expert_range is None else parse_expert_range(expert_range)
    naming = naming or gguf_naming(ckpt.architecture)
    out: Dict[str, torch.Tensor] = {}
    n_experts = None
    for role in roles:
        name = naming.experts.format(layer=layer, proj=naming.roles.get(role, role))
        if name not in ckpt:
            raise ValueError(f"{ckpt.root}: no tensor {name!r} (the {role} experts of layer "
                             f"{layer})")
        info = ckpt.tensor(name)
        if info.ggml_type != MXFP4 or len(info.shape) != 3:
            raise ValueError(f"{info.path}: tensor {name!r} is {info.type_name} "
                             f"{list(info.shape)}, expected MXFP4 (n_experts, d_out, d_in)")
        if n_experts is None:
            n_experts = info.shape[0]
            e0, e1 = (0, n_experts) if rng is None else rng
            check_range_within(ExpertRange(e0, e1), n_experts, f"{name!r}")
        elif info.shape[0] != n_experts:
            raise ValueError(f"{info.path}: tensor {name!r} holds {info.shape[0]} experts, "
                             f"the layer's other expert tensors {n_experts}")
        out[role] = ckpt.get_rows(name, e0, e1)
    return out
