"""Kimi K3's hyperparameters read from its config (config.json's text_config names, as
transformers' KimiLinearConfig reads them), each checked, and the released model's sizes."""
from typing import Any, Dict

from .._common import _flag, _integer, _positive, _real, check_routing

# the released model's sizes (config.json's text_config)
K3_SIZES = dict(hidden_size=7168, routed_expert_hidden_size=3584, num_experts=896,
                num_experts_per_token=16, moe_intermediate_size=3072, num_shared_experts=2,
                num_hidden_layers=93, first_k_dense_replace=1)


def block_config(config: dict, source: str) -> Dict[str, Any]:
    """The block's hyperparameters from ``config`` (config.json's names), each checked:
    ``num_experts`` and ``num_experts_per_token`` required; the group counts 1 where
    missing or null (no grouped routing); ``routed_scaling_factor`` 1.0, ``moe_renormalize``
    true and ``rms_norm_eps`` 1e-5 where missing.  A ValueError naming ``source`` and the
    key otherwise (a missing key, a string, a null)."""
    def get(name, default=None, required=False):
        if name not in config:
            if required:
                raise ValueError(f"{source}: {name!r} is missing")
            return default
        return config[name]

    n_experts = _integer(f"{source}: num_experts", get("num_experts", required=True))
    groups = get("num_expert_group")
    chosen = get("topk_group")
    top_k, n_group, topk_group = check_routing(
        n_experts, get("num_experts_per_token", required=True),
        1 if groups is None else groups, 1 if chosen is None else chosen, source)
    eps = _real(f"{source}: rms_norm_eps", get("rms_norm_eps", 1e-5))
    if eps <= 0:
        raise ValueError(f"{source}: rms_norm_eps: expected a positive number, got {eps!r}")
    return dict(num_experts=n_experts, num_experts_per_token=top_k, num_expert_group=n_group,
                topk_group=topk_group,
                routed_scaling_factor=_real(f"{source}: routed_scaling_factor",
                                            get("routed_scaling_factor", 1.0)),
                moe_renormalize=_flag(f"{source}: moe_renormalize",
                                      get("moe_renormalize", True)),
                rms_norm_eps=eps)


def situ_betas(config: dict, source: str = "config.json"):
    """(beta, linear_beta) of SiTU from a K3 text config.  The released config states
    both (4.0 and 25.0); the public ports disagree on what a missing key means (1.0 in
    some readers, 4.0 in others), so a config without them is refused rather than
    guessed.  ``activation_situ_linear_beta`` may be null (no clip on the up branch)."""
    for key in ("activation_situ_beta", "activation_situ_linear_beta"):
        if key not in config:
            raise ValueError(f"{source}: {key!r} is missing; Kimi K3's config states it "
                             f"(4.0 and 25.0 as released)")
    beta = _positive(f"{source}: activation_situ_beta", config["activation_situ_beta"])
    linear = config["activation_situ_linear_beta"]
    return beta, None if linear is None else _positive(
        f"{source}: activation_situ_linear_beta", linear)
