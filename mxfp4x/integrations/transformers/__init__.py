"""Hugging Face transformers models with their experts kept MXFP4, run on mxfp4x.

    import mxfp4x.integrations.transformers as mxt
    model = mxt.from_pretrained("openai/gpt-oss-20b", dtype=torch.bfloat16)

The door is transformers' own quantization hook: importing this module registers the
quantization method ``"mxfp4x"`` (:class:`Mxfp4xConfig`, :class:`Mxfp4xHfQuantizer`).
On the meta-device model, before any weight is read, the quantizer replaces each
gpt-oss experts module the file stores in MXFP4 by :class:`GptOssMxfp4Experts`, whose
uint8 buffers carry the checkpoint's own names (``gate_up_proj_blocks``,
``gate_up_proj_scales``, ``down_proj_blocks``, ``down_proj_scales``; the biases are
parameters), so transformers' loader copies the checkpoint's bytes into them as they
are: no expert ever exists as a dense float tensor, unless ``modules_to_not_convert``
asks for it. Everything else (attention, router, embeddings, ``generate``,
``save_pretrained``) is plain transformers.

A gpt-oss checkpoint names its format ``quant_method: "mxfp4"``, and transformers refuses
a ``quantization_config`` of another class for it; :func:`from_pretrained` therefore reads
the config and hands transformers one whose quantization config is ``"mxfp4x"``.
:class:`Mxfp4xConfig` is written back as ``"mxfp4"`` (the format of the bytes), so what
``save_pretrained`` writes is a plain gpt-oss MXFP4 checkpoint.

A checkpoint with dense experts (Qwen3-MoE, Mixtral, DeepSeek-style, gpt-oss in bf16)
loads through the same door: the experts modules keep their class, and their dense
weights become uint8 buffers that :class:`Mxfp4xQuantize` fills as transformers' loader
hands over each layer's merged tensor; their forward becomes transformers' experts
implementation ``"mxfp4x"`` (:func:`mxfp4x_experts_forward`, registered in its experts
interface), so the model's own routing, activation and biases run around mxfp4x's
kernels. Plain ``AutoModelForCausalLM.from_pretrained(path,
quantization_config=Mxfp4xConfig())`` works for these once this module is imported.

Importing the package registers all three: the quantization method (``_quantizer.py``),
the experts implementation (``_dense_experts.py``) and the attention ``"mxfp4x_grouped"``
(``_attention.py``). The rest, one job a file: ``_config.py`` (:class:`Mxfp4xConfig`),
``_gpt_oss_experts.py`` (:class:`GptOssMxfp4Experts`, :func:`split_devices`),
``_checkpoint_files.py`` (what the file holds, read from its headers),
``_dense_linear.py`` (:class:`DenseLinear`), ``_decode.py`` (:class:`DecodeAttention`, a
decoding step's attention as one compiled call), ``_cache.py`` (:class:`GrowingCache`, the
key/value cache ``generate`` takes for the door's models), ``_from_pretrained.py``.
"""
from ._attention import ATTENTION, grouped_attention
from ._cache import GrowingCache, GrowingLayer, GrowingSlidingWindowLayer, use_growing_cache
from ._config import Mxfp4xConfig
from ._decode import DecodeAttention, DecodeLayer, DecodeMLP, use_decode_attention
from ._dense_experts import Mxfp4xQuantize, mxfp4x_experts_forward
from ._dense_linear import CompiledRMSNorm, DenseLinear, DenseRouter, use_dense_kernels
from ._from_pretrained import from_pretrained
from ._gpt_oss_experts import GptOssMxfp4Experts, split_devices
from ._quantizer import Mxfp4xHfQuantizer

__all__ = ["from_pretrained", "split_devices", "Mxfp4xConfig", "Mxfp4xHfQuantizer",
           "GptOssMxfp4Experts", "Mxfp4xQuantize", "mxfp4x_experts_forward", "DenseLinear",
           "DenseRouter", "CompiledRMSNorm",
           "use_dense_kernels", "grouped_attention", "ATTENTION", "GrowingCache",
           "GrowingLayer", "GrowingSlidingWindowLayer", "use_growing_cache",
           "DecodeAttention", "DecodeLayer", "DecodeMLP", "use_decode_attention"]
