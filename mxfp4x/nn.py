"""torch.nn modules over the mxfp4x ops, each re-exported from the package it lives in: the
generic MXFP4 expert bank (:class:`MXFP4Experts`, ``mxfp4x.models.experts``) and the model
families' modules (``mxfp4x.models``): gpt-oss (GptOssMoE, GptOssRouter, GptOssExperts,
load_gpt_oss_experts) and Kimi K3 (KimiK3MoE, KimiK3Router, KimiK3Experts), with checkpoint
loading that maps, not copies, the packed bytes."""
from .models.experts import MXFP4Experts
from .models.gpt_oss import GptOssExperts, GptOssMoE, GptOssRouter, load_gpt_oss_experts
from .models.kimi_k3 import KimiK3Experts, KimiK3MoE, KimiK3Router

__all__ = ["MXFP4Experts", "GptOssExperts", "GptOssMoE", "GptOssRouter",
           "load_gpt_oss_experts", "KimiK3Experts", "KimiK3MoE", "KimiK3Router"]
