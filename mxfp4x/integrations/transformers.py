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
"""
import copy
from typing import Any, Dict, Optional

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import ConversionOps
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils import logging
from transformers.utils.quantization_config import QuantizationConfigMixin

from .. import _dense
from .._api import mxfp4_experts, mxfp4_experts_slots
from .._format import GROUP, GROUP_BYTES, accumulation_dtype
from .._quantize import SCALE_RULES, dequantize, quantize
from .._validation import bytes_by_view, num_threads_arg
from ..models._common import BytesByView, view_loaded_bytes_hook
from ..models.gpt_oss import gpt_oss_experts

__all__ = ["from_pretrained", "Mxfp4xConfig", "Mxfp4xHfQuantizer", "GptOssMxfp4Experts",
           "Mxfp4xQuantize", "mxfp4x_experts_forward", "DenseLinear", "use_dense_kernels",
           "grouped_attention", "ATTENTION"]

_LOG = logging.get_logger(__name__)
QUANT_METHOD = "mxfp4x"
_FILE_FORMAT = "mxfp4"  # what the checkpoints we read (and write) call their format
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision",
               "subfolder", "token", "trust_remote_code", "code_revision")


class Mxfp4xConfig(QuantizationConfigMixin):
    """Run a transformers MoE model with its experts in MXFP4 on mxfp4x.

    For a checkpoint already in MXFP4 (gpt-oss as released) the experts' bytes are taken
    as they are. For a checkpoint with dense experts (Qwen3-MoE, Mixtral, DeepSeek-style,
    gpt-oss in bf16: every model whose experts module transformers routes through its
    experts interface) each expert tensor is quantized to MXFP4 as it is loaded.

    ``num_threads``: the threads of each experts call (None: mxfp4x's default).
    ``scale_rule``: how dense weights get their E8M0 scales (``mxfp4x.quantize``:
    ``"floor"``, OCP MX v1.0; ``"ceil"``; ``"even"``).
    ``modules_to_not_convert``: modules left dense (name patterns, as transformers takes
    them): transformers' own modules and forward.  For an MXFP4 checkpoint the list is
    its config's plus this one, written back with it; an experts module it names that the
    file stores in MXFP4 is dequantized from the file's bytes (exactly, in the model's
    dtype) into transformers' module, one the file stores dense keeps those weights.
    ``dense_kernels``: the model's bfloat16 ``nn.Linear`` layers (attention projections,
    the head) run on mxfp4x's dense kernel at up to 4 tokens (decode; see
    :class:`DenseLinear`); ``False`` leaves them to torch.

    An MXFP4 checkpoint's config is written back (``to_dict``, hence ``config.json``) as
    the checkpoint format, ``quant_method: "mxfp4"``: the bytes saved are the released
    layout, readable by any MXFP4 loader; mxfp4x is how they run, not a format.
    """

    def __init__(self, modules_to_not_convert: Optional[list] = None,
                 num_threads: Optional[int] = None, scale_rule: str = "floor",
                 dense_kernels: bool = True, **kwargs):
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule: expected one of {SCALE_RULES}, got {scale_rule!r}")
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]  # not in their enum
        self.modules_to_not_convert = modules_to_not_convert
        self.num_threads = num_threads_arg(num_threads)  # the op's rule, before any loading
        self.scale_rule = scale_rule
        self.dense_kernels = bool(dense_kernels)

    def to_dict(self) -> Dict[str, Any]:
        return {"quant_method": _FILE_FORMAT,
                "modules_to_not_convert": self.modules_to_not_convert}

    def __repr__(self) -> str:
        return (f"Mxfp4xConfig(num_threads={self.num_threads}, scale_rule={self.scale_rule!r}, "
                f"modules_to_not_convert={self.modules_to_not_convert})")


class GptOssMxfp4Experts(BytesByView):
    """transformers' ``GptOssExperts`` with its experts in MXFP4: the same forward
    signature ``(hidden_states (T, H), router_indices (T, K), routing_weights (T, K))``,
    computed as :class:`mxfp4x.nn.GptOssExperts` computes it (autograd included: the
    gradient flows to the hidden states, the routing weights and the biases; the bytes are
    frozen).

    Buffers under the checkpoint's names: ``gate_up_proj_blocks`` (E, 2F, H/32, 16),
    ``gate_up_proj_scales`` (E, 2F, H/32), ``down_proj_blocks`` (E, H, F/32, 16),
    ``down_proj_scales`` (E, H, F/32), uint8; parameters ``gate_up_proj_bias`` (E, 2F) and
    ``down_proj_bias`` (E, H). Built empty (on the meta device while transformers loads),
    filled by the loader.

    The bytes are read by view, never cast by value: a tensor put in a buffer's place
    (transformers' loader assigns them) or loaded by ``load_state_dict``, typed int8 or
    float8_e8m0fnu as checkpoints may store them, becomes its uint8 view (a cast would turn
    E8M0 byte s into the integer part of 2^(s-127), 0 below 127); any other dtype is a
    TypeError naming the buffer."""

    _byte_buffers = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                     "down_proj_scales")
    _mxfp4x_name = ""  # the module's name in the model, for errors ("model.layers.0...")
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

    def __setattr__(self, name, value):
        if name in self._byte_buffers and isinstance(value, torch.Tensor) and \
                value.dtype != torch.uint8:
            viewed = bytes_by_view(self._mxfp4x_name + name, value)
            if getattr(value, "_is_hf_initialized", False):  # transformers' loaded mark
                viewed._is_hf_initialized = True  # type: ignore[attr-defined]
            value = viewed
        super().__setattr__(name, value)

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


# ---- dense experts, quantized at load -------------------------------------------------

_DENSE_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def _dense_experts_modules(model):
    """(name, module, weights) of every experts module transformers routes through its
    experts interface (``@use_experts_implementation``: it has ``has_gate`` and
    ``is_transposed``) whose weights are 3-D parameters."""
    found = []
    for name, module in model.named_modules():
        if not (hasattr(module, "has_gate") and hasattr(module, "is_transposed")):
            continue
        weights = [w for w in _DENSE_WEIGHTS if isinstance(module._parameters.get(w),
                                                           torch.nn.Parameter)]
        if "down_proj" in weights and len(weights) == 2 and all(
                module._parameters[w].dim() == 3 for w in weights):
            found.append((name, module, weights))
    return found


def _mxfp4_layout(module, weight: str):
    """(E, O, I) of a dense experts weight as mxfp4x holds it: rows O, groups along I
    (transformers' transposed experts store (E, I, O))."""
    e, a, b = module._parameters[weight].shape
    return (e, b, a) if module.is_transposed else (e, a, b)


def _whole_groups(found) -> Dict[str, Dict[str, tuple]]:
    """{name: {weight: (E, O, I)}} of the experts modules ``found`` (name, module,
    weights); a ValueError naming every module whose input width is not whole groups of
    32, and the ``modules_to_not_convert`` list that leaves them dense."""
    shapes: Dict[str, Dict[str, tuple]] = {}
    odd = []
    for name, module, weights in found:
        shapes[name] = {w: _mxfp4_layout(module, w) for w in weights}
        widths = [f"{w} {i}" for w, (_, _, i) in shapes[name].items() if i % GROUP]
        if widths:
            odd.append((name, widths))
    if odd:
        names = [name for name, _ in odd]
        every = " (all the experts modules left to quantize: nothing is then quantized, " \
                "and the model is transformers' own)" if len(odd) == len(found) else ""
        raise ValueError(f"{len(odd)} experts module(s) with an input width that is not a "
                         f"multiple of {GROUP} (MXFP4 needs whole groups of {GROUP}; "
                         f"{odd[0][0]}: {', '.join(odd[0][1])}). Leave them dense, on "
                         f"transformers' own forward, with Mxfp4xConfig("
                         f"modules_to_not_convert={names!r}){every}")
    return shapes


def _swap_to_mxfp4(module, shapes):
    """On the meta model: each dense experts weight becomes the uint8 buffers ``<w>``
    (E, O, I/32, 16) and ``<w>_scales`` (E, O, I/32), filled by :class:`Mxfp4xQuantize`
    as the checkpoint's tensors arrive; the module's forward becomes the ``"mxfp4x"``
    experts implementation.  ``shapes``: {weight: (E, O, I)}, I whole groups."""
    for weight, (e, o, i) in shapes.items():
        del module._parameters[weight]
        with torch.device("meta"):
            module.register_buffer(weight, torch.empty((e, o, i // GROUP, GROUP_BYTES),
                                                       dtype=torch.uint8))
            module.register_buffer(weight + "_scales", torch.empty((e, o, i // GROUP),
                                                                   dtype=torch.uint8))
    module._mxfp4x_weights = tuple(shapes)
    # load_state_dict reads int8 / float8_e8m0fnu entries for the bytes by view
    module._mxfp4x_byte_buffers = tuple(shapes) + tuple(w + "_scales" for w in shapes)
    module.register_load_state_dict_pre_hook(view_loaded_bytes_hook)
    # every experts module of the model reads this (shared) config: the ones left dense by
    # modules_to_not_convert go on with the implementation they had (mxfp4x_experts_forward)
    config = module.config
    if not hasattr(config, "_mxfp4x_dense_implementation"):
        config._mxfp4x_dense_implementation = config._experts_implementation_internal
    config._experts_implementation_internal = QUANT_METHOD


class Mxfp4xQuantize(ConversionOps):
    """transformers' load-time conversion of a dense experts weight (E, O, I), or its
    transposed (E, I, O), to MXFP4: ``<w>`` (E, O, I/32, 16) and ``<w>_scales`` (E, O,
    I/32) uint8, one expert at a time (the peak is the dense tensor the loader built,
    plus one expert in float64)."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict, model=None, **kwargs):
        from transformers.quantizers.quantizers_utils import get_module_from_name

        rule = self.hf_quantizer.quantization_config.scale_rule
        out = {}
        for key, value in input_dict.items():
            dense = value[0] if isinstance(value, list) else value
            module, weight = get_module_from_name(model, key)
            e, o, n_groups, _ = getattr(module, weight).shape  # the meta buffer
            i = GROUP * n_groups
            want = (e, i, o) if module.is_transposed else (e, o, i)
            if tuple(dense.shape) != want:
                raise ValueError(f"{key}: expected a dense tensor of shape {want}, got "
                                 f"{tuple(dense.shape)}")
            blocks = torch.empty((e, o, i // GROUP, GROUP_BYTES), dtype=torch.uint8)
            scales = torch.empty((e, o, i // GROUP), dtype=torch.uint8)
            for x in range(e):
                w = dense[x].t() if module.is_transposed else dense[x]
                blocks[x], scales[x] = quantize(w.contiguous(), scale_rule=rule)
            out[key], out[key + "_scales"] = blocks, scales
            del dense
        return out


def mxfp4x_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface ``"mxfp4x"``: the forward of any experts module
    decorated with ``@use_experts_implementation`` (gated or not, concatenated or
    interleaved gate/up through the module's own ``_apply_gate``, biases, a post-expert
    norm), its weights MXFP4 (``<w>`` / ``<w>_scales`` uint8 buffers). Accumulates in
    float32 (float64 for float64) and returns the hidden states' dtype."""
    if not hasattr(self, "_mxfp4x_weights"):
        dense = getattr(self.config, "_mxfp4x_dense_implementation", QUANT_METHOD)
        original = getattr(type(self).forward, "__wrapped__", None)
        if dense == QUANT_METHOD or original is None:
            raise ValueError(f"experts_implementation 'mxfp4x': {type(self).__name__} holds "
                             f"dense weights; load the model with quantization_config="
                             f"Mxfp4xConfig() (mxfp4x.integrations.transformers."
                             f"from_pretrained)")
        # left dense by modules_to_not_convert: the implementation the model had
        return ALL_EXPERTS_FUNCTIONS.get_interface(dense, original)(
            self, hidden_states, top_k_index, top_k_weights)
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError("experts_implementation 'mxfp4x' does not run transformers' "
                                  "expert parallelism; use mxfp4x.distributed")
    threads = getattr(self, "_mxfp4x_threads", None)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    h = mxfp4_experts_slots(hidden_states, getattr(self, up), getattr(self, up + "_scales"),
                            top_k_index, num_threads=threads)
    acc = accumulation_dtype(h.dtype)
    h = h.to(acc)
    if self.has_bias:
        h = h + getattr(self, up + "_bias")[top_k_index].to(acc)
    act = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    weights = top_k_weights.to(acc)
    if getattr(self, "has_post_expert_norm", False):
        y = mxfp4_experts_slots(act, self.down_proj, self.down_proj_scales, top_k_index,
                                num_threads=threads).to(acc)
        if self.has_bias:
            y = y + self.down_proj_bias[top_k_index].to(acc)
        out = (self.post_expert_norm(y).to(acc) * weights.unsqueeze(-1)).sum(1)
    else:
        if self.has_bias:
            shared = (weights.unsqueeze(-1) * self.down_proj_bias[top_k_index].to(acc)).sum(1)
        else:
            shared = act.new_zeros((act.shape[0], self.down_proj.shape[1]))
        out = mxfp4_experts(act, self.down_proj, self.down_proj_scales, top_k_index, weights,
                            shared, num_threads=threads)
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(QUANT_METHOD, mxfp4x_experts_forward)


class DenseLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward, for bfloat16 weights at up to 4 tokens on CPU
    without autograd, runs mxfp4x's dense kernel (``mxfp4x._dense.linear``: the weight
    widened to float32 exactly, float32 products and sums, the bias added in float32,
    one rounding; torch's bf16 matrix-vector product reads the weight at about half the
    memory's rate).  Anything else is ``F.linear``.  Modules become this class in place
    (:func:`use_dense_kernels`): same parameters, same state dict."""

    _mxfp4x_threads: Optional[int] = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _dense.takes(input, self.weight):
            return _dense.linear(input, self.weight, self.bias,
                                 num_threads=self._mxfp4x_threads)
        return torch.nn.functional.linear(input, self.weight, self.bias)


def use_dense_kernels(model: torch.nn.Module, num_threads: Optional[int] = None) -> int:
    """Every plain ``nn.Linear`` of ``model`` with a bfloat16 weight becomes a
    :class:`DenseLinear` in place; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16:
            module.__class__ = DenseLinear
            module._mxfp4x_threads = num_threads  # type: ignore[assignment]
            n += 1
    return n


# ---- attention with the query heads grouped by their key/value head ---------------------

ATTENTION = "mxfp4x_grouped"  # its name in transformers' attention interface


def grouped_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                      scaling: float, dropout: float = 0.0,
                      s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers' eager attention, its query heads grouped by the key/value head they
    share instead of the keys and values copied once per query head (``repeat_kv``).

    With ``s_aux`` (gpt-oss's sinks: one more logit per head) it computes what gpt-oss's
    ``eager_attention_forward`` computes, step for step: the scores times ``scaling``, the
    additive mask, the sink logit appended, the row's maximum subtracted, the softmax in the
    scores' dtype, the sink dropped, dropout, the weights in the values' dtype times the
    values; without, Llama's (softmax in float32, back to the query's dtype).  Query head
    h reads key/value head h // (heads / key-value heads), as ``repeat_kv`` arranges them;
    the grouping changes the batch of each product, not what a head's scores add up.

    gpt-oss cannot take ``sdpa`` (its sinks), so on a CPU transformers runs it eager, and
    the eager form copies every layer's keys and values eight times per step: one
    full-attention layer's attention at one token with 4096 tokens cached took 27 ms in
    bfloat16 there and 0.9 ms here (2 cores of an AMD EPYC Zen 4; 0.28 against 0.16 ms
    with 128).  :func:`from_pretrained` picks it for gpt-oss models unless an attention is
    asked for."""
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query: {hq} heads, not a multiple of the {hkv} key/value heads")
    g = hq // hkv
    scores = torch.matmul(query.reshape(b, hkv, g * tq, d), key.transpose(2, 3))
    scores = scores.view(b, hq, tq, tk) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., :tk]
    if s_aux is not None:
        logits = torch.cat([scores, s_aux.reshape(1, -1, 1, 1).expand(b, -1, tq, -1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.nn.functional.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        weights = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        weights = weights.to(value.dtype)
    else:
        weights = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.reshape(b, hkv, g * tq, tk), value).view(b, hq, tq, d)
    return out.transpose(1, 2).contiguous(), weights


AttentionInterface.register(ATTENTION, grouped_attention)
AttentionMaskInterface.register(ATTENTION, eager_mask)  # its masks are eager's


# ---- what the checkpoint holds ----------------------------------------------------------

_GPT_OSS_MXFP4 = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                  "down_proj_scales")
_GPT_OSS_DENSE = ("gate_up_proj", "down_proj")
_GPT_OSS_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def _checkpoint_names(checkpoint_files) -> Optional[set]:
    """The names of the tensors in the checkpoint's safetensors files (their headers
    only); None where they cannot be known (no files: a ``state_dict``; another format)."""
    if not checkpoint_files:
        return None
    from safetensors import safe_open

    names: set = set()
    for path in checkpoint_files:
        if not str(path).endswith(".safetensors"):
            return None
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    return names


def _mxfp4_tensors(names: Optional[set]) -> list:
    """The experts' MXFP4 tensors of a checkpoint: each ``*experts*_blocks`` name whose
    ``_scales`` twin is there too."""
    if names is None:
        return []
    return sorted(n for n in names if n.endswith("_blocks") and "experts" in n and
                  n[:-len("_blocks")] + "_scales" in names)


def _gpt_oss_stored(name: str, names: set, prefix: str) -> str:
    """How the checkpoint stores the gpt-oss experts module ``name``: ``"mxfp4"``
    (blocks and scales) or ``"dense"`` (transformers' ``gate_up_proj``, ``down_proj``),
    biases in both; a ValueError naming the module and what it lacks (transformers would
    leave those tensors at its random initialisation, and the logits wrong)."""
    held: set = set()
    every = _GPT_OSS_MXFP4 + _GPT_OSS_DENSE + _GPT_OSS_BIASES
    # the file's names may lack the model's prefix ("model."), or carry one it lacks
    for base in dict.fromkeys((name, name.removeprefix(prefix + "."), f"{prefix}.{name}")):
        held = {t for t in every if f"{base}.{t}" in names}
        if held:
            break
    mxfp4 = held & set(_GPT_OSS_MXFP4)
    dense = held & set(_GPT_OSS_DENSE)
    if mxfp4 and dense:
        raise ValueError(f"{name}: the checkpoint holds its experts both in MXFP4 "
                         f"({', '.join(sorted(mxfp4))}) and dense ({', '.join(sorted(dense))})"
                         f"; expected one or the other")
    if not (mxfp4 or dense):
        raise ValueError(f"{name}: the checkpoint holds no weights of these experts (in "
                         f"MXFP4: {', '.join(name + '.' + t for t in _GPT_OSS_MXFP4)}; or "
                         f"dense: {', '.join(_GPT_OSS_DENSE)}); transformers would leave them "
                         f"at its random initialisation")
    form, want = ("mxfp4", _GPT_OSS_MXFP4) if mxfp4 else ("dense", _GPT_OSS_DENSE)
    missing = [t for t in want + _GPT_OSS_BIASES if t not in held]
    if missing:
        raise ValueError(f"{name}: the checkpoint stores these experts "
                         f"{'in MXFP4' if mxfp4 else 'dense'} but lacks "
                         f"{', '.join(name + '.' + t for t in missing)}; transformers would "
                         f"leave them at its random initialisation")
    return form


def _dequantized_experts(loaded: "GptOssMxfp4Experts", module: torch.nn.Module):
    """transformers' gpt-oss experts ``module`` (built on the meta device) holding the
    experts ``loaded`` read from the file: each weight dequantized exactly (float32 and
    bfloat16 hold every MXFP4 value of float32's range), one expert at a time, in the dtype
    and layout of the module's own, (E, in, out); the biases as loaded."""
    for proj in _GPT_OSS_DENSE:
        blocks, scales = getattr(loaded, proj + "_blocks"), getattr(loaded, proj + "_scales")
        like = module._parameters[proj]
        assert like is not None
        e, o, n_groups, _ = blocks.shape
        dense = torch.empty((e, n_groups * GROUP, o), dtype=like.dtype, device=blocks.device)
        for x in range(e):
            dense[x] = dequantize(blocks[x], scales[x], like.dtype).t()
        module._parameters[proj] = torch.nn.Parameter(dense, requires_grad=like.requires_grad)
    for bias in _GPT_OSS_BIASES:
        module._parameters[bias] = getattr(loaded, bias)
    return module


class Mxfp4xHfQuantizer(HfQuantizer):
    """transformers' quantizer of the ``"mxfp4x"`` method.

    An MXFP4 checkpoint (gpt-oss): the experts modules of the meta-device model become
    :class:`GptOssMxfp4Experts` before the weights are read; nothing is converted while
    loading (the modules take the checkpoint's tensors as they are).  What the file holds
    decides, module by module (safetensors files: their headers are read first): experts
    it stores dense stay transformers' modules (and ``modules_to_not_convert`` then lists
    them), experts stored in MXFP4 that ``modules_to_not_convert`` names are read as
    MXFP4 and dequantized into transformers' module after loading, and experts the file
    lacks (a weight, scale or bias) are a ValueError.  A checkpoint whose config names no
    quantization but whose file holds gpt-oss experts in MXFP4 is read as MXFP4.

    A dense checkpoint: every experts module transformers routes through its experts
    interface keeps its class, its biases and its activation; its weights become uint8
    buffers filled by :class:`Mxfp4xQuantize` as the loader hands over each merged
    tensor, and its forward becomes :func:`mxfp4x_experts_forward`."""

    requires_calibration = False
    quantization_config: Mxfp4xConfig

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

        names = _checkpoint_names(checkpoint_files)
        every = [(name, m) for name, m in model.named_modules() if isinstance(m, HfExperts)]
        mxfp4 = _mxfp4_tensors(names)
        if not self.pre_quantized:
            if not mxfp4:
                return self._dense_before_loading(model)
            if not every:
                raise ValueError(f"mxfp4x: the checkpoint holds MXFP4 expert tensors "
                                 f"({mxfp4[0]}, ...), but {type(model).__name__} has no "
                                 f"gpt-oss experts; mxfp4x reads MXFP4 checkpoints of gpt-oss "
                                 f"models")
            # its config.json names no quantization_config, its tensors say MXFP4: read
            # as the MXFP4 checkpoint it is (transformers' loader asks pre_quantized when
            # it loads, after this)
            self.pre_quantized = True
        if not every:
            raise ValueError(f"mxfp4x: no gpt-oss experts in {type(model).__name__}; an "
                             f"MXFP4 checkpoint loads for gpt-oss models (dense checkpoints "
                             f"of other MoE models are quantized at load)")
        from transformers.quantizers.quantizers_utils import should_convert_module

        config = model.config.get_text_config()
        qc = self.quantization_config
        skip = list(qc.modules_to_not_convert or [])
        prefix = getattr(model, "base_model_prefix", "") or ""
        self._mxfp4x_dequantize: Dict[str, torch.nn.Module] = {}
        for name, module in every:
            stored = None if names is None else _gpt_oss_stored(name, names, prefix)
            listed = not should_convert_module(name, skip)
            if stored == "dense" or (stored is None and listed):
                if not listed:  # the config written back says what the file holds
                    qc.modules_to_not_convert = [*(qc.modules_to_not_convert or []), name]
                continue  # transformers' module takes the file's dense weights
            with torch.device("meta"):
                new = GptOssMxfp4Experts(config, bias_dtype=module.gate_up_proj_bias.dtype,
                                         num_threads=qc.num_threads)
            new._mxfp4x_name = name + "."
            if listed:  # stored MXFP4: the bytes load as they are, dequantized after
                self._mxfp4x_dequantize[name] = module
            model.set_submodule(name, new)
        return model

    def get_new_dtype(self, converter, param, dtype):
        """The dtype transformers' loader casts a checkpoint tensor to on its way to the
        model: none for the MXFP4 bytes of an MXFP4 checkpoint.  The loader casts a
        float-typed tensor (F8_E8M0 scales among them) by value to its parameter's dtype,
        which would turn each E8M0 scale byte s into the integer part of 2^(s-127), 0 for
        every scale below 127; the bytes arrive as stored and :class:`GptOssMxfp4Experts`
        views them (or names a dtype that is not bytes)."""
        targets = getattr(converter, "target_patterns", None) or ()
        if any(str(t).rsplit(".", 1)[-1] in GptOssMxfp4Experts._byte_buffers
               for t in targets):
            return None
        return super().get_new_dtype(converter, param, dtype)

    def _dense_before_loading(self, model):
        from transformers.quantizers.quantizers_utils import should_convert_module

        every = _dense_experts_modules(model)
        if not every:
            raise ValueError(f"mxfp4x: no experts module in {type(model).__name__} that "
                             f"transformers routes through its experts interface "
                             f"(@use_experts_implementation); nothing to quantize")
        skip = self.quantization_config.modules_to_not_convert
        found = [f for f in every if should_convert_module(f[0], skip)]
        self._mxfp4x_quantized = len(found)
        if not found:
            _LOG.warning(f"mxfp4x: modules_to_not_convert leaves every experts module of "
                         f"{type(model).__name__} dense ({len(every)}); nothing is quantized "
                         f"and the model is transformers' own")
            return model
        for name, shapes in _whole_groups(found).items():
            module = model.get_submodule(name)
            _swap_to_mxfp4(module, shapes)
            module._mxfp4x_threads = self.quantization_config.num_threads
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for name, module in getattr(self, "_mxfp4x_dequantize", {}).items():
            model.set_submodule(name, _dequantized_experts(model.get_submodule(name), module))
        self._mxfp4x_dequantize = {}
        if self.quantization_config.dense_kernels:
            use_dense_kernels(model, self.quantization_config.num_threads)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        from transformers.quantizers.quantizers_utils import get_module_from_name

        module, name = get_module_from_name(model, param_name)
        return name in getattr(module, "_mxfp4x_weights", ())

    def get_quantize_ops(self):
        return Mxfp4xQuantize(self)

    def is_serializable(self):
        # quantized at load, the experts would have to be written in a layout of our own
        # that no loader reads; an MXFP4 checkpoint is written back as it came
        if not self.pre_quantized and getattr(self, "_mxfp4x_quantized", 1) == 0:
            _LOG.warning("mxfp4x: modules_to_not_convert left every experts module dense, "
                         "but the model carries mxfp4x's quantization_config, which it is not "
                         "saved with; load it without quantization_config to save it")
        elif not self.pre_quantized:
            _LOG.warning("mxfp4x: experts quantized at load are not saved (no MXFP4 layout "
                         "for them is read by other loaders); save the dense checkpoint and "
                         "quantize again at load")
        return self.pre_quantized

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
    """A transformers ``AutoModelForCausalLM`` whose MoE experts are MXFP4 and run on
    mxfp4x, from a folder or a Hub id.

    * an MXFP4 checkpoint (gpt-oss as released, ``quant_method: "mxfp4"``): the expert
      bytes go from the file into uint8 buffers; no dense copy of an expert is ever made;
    * a checkpoint with dense experts (Qwen3-MoE, Mixtral, DeepSeek-style, gpt-oss bf16,
      any model whose experts module transformers routes through its experts interface):
      each layer's experts are quantized to MXFP4 as the loader hands them over
      (``mxfp4x.quantize``, the scale rule of ``Mxfp4xConfig(scale_rule=...)``).

    Each gpt-oss experts module loads as the file stores it (see
    :class:`Mxfp4xHfQuantizer`): MXFP4 bytes are read as MXFP4 also where ``config.json``
    lacks ``quantization_config``; expert tensors the file lacks are a ValueError.

    ``kwargs`` go to transformers' ``from_pretrained`` (``dtype``/``torch_dtype``,
    ``revision``, ``config``, ...); ``num_threads`` (or ``quantization_config=
    Mxfp4xConfig(num_threads=...)``) sets the threads of each experts call.  The model's
    bfloat16 linear layers run on mxfp4x's dense kernel at a few tokens
    (``Mxfp4xConfig(dense_kernels=False)``: torch's).  gpt-oss models take
    :func:`grouped_attention` (``attn_implementation="mxfp4x_grouped"``) unless an
    attention is asked for, here or in ``config`` (``"eager"``: transformers' own).
    """
    num_threads_arg(num_threads)  # before any file is read
    qc = kwargs.pop("quantization_config", None)
    if qc is not None and not isinstance(qc, Mxfp4xConfig):
        raise TypeError(f"quantization_config: expected an Mxfp4xConfig or None, got "
                        f"{type(qc).__name__}")
    config = kwargs.pop("config", None)
    if config is None:
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path, **hub)
    else:  # the caller's own is left as it was
        config = copy.deepcopy(config)
    threads = num_threads if num_threads is not None else getattr(qc, "num_threads", None)
    if getattr(config, "model_type", None) == "gpt_oss" and \
            getattr(config, "_attn_implementation", None) is None:  # none asked in config=
        kwargs.setdefault("attn_implementation", ATTENTION)
    found = getattr(config, "quantization_config", None)
    if found is None:  # dense experts: quantized at load (MXFP4 ones, in a checkpoint
        # whose config says nothing of them: the quantizer reads them as MXFP4)
        dense = Mxfp4xConfig(num_threads=threads,
                             scale_rule=getattr(qc, "scale_rule", "floor"),
                             modules_to_not_convert=getattr(qc, "modules_to_not_convert", None),
                             dense_kernels=getattr(qc, "dense_kernels", True))
        return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                    config=config, quantization_config=dense,
                                                    **kwargs)
    method = found.get("quant_method") if isinstance(found, dict) else found.quant_method
    method = getattr(method, "value", method)
    if method not in (_FILE_FORMAT, QUANT_METHOD):
        raise ValueError(f"{pretrained_model_name_or_path}: quant_method {method!r}; mxfp4x "
                         f"loads MXFP4 checkpoints (quant_method 'mxfp4') and checkpoints "
                         f"with dense experts")
    skip = (found.get("modules_to_not_convert") if isinstance(found, dict)
            else getattr(found, "modules_to_not_convert", None))
    # the checkpoint's list (modules it holds dense) and the caller's
    skip = list(dict.fromkeys(list(skip or []) +
                              list(getattr(qc, "modules_to_not_convert", None) or []))) or None
    # a dict, as config.json holds it: transformers dispatches on its quant_method
    config.quantization_config = {"quant_method": QUANT_METHOD, "num_threads": threads,
                                  "modules_to_not_convert": skip,
                                  "dense_kernels": getattr(qc, "dense_kernels", True)}
    return AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args,
                                                config=config, **kwargs)
