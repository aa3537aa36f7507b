"""Hugging Face transformers models with their experts kept MXFP4, run on mxfp4x.

    import mxfp4x.integrations.transformers as mxt
    model = mxt.from_pretrained("openai/gpt-oss-20b", dtype=torch.bfloat16)

The door is transformers' own quantization hook: importing this module registers the
quantization method ``"mxfp4x"`` (:class:`Mxfp4xConfig`, :class:`Mxfp4xHfQuantizer`).
On the meta-device model, before any weight is read, the quantizer replaces every
gpt-oss experts module by :class:`GptOssMxfp4Experts`, whose uint8 buffers carry the
checkpoint's own names (``gate_up_proj_blocks``, ``gate_up_proj_scales``,
``down_proj_blocks``, ``down_proj_scales``; the biases are parameters), so transformers'
loader copies the checkpoint's bytes into them as they are: no expert ever exists as a
dense float tensor. Everything else (attention, router, embeddings, ``generate``,
``save_pretrained``) is plain transformers.

A gpt-oss checkpoint names its format ``quant_method: "mxfp4"``, and transformers refuses
a ``quantization_config`` of another class for it; :func:`from_pretrained` therefore reads
the config and hands transformers one whose quantization config is ``"mxfp4x"``.
:class:`Mxfp4xConfig` is written back as ``"mxfp4"`` (the format of the bytes), so what
``save_pretrained`` writes is a plain gpt-oss MXFP4 checkpoint.
"""
from typing import Any, Dict, Optional

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from .._format import GROUP, GROUP_BYTES
from ..models.gpt_oss import gpt_oss_experts

__all__ = ["from_pretrained", "Mxfp4xConfig", "Mxfp4xHfQuantizer", "GptOssMxfp4Experts"]

QUANT_METHOD = "mxfp4x"
_FILE_FORMAT = "mxfp4"  # what the checkpoints we read (and write) call their format
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
               "subfolder", "token", "trust_remote_code", "code_revision")


class Mxfp4xConfig(QuantizationConfigMixin):
    """Load an MXFP4 checkpoint with its experts kept MXFP4 and run by mxfp4x.

    ``num_threads``: the threads of each experts call (None: mxfp4x's default).
    ``modules_to_not_convert``: kept from the checkpoint's config and written back.

    Serialized (``to_dict``, hence ``config.json``) as the checkpoint format,
    ``quant_method: "mxfp4"``: the bytes saved are the released layout, readable by any
    MXFP4 loader; mxfp4x is how they run, not a format.
    """

    def __init__(self, modules_to_not_convert: Optional[list] = None,
                 num_threads: Optional[int] = None, **kwargs):
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]  # not in their enum
        self.modules_to_not_convert = modules_to_not_convert
        self.num_threads = num_threads

    def to_dict(self) -> Dict[str, Any]:
        return {"quant_method": _FILE_FORMAT,
                "modules_to_not_convert": self.modules_to_not_convert}

    def __repr__(self) -> str:
        return (f"Mxfp4xConfig(num_threads={self.num_threads}, "
                f"modules_to_not_convert={self.modules_to_not_convert})")


class GptOssMxfp4Experts(torch.nn.Module):
    """transformers' ``GptOssExperts`` with its experts in MXFP4: the same forward
    signature ``(hidden_states (T, H), router_indices (T, K), routing_weights (T, K))``,
    computed as :class:`mxfp4x.nn.GptOssExperts` computes it (autograd included: the
    gradient flows to the hidden states, the routing weights and the biases; the bytes are
    frozen).

    Buffers under the checkpoint's names: ``gate_up_proj_blocks`` (E, 2F, H/32, 16),
    ``gate_up_proj_scales`` (E, 2F, H/32), ``down_proj_blocks`` (E, H, F/32, 16),
    ``down_proj_scales`` (E, H, F/32), uint8; parameters ``gate_up_proj_bias`` (E, 2F) and
    ``down_proj_bias`` (E, H). Built empty (on the meta device while transformers loads),
    filled by the loader."""

    gate_up_proj_blocks: torch.Tensor
    gate_up_proj_scales: torch.Tensor
    down_proj_blocks: torch.Tensor
    down_proj_scales: torch.Tensor

    def __init__(self, config, bias_dtype: Optional[torch.dtype] = None,
                 num_threads: Optional[int] = None):
        super().__init__()
        e, h, f = config.num_local_experts, config.hidden_size, config.intermediate_size
        if h % GROUP or f % GROUP:
            raise ValueError(f"hidden_size {h} and intermediate_size {f}: MXFP4 experts need "
                             f"multiples of {GROUP}")
        self.limit = float(config.swiglu_limit)
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.num_threads = num_threads
        u8 = torch.uint8
        self.register_buffer("gate_up_proj_blocks",
                             torch.zeros((e, 2 * f, h // GROUP, GROUP_BYTES), dtype=u8))
        self.register_buffer("gate_up_proj_scales", torch.zeros((e, 2 * f, h // GROUP), dtype=u8))
        self.register_buffer("down_proj_blocks",
                             torch.zeros((e, h, f // GROUP, GROUP_BYTES), dtype=u8))
        self.register_buffer("down_proj_scales", torch.zeros((e, h, f // GROUP), dtype=u8))
        self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros((e, 2 * f), dtype=bias_dtype))
        self.down_proj_bias = torch.nn.Parameter(torch.zeros((e, h), dtype=bias_dtype))

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        return gpt_oss_experts(hidden_states, router_indices, routing_weights,
                               (self.gate_up_proj_blocks, self.gate_up_proj_scales),
                               self.gate_up_proj_bias,
                               (self.down_proj_blocks, self.down_proj_scales),
                               self.down_proj_bias, limit=self.limit, alpha=self.alpha,
                               num_threads=self.num_threads)

    def extra_repr(self) -> str:
        e, two_f, g, _ = self.gate_up_proj_blocks.shape
        return f"n_experts={e}, hidden_size={GROUP * g}, intermediate_size={two_f // 2}"


class Mxfp4xHfQuantizer(HfQuantizer):
    """transformers' quantizer of the ``"mxfp4x"`` method: swaps the experts modules of the
    meta-device model for :class:`GptOssMxfp4Experts` before the weights are read; nothing
    is converted while loading (the modules take the checkpoint's tensors as they are)."""

    requires_calibration = False
    quantization_config: Mxfp4xConfig

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        if not self.pre_quantized:
            raise ValueError("mxfp4x loads checkpoints already in MXFP4 (e.g. gpt-oss); it "
                             "does not quantize dense weights at load")

    def _process_model_before_weight_loading(self, model, **kwargs):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

        config = model.config.get_text_config()
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, HfExperts)]
        if not found:
            raise ValueError(f"mxfp4x: no gpt-oss experts in {type(model).__name__}; the "
                             f"transformers integration supports gpt-oss models only")
        for name, module in found:
            with torch.device("meta"):
                new = GptOssMxfp4Experts(config, bias_dtype=module.gate_up_proj_bias.dtype,
                                         num_threads=self.quantization_config.num_threads)
            model.set_submodule(name, new)
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # the bytes are frozen; gradients flow through them (LoRA-style)

    @property
    def is_compileable(self) -> bool:
        return True


if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:  # not twice on a module reload
    register_quantization_config(QUANT_METHOD)(Mxfp4xConfig)
if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantizer(QUANT_METHOD)(Mxfp4xHfQuantizer)


def from_pretrained(pretrained_model_name_or_path, *model_args,
                    num_threads: Optional[int] = None, **kwargs):
    """A gpt-oss MXFP4 checkpoint (a folder or a Hub id) as a transformers
    ``AutoModelForCausalLM`` whose experts stay MXFP4 and run on mxfp4x.

    ``kwargs`` go to transformers' ``from_pretrained`` (``dtype``/``torch_dtype``,
    ``revision``, ``config``, ...); ``num_threads`` (or ``quantization_config=
    Mxfp4xConfig(num_threads=...)``) sets the threads of each experts call. The expert
    bytes go from the file into uint8 buffers; no dense copy of an expert is ever made.
    """
    qc = kwargs.pop("quantization_config", None)
    if qc is not None and not isinstance(qc, Mxfp4xConfig):
        raise TypeError(f"quantization_config: expected an Mxfp4xConfig or None, got "
                        f"{type(qc).__name__}")
    config = kwargs.pop("config", None)
    if config is None:
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
    found = getattr(config, "quantization_config", None)
    if found is None:
        raise ValueError(f"{pretrained_model_name_or_path}: its config has no "
                         f"quantization_config; expected an MXFP4 checkpoint (quant_method "
                         f"'mxfp4', as gpt-oss is released)")
    method = found.get("quant_method") if isinstance(found, dict) else found.quant_method
    method = getattr(method, "value", method)
    if method not in (_FILE_FORMAT, QUANT_METHOD):
        raise ValueError(f"{pretrained_model_name_or_path}: quant_method {method!r}; mxfp4x "
                         f"loads MXFP4 checkpoints (quant_method 'mxfp4')")
    skip = (found.get("modules_to_not_convert") if isinstance(found, dict)
            else getattr(found, "modules_to_not_convert", None))
    threads = num_threads if num_threads is not None else getattr(qc, "num_threads", None)
    # a dict, as config.json holds it: transformers dispatches on its quant_method
    config.quantization_config = {"quant_method": QUANT_METHOD, "num_threads": threads,
                                  "modules_to_not_convert": skip}
    return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                config=config, **kwargs)
