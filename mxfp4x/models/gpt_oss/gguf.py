"""gpt-oss from llama.cpp's GGUF files (architecture ``gpt-oss``; the same codes and
scales as GGUF blocks, gate and up split, read in place): the experts
(:func:`experts_from_gguf`) and the block (:func:`from_gguf`), which the classes'
``from_checkpoint`` call on a ``.gguf``."""
import os
from typing import TYPE_CHECKING, Optional

from ..._core.arguments import ExpertRange
from ...checkpoints.families import gguf_naming, load_gguf_experts
from .._common import check_gguf_dims, gguf_integer, require_tensor
from .experts import GptOssExperts
from .router import GptOssRouter
from .tensors import check_experts, check_router

if TYPE_CHECKING:
    from .block import GptOssMoE


def _gguf_of(path):
    """An open GGUFCheckpoint for a GGUF ``path`` (or one given), else None."""
    from ...checkpoints.gguf import GGUFCheckpoint, is_gguf

    if isinstance(path, GGUFCheckpoint):
        return path
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path) and is_gguf(path):
        return GGUFCheckpoint(os.fspath(path))
    return None


def from_gguf(cls, gguf, layer: int, top_k: Optional[int] = None,
              expert_range: Optional[ExpertRange] = None, num_threads: Optional[int] = None,
              group=None) -> "GptOssMoE":
    """:meth:`GptOssMoE.from_checkpoint` of an open GGUF file (``cls`` the block's class;
    ``expert_range`` parsed and ``num_threads`` checked already): the experts
    (:func:`experts_from_gguf`), the router and its bias, ``top_k`` from the metadata
    (``gpt-oss.expert_used_count``) unless given."""
    naming = gguf_naming(gguf.architecture)
    if top_k is None:
        top_k = gguf_integer(gguf, f"{gguf.architecture}.expert_used_count")
    experts = experts_from_gguf(gguf, layer, expert_range=expert_range,
                                num_threads=num_threads, group=group)
    names = (naming.router.format(layer=layer),
             (naming.router_bias or "").format(layer=layer))  # gpt-oss's has a bias
    for name in names:
        require_tensor(gguf, name, f"the router of layer {layer}")
    weight, bias = (gguf.get(name) for name in names)
    check_router(weight, bias, experts,
                 [f"{gguf.tensor(name).path}: tensor {name!r}" for name in names])
    return cls(GptOssRouter(weight, bias, top_k), experts)


def experts_from_gguf(ckpt, layer: int, *, limit: float = 7.0, alpha: float = 1.702,
                      num_threads: Optional[int] = None,
                      expert_range: Optional[ExpertRange] = None, group=None) -> GptOssExperts:
    """Layer ``layer``'s experts of a gpt-oss GGUF (llama.cpp's names, families.py);
    ``expert_range`` parsed already."""
    if ckpt.architecture != "gpt-oss":
        raise ValueError(f"{ckpt.root}: architecture {ckpt.architecture!r}, expected "
                         f"'gpt-oss' (llama.cpp's name for gpt-oss GGUF files)")
    naming = gguf_naming(ckpt.architecture)
    blocks = load_gguf_experts(ckpt, layer, expert_range, naming=naming)
    names = {f"{role}_blocks": naming.experts.format(layer=layer, proj=naming.roles[role])
             for role in ("gate", "up", "down")}
    names.update({f"{role}_bias": str(naming.expert_bias).format(layer=layer,
                                                                 proj=naming.roles[role])
                  for role in ("gate", "up", "down")})
    t = {f"{role}_blocks": blocks[role] for role in ("gate", "up", "down")}
    for role in ("gate", "up", "down"):
        name = names[f"{role}_bias"]
        require_tensor(ckpt, name, f"the {role} experts' bias of layer {layer}")
        t[f"{role}_bias"] = ckpt.get(name)
    total, hidden, ff = check_experts(
        t, expert_range,
        {arg: f"{ckpt.tensor(name).path}: tensor {name!r}" for arg, name in names.items()})
    # the sizes the metadata states, where it does (llama.cpp's converter writes them)
    check_gguf_dims(ckpt, {"expert_count": (total, "the experts' biases hold"),
                           "embedding_length": (hidden, "the experts' blocks are"),
                           "expert_feed_forward_length": (ff, "the experts' blocks are")})
    return GptOssExperts.from_gguf_blocks(
        t["gate_blocks"], t["up_blocks"], t["gate_bias"], t["up_bias"], t["down_blocks"],
        t["down_bias"], limit=limit, alpha=alpha, num_threads=num_threads,
        expert_range=expert_range, group=group)
