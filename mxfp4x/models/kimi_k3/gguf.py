"""Kimi K3's block from llama.cpp's GGUF files (architecture ``kimi-k3``; :func:`from_gguf`,
which :meth:`KimiK3MoE.from_checkpoint` calls on a ``.gguf``): the routed experts stay
GGUF blocks read in place, the hyperparameters come from the metadata
(:func:`gguf_config`)."""
from typing import TYPE_CHECKING, Any, Dict, Optional

import numpy as np
import torch

from ..._core.arguments import num_threads_arg
from ...checkpoints import families as ck
from ...checkpoints.gguf import MXFP4, GGUFCheckpoint
from .._common import (
    check_gguf_dims,
    expert_range_within,
    gguf_integer,
    gguf_integer_if_any,
    require_tensor,
)
from .config import block_config, situ_betas
from .experts import KimiK3Experts
from .router import KimiK3Router
from .tensors import DENSE_PARTS, dense_shapes

if TYPE_CHECKING:
    from .block import KimiK3MoE

# The hyperparameters ``KimiK3Model.set_gguf_parameters`` (llama.cpp
# ``conversion/kimi_k3.py``) writes, under the names of ``gguf-py``'s ``Keys``, by the
# config.json name each comes from.  The group counts are optional (llama.cpp reads a
# missing one as no grouped routing; K3 has one group); the others are required, from
# the file or from ``config=``.
GGUF_KEYS: Dict[str, str] = {
    "num_experts": "{arch}.expert_count",
    "num_experts_per_token": "{arch}.expert_used_count",
    "routed_scaling_factor": "{arch}.expert_weights_scale",
    "moe_renormalize": "{arch}.expert_weights_norm",
    "num_expert_group": "{arch}.expert_group_count",
    "topk_group": "{arch}.expert_group_used_count",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "activation_situ_beta": "{arch}.activation.situ_beta",
    "activation_situ_linear_beta": "{arch}.activation.situ_linear_beta",
}
_GGUF_OPTIONAL = {"num_expert_group": 1, "topk_group": 1}
_GGUF_COUNTS = ("num_experts", "num_experts_per_token", "num_expert_group", "topk_group")
GGUF_GATING_FUNC_KEY = "{arch}.expert_gating_func"
GGUF_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _same(a, b) -> bool:
    """Whether a file's value and a config's agree (floats as the file's float32)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.float32(a) == np.float32(b)
    return a == b


def gguf_config(ckpt: GGUFCheckpoint, config: Optional[dict] = None) -> Dict[str, Any]:
    """The block's hyperparameters from a K3 GGUF file's metadata, by config.json names
    (:data:`GGUF_KEYS`); ``config`` fills what the file lacks (a value in both that
    differs is an error).  A required one in neither is a ``ValueError``: it is not
    guessed."""
    arch = ckpt.architecture
    config = ck.KIMI_K3.config(config or {}, "config")  # its aliases, as config.json's
    out: Dict[str, Any] = {}
    for name, key in GGUF_KEYS.items():
        key = key.format(arch=arch)
        if key in ckpt.metadata:
            # counts: stored as integers (a float, a bool or a string is refused, as
            # llama.cpp reads them as integers); the rest checked by block_config
            value = gguf_integer(ckpt, key) if name in _GGUF_COUNTS else ckpt.metadata[key]
            if name in config and not _same(value, config[name]):
                raise ValueError(f"{ckpt.root}: {key} is {value!r}, but config gives "
                                 f"{name} = {config[name]!r}")
            out[name] = value
        elif name in config:
            out[name] = config[name]
        elif name in _GGUF_OPTIONAL:
            out[name] = _GGUF_OPTIONAL[name]
        else:
            raise ValueError(f"{ckpt.root}: metadata key {key!r} is missing; pass "
                             f"config={{{name!r}: ...}} (config.json's value) to "
                             f"from_checkpoint")
    gating = gguf_integer_if_any(ckpt, GGUF_GATING_FUNC_KEY.format(arch=arch), low=0)
    if gating is not None and gating != GGUF_GATING_SIGMOID:
        raise ValueError(f"{ckpt.root}: {GGUF_GATING_FUNC_KEY.format(arch=arch)} is "
                         f"{gating!r}; Kimi K3's router is sigmoid ({GGUF_GATING_SIGMOID})")
    return out


def _gguf_dense(ckpt: GGUFCheckpoint, name: str, shape: tuple, what: str) -> torch.Tensor:
    """A dense tensor of the block: F32/F16/BF16 as a view of a mapping of just its bytes,
    other types (Q8_0, ...) dequantized once to float32; its shape checked."""
    require_tensor(ckpt, name, what)
    info = ckpt.tensor(name)
    if info.ggml_type == MXFP4:
        t = ckpt.dequantize(name)
    elif len(info.shape) >= 2 or (len(info.shape) == 1 and info.type_name in (
            "F32", "F16", "BF16", "F64")):
        t = ckpt.get_rows(name, 0, info.shape[0])
    else:
        t = ckpt.get(name)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{info.path}: tensor {name!r} ({what}) is {info.type_name} "
                         f"{list(t.shape)}, expected {list(shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{info.path}: tensor {name!r} ({what}) is {info.type_name}, "
                         f"expected a float type")
    return t


def from_gguf(cls, path, layer: int, expert_range=None, num_threads: Optional[int] = None,
              group=None, config: Optional[dict] = None) -> "KimiK3MoE":
    """:meth:`KimiK3MoE.from_checkpoint` of a GGUF file (llama.cpp's ``kimi-k3``): the
    routed experts as GGUF blocks read in place (views of a mapping of just the
    ``expert_range``'s bytes), the dense parts (router and its bias, latent projections
    and norm, shared experts) loaded once (:func:`_gguf_dense`), the hyperparameters from
    the metadata (:func:`gguf_config`)."""
    num_threads_arg(num_threads)  # before any file is read
    ckpt = ck.open_gguf(path)
    naming = ck.GGUF_KIMI_K3
    if ckpt.architecture not in naming.architectures:
        raise ValueError(f"{ckpt.root}: general.architecture is {ckpt.architecture!r}, "
                         f"expected {naming.architectures[0]!r} (llama.cpp's Kimi K3)")
    raw = gguf_config(ckpt, config)
    cfg = block_config(raw, f"{ckpt.root} (metadata or config)")
    n_experts = cfg["num_experts"]
    rng = expert_range_within(expert_range, n_experts, "the file's experts")
    name = naming.tensor(layer, "down")
    if name in ckpt and ckpt.tensor(name).shape[:1] != (n_experts,):
        raise ValueError(f"{ckpt.root}: tensor {name!r} holds {ckpt.tensor(name).shape[0]} "
                         f"experts, the metadata {n_experts}")
    blocks = ck.load_gguf_experts(ckpt, layer, rng, naming=naming)
    beta, linear_beta = situ_betas(raw, f"{ckpt.root} (metadata or config)")
    routed = KimiK3Experts((blocks["gate"], None), (blocks["up"], None),
                           (blocks["down"], None), beta=beta, linear_beta=linear_beta,
                           expert_range=rng, num_threads=num_threads, group=group)
    latent = routed.d_latent
    router_name = naming.router.format(layer=layer)
    require_tensor(ckpt, router_name, f"the router of layer {layer}")
    router_shape = ckpt.tensor(router_name).shape
    if len(router_shape) != 2:
        raise ValueError(f"{ckpt.root}: tensor {router_name!r} is {list(router_shape)}, "
                         f"expected (n_experts, hidden)")
    hidden = router_shape[1]
    gate_w = _gguf_dense(ckpt, router_name, (n_experts, hidden), "the router")
    bias = _gguf_dense(ckpt, str(naming.router_bias).format(layer=layer), (n_experts,),
                       "the router's score-correction bias")
    shared_name = str(naming.shared)
    sg_name = shared_name.format(layer=layer, proj="gate")
    require_tensor(ckpt, sg_name, "the shared experts' gate")
    d_shared = ckpt.tensor(sg_name).shape[0]
    # the shapes the safetensors path and KimiK3MoE check too (dense_shapes)
    shapes = dense_shapes(hidden, latent, d_shared)
    down_name, up_name, norm_name = (n.format(layer=layer) for n in naming.other)
    gguf_names = {"down_proj": down_name, "up_proj": up_name, "norm_weight": norm_name,
                  **{f"shared_{p}": shared_name.format(layer=layer, proj=p)
                     for p in ("gate", "up", "down")}}
    dense = {k: _gguf_dense(ckpt, gguf_names[k], shapes[k], DENSE_PARTS[k][0])
             for k in DENSE_PARTS if k != "norm_weight" or norm_name in ckpt}
    down, up, norm = dense["down_proj"], dense["up_proj"], dense.get("norm_weight")
    sg, su, sd = dense["shared_gate"], dense["shared_up"], dense["shared_down"]
    # the sizes the metadata states, where it does
    check_gguf_dims(ckpt, {
        "embedding_length": (hidden, f"tensor {router_name!r} has columns"),
        "expert_latent_length": (latent, "the routed experts' latents are"),
        "expert_feed_forward_length": (routed.d_ff, "the routed experts' width is")})
    router = KimiK3Router(gate_w, bias, top_k=cfg["num_experts_per_token"],
                          renormalize=cfg["moe_renormalize"],
                          scaling=cfg["routed_scaling_factor"],
                          n_group=cfg["num_expert_group"], topk_group=cfg["topk_group"])
    return cls(router, down, routed, norm, up, sg, su, sd, norm_eps=cfg["rms_norm_eps"])
