"""Kimi K3's block from the release's safetensors checkpoint (:func:`from_safetensors`,
which :meth:`KimiK3MoE.from_checkpoint` calls): a folder of ``config.json`` and one or
sharded ``.safetensors`` files, the tensors named as the family's registry entry names
them (``mxfp4x.checkpoints.families.KIMI_K3``)."""
import functools
import os
from typing import TYPE_CHECKING, Optional

from ..._core.progress import Progress
from ...checkpoints import families as ck
from .._common import _flag, check_dims, check_tensor, config_integer, expert_range_within
from .config import block_config, situ_betas
from .experts import KimiK3Experts
from .router import KimiK3Router
from .tensors import DENSE_PARTS, check_block

if TYPE_CHECKING:
    from .block import KimiK3MoE


def from_safetensors(cls, path, layer: int, expert_range=None,
                     num_threads: Optional[int] = None, progress: bool = True,
                     group=None) -> "KimiK3MoE":
    """:meth:`KimiK3MoE.from_checkpoint` of a safetensors checkpoint (``cls`` the block's
    class; ``num_threads`` checked already): the routed experts' bytes views of the
    files' mappings (only ``expert_range``'s), the router and the dense parts loaded
    once and checked against them (:func:`check_block`), the hyperparameters from its
    config.json (:func:`block_config`, :func:`situ_betas`), the sizes it states compared
    with the tensors'."""
    root = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path.root
    # every key under the name read here, as transformers' KimiLinearConfig takes it
    config = ck.KIMI_K3.config(ck.read_config(root), ck.config_path(root))
    hyper = block_config(config, ck.config_path(root))
    ckpt = ck.open_checkpoint(path)
    layout = ck.KIMI_K3
    n_experts = hyper["num_experts"]
    rng = expert_range_within(expert_range, n_experts, "the checkpoint's experts")
    ids = list(range(*rng))
    prefix = ck.find_prefix(ckpt, layout, layer, ids[0] if ids else 0)  # one it holds
    base = prefix + layout.block.format(layer=layer)
    bar = Progress(len(ids), f"layer {layer} experts") if progress else None
    proj = ck.load_experts(ckpt, layout, layer, ids, prefix, bar)
    beta, linear_beta = situ_betas(config)
    routed = KimiK3Experts(proj["gate"], proj["up"], proj["down"], beta=beta,
                           linear_beta=linear_beta, expert_range=rng,
                           num_threads=num_threads, group=group)
    source = ck.config_path(root)
    norm_flag = config.get("latent_moe_use_norm")  # missing or null: no norm
    use_norm = norm_flag is not None and _flag(f"{source}: latent_moe_use_norm",
                                               norm_flag)
    # router, then the dense parts by KimiK3MoE's argument names
    parts = {"router": "gate.weight", "router_bias": "gate.e_score_correction_bias"}
    parts.update({k: v[1] for k, v in DENSE_PARTS.items()
                  if use_norm or k != "norm_weight"})
    for k, n in parts.items():
        if base + n not in ckpt:
            why = (f" ({source} sets latent_moe_use_norm)" if k == "norm_weight" else "")
            raise ValueError(f"{ckpt.root}: no tensor {base + n!r} "
                             f"({DENSE_PARTS.get(k, ('the router',))[0]} of layer "
                             f"{layer}){why}")
    got = ckpt.get_many([base + n for n in parts.values()])
    dense = {k: got[base + n] for k, n in parts.items()}
    names = {k: f"{ckpt.byte_range(base + n)[0]}: tensor {base + n!r}"
             for k, n in parts.items()}
    rows = check_tensor(names["router"], dense["router"], (None, None),
                        "the router: n_experts by hidden").shape[0]
    if rows != n_experts:
        raise ValueError(f"{names['router']}: the router scores {rows} experts, "
                         f"config.json's num_experts is {n_experts}")
    norm = dense.get("norm_weight")
    sizes = check_block(dense["router"], routed, {**dense, "norm_weight": norm}, names)
    stated = functools.partial(config_integer, config, source)
    shared = stated("num_shared_experts")
    check_dims(source, {
        "hidden_size": (stated("hidden_size"), sizes["hidden"],
                        f"tensor {base + parts['router']!r} has columns"),
        "routed_expert_hidden_size": (stated("routed_expert_hidden_size"),
                                      sizes["latent"], "the routed experts' latents are"),
        "moe_intermediate_size": (stated("moe_intermediate_size"), routed.d_ff,
                                  "the routed experts' width is"),
        "moe_intermediate_size x num_shared_experts": (
            None if shared is None else routed.d_ff * shared, sizes["d_shared"],
            f"tensor {base + parts['shared_gate']!r} has rows")})
    router = KimiK3Router(
        dense["router"], dense["router_bias"],
        top_k=hyper["num_experts_per_token"], renormalize=hyper["moe_renormalize"],
        scaling=hyper["routed_scaling_factor"], n_group=hyper["num_expert_group"],
        topk_group=hyper["topk_group"])
    return cls(router, dense["down_proj"], routed, norm, dense["up_proj"],
               dense["shared_gate"], dense["shared_up"], dense["shared_down"],
               norm_eps=hyper["rms_norm_eps"])
