"""Dense experts quantized at load: the experts modules of any model transformers routes
through its experts interface keep their class, their dense weights become uint8 buffers
(:func:`swap_to_mxfp4`) that :class:`Mxfp4xQuantize` fills as the loader hands over each
merged tensor, and their forward becomes the experts implementation ``"mxfp4x"``
(:func:`mxfp4x_experts_forward`, registered in transformers' experts interface on import)."""
from typing import Dict

import torch
from transformers.core_model_loading import ConversionOps
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.quantizers.quantizers_utils import get_module_from_name

from ..._core import memory as _memory
from ..._core.api import mxfp4_experts, mxfp4_experts_slots
from ..._core.format import GROUP, GROUP_BYTES, accumulation_dtype
from ..._core.quantize import quantize
from ...models._common import view_loaded_bytes_hook
from ._config import QUANT_METHOD

_DENSE_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")


def dense_experts_modules(model):
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


def whole_groups(found) -> Dict[str, Dict[str, tuple]]:
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


def swap_to_mxfp4(module, shapes):
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
            # on huge pages, as a decoding step streams them (mxfp4x._core.memory)
            blocks = _memory.zeros((e, o, i // GROUP, GROUP_BYTES), torch.uint8)
            scales = _memory.zeros((e, o, i // GROUP), torch.uint8)
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
    float32 (float64 for float64); the activation's output is rounded to the hidden
    states' dtype before the down projection (``Mxfp4xConfig(float32_intermediate=True)``:
    kept in float32); returns the hidden states' dtype."""
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
    if not getattr(self, "_mxfp4x_float32_intermediate", False):
        act = act.to(hidden_states.dtype)  # as transformers computes it: the model's dtype
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
