"""gpt-oss experts with their experts in MXFP4 (:class:`GptOssMxfp4Experts`), under the
checkpoint's tensor names, the way back to transformers' dense module
(:func:`dequantized_experts`) for the experts ``modules_to_not_convert`` names, and a model
split across two devices with its experts in CPU memory (:func:`split_devices`)."""
from typing import Optional

import torch

from ..._core.coerce import bytes_by_view
from ..._core.format import GROUP, GROUP_BYTES
from ..._core.quantize import dequantize
from ...models._common import BytesByView
from ...models.gpt_oss import gpt_oss_experts
from ._checkpoint_files import GPT_OSS_BIASES, GPT_OSS_DENSE, GPT_OSS_MXFP4


class GptOssMxfp4Experts(BytesByView):
    """transformers' ``GptOssExperts`` with its experts in MXFP4: the same forward
    signature ``(hidden_states (T, H), router_indices (T, K), routing_weights (T, K))``,
    computed as :class:`mxfp4x.nn.GptOssExperts` computes it, the SwiGLU output rounded to
    the hidden states' dtype before the down projection as transformers' module has it
    (``float32_intermediate=True`` keeps it in float32) (autograd included: the
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

    _byte_buffers = GPT_OSS_MXFP4
    _mxfp4x_name = ""  # the module's name in the model, for errors ("model.layers.0...")
    gate_up_proj_blocks: torch.Tensor
    gate_up_proj_scales: torch.Tensor
    down_proj_blocks: torch.Tensor
    down_proj_scales: torch.Tensor

    def __init__(self, config, bias_dtype: Optional[torch.dtype] = None,
                 num_threads: Optional[int] = None, float32_intermediate: bool = False):
        super().__init__()
        self.float32_intermediate = bool(float32_intermediate)
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
        home = self.gate_up_proj_blocks.device
        if hidden_states.device != home:  # experts kept in CPU memory (split_devices):
            # the tokens cross to them and the result back, once a layer each way
            return self.forward(hidden_states.to(home), router_indices.to(home),
                                routing_weights.to(home)).to(hidden_states.device)
        return gpt_oss_experts(hidden_states, router_indices, routing_weights,
                               (self.gate_up_proj_blocks, self.gate_up_proj_scales),
                               self.gate_up_proj_bias,
                               (self.down_proj_blocks, self.down_proj_scales),
                               self.down_proj_bias, limit=self.limit, alpha=self.alpha,
                               num_threads=self.num_threads,
                               act_dtype=None if self.float32_intermediate
                               else hidden_states.dtype)

    def extra_repr(self) -> str:
        e, two_f, g, _ = self.gate_up_proj_blocks.shape
        return f"n_experts={e}, hidden_size={GROUP * g}, intermediate_size={two_f // 2}"


def dequantized_experts(loaded: "GptOssMxfp4Experts", module: torch.nn.Module):
    """transformers' gpt-oss experts ``module`` (built on the meta device) holding the
    experts ``loaded`` read from the file: each weight dequantized exactly (float32 and
    bfloat16 hold every MXFP4 value of float32's range), one expert at a time, in the dtype
    and layout of the module's own, (E, in, out); the biases as loaded."""
    for proj in GPT_OSS_DENSE:
        blocks, scales = getattr(loaded, proj + "_blocks"), getattr(loaded, proj + "_scales")
        like = module._parameters[proj]
        assert like is not None
        e, o, n_groups, _ = blocks.shape
        dense = torch.empty((e, n_groups * GROUP, o), dtype=like.dtype, device=blocks.device)
        for x in range(e):
            dense[x] = dequantize(blocks[x], scales[x], like.dtype).t()
        module._parameters[proj] = torch.nn.Parameter(dense, requires_grad=like.requires_grad)
    for bias in GPT_OSS_BIASES:
        module._parameters[bias] = getattr(loaded, bias)
    return module


def split_devices(model: torch.nn.Module, device) -> torch.nn.Module:
    """Moves everything of ``model`` to ``device`` (e.g. ``"cuda"``) except its MXFP4
    experts (:class:`GptOssMxfp4Experts`), which stay where they are (CPU memory, run by
    mxfp4x's CPU kernels): attention, norms, embeddings, routers and the head on the GPU,
    the experts' bytes, the bulk of a MoE model, never copied there.  Each experts call
    takes its tokens from the GPU and hands its result back (one crossing a layer each
    way; the next layer needs the result, so the two sides take turns).  In place; returns
    ``model``.  Moving the model again (``.to``) moves the experts too."""
    device = torch.device(device)
    experts = [m for m in model.modules() if isinstance(m, GptOssMxfp4Experts)]
    inside = {id(p) for m in experts for p in list(m.parameters()) + list(m.buffers())}

    def move(t):
        return t if id(t) in inside else t.to(device)
    for m in model.modules():
        if not isinstance(m, GptOssMxfp4Experts):
            m._apply(move, recurse=False)
    return model
