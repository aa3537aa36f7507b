"""torch.nn modules over the mxfp4x ops: a generic MXFP4 expert bank, the gpt-oss
experts block and the Kimi K3 MoE layer (KimiK3MoE, KimiK3Router, KimiK3Experts), with
checkpoint loading that maps, not copies, the packed bytes."""
import functools
from typing import List, Optional, Sequence

import torch

from ._api import mxfp4_experts, mxfp4_experts_slots
from ._format import GROUP, GROUP_BYTES
from ._progress import Progress
from ._quantize import quantize
from ._validation import as_tensor, byte_tensor
from .checkpoints.families import as_bytes
from .checkpoints.safetensors import SafeTensorsCheckpoint
from .models.kimi_k3 import KimiK3Experts, KimiK3MoE, KimiK3Router  # noqa: F401


def _bytes(name, t):
    """uint8 bytes, checked as the op checks them (never a silent wrap-around)."""
    return byte_tensor(name, as_tensor(name, t))


def _range(expert_range, n_local, group):
    """(e0, e1) of the experts a module holds: all of them unless expert-parallel."""
    if expert_range is None:
        if group is not None:
            raise ValueError("expert_range: an expert-parallel module (group=...) needs the "
                             "range (e0, e1) of the experts it holds")
        return 0, n_local
    e0, e1 = (int(v) for v in expert_range)
    if e1 - e0 != n_local or e0 < 0:
        raise ValueError(f"expert_range: {(e0, e1)} names {e1 - e0} experts, the bytes hold "
                         f"{n_local}")
    if group is None and e0 != 0:
        raise ValueError("expert_range: a module holding some of the experts needs group= "
                         "(torch.distributed) to reach the others")
    return e0, e1


class MXFP4Experts(torch.nn.Module):
    """E experts W_e (d_out x d_in) stored in MXFP4: buffers ``packed_weights``
    (E, d_out, d_in/32, 16) and ``scale_bytes`` (E, d_out, d_in/32), uint8.

    ``forward(latent_tokens, selected_experts, mixture_weights, shared_output=None)``
    returns ``shared_output + sum_k p_tk W_{e_tk} x_t`` (zeros for a missing shared output).

    Expert-parallel: built with ``expert_range=(e0, e1)`` (the buffers then hold experts
    e0..e1-1) and ``group`` (torch.distributed), its forward is
    :func:`mxfp4x.distributed.mxfp4_experts` (bit-identical to one process).
    """

    packed_weights: torch.Tensor
    scale_bytes: torch.Tensor

    def __init__(self, n_experts: int, d_out: int, d_in: int, num_threads: Optional[int] = None,
                 expert_range=None, group=None):
        super().__init__()
        self.expert_range, self.group = _range(expert_range, n_experts, group), group
        if d_in % GROUP:
            raise ValueError(f"d_in: must be a multiple of {GROUP}, got {d_in}")
        self.num_threads = num_threads
        self.register_buffer("packed_weights",
                             torch.zeros((n_experts, d_out, d_in // GROUP, GROUP_BYTES),
                                         dtype=torch.uint8))
        self.register_buffer("scale_bytes",
                             torch.zeros((n_experts, d_out, d_in // GROUP), dtype=torch.uint8))

    @classmethod
    def from_packed(cls, packed_weights: torch.Tensor, scale_bytes: torch.Tensor,
                    num_threads: Optional[int] = None, expert_range=None,
                    group=None) -> "MXFP4Experts":
        """Wrap existing bytes (no copy when they are uint8 already)."""
        if packed_weights.dim() != 4 or packed_weights.shape[-1] != GROUP_BYTES:
            raise ValueError(f"packed_weights: expected (E, d_out, G, 16), got "
                             f"{tuple(packed_weights.shape)}")
        if tuple(scale_bytes.shape) != tuple(packed_weights.shape[:3]):
            raise ValueError(f"scale_bytes: expected {tuple(packed_weights.shape[:3])}, got "
                             f"{tuple(scale_bytes.shape)}")
        e, o, g, _ = packed_weights.shape
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.num_threads = num_threads
        m.expert_range, m.group = _range(expert_range, e, group), group
        m.register_buffer("packed_weights", _bytes("packed_weights", packed_weights))
        m.register_buffer("scale_bytes", _bytes("scale_bytes", scale_bytes))
        return m

    @classmethod
    def from_float(cls, weights: torch.Tensor, scale_rule: str = "floor",
                   num_threads: Optional[int] = None) -> "MXFP4Experts":
        """Quantize float weights (E, d_out, d_in) (OCP MX v1.0 rules, see quantize)."""
        packed, scales = quantize(weights, scale_rule)
        return cls.from_packed(packed, scales, num_threads)

    @classmethod
    def from_safetensors(cls, path: str, blocks_key: str, scales_key: str,
                         num_threads: Optional[int] = None, expert_range=None,
                         group=None) -> "MXFP4Experts":
        """Load (memory-mapped) from a .safetensors file or checkpoint directory; with
        ``expert_range`` only those experts' bytes are mapped."""
        ckpt = SafeTensorsCheckpoint(path)
        if expert_range is None:
            return cls.from_packed(as_bytes(blocks_key, ckpt.get(blocks_key)),
                                   as_bytes(scales_key, ckpt.get(scales_key)), num_threads)
        e0, e1 = expert_range
        return cls.from_packed(as_bytes(blocks_key, ckpt.get_rows(blocks_key, e0, e1)),
                               as_bytes(scales_key, ckpt.get_rows(scales_key, e0, e1)),
                               num_threads, expert_range=expert_range, group=group)

    def forward(self, latent_tokens: torch.Tensor, selected_experts: torch.Tensor,
                mixture_weights: torch.Tensor,
                shared_output: Optional[torch.Tensor] = None) -> torch.Tensor:
        if shared_output is None:
            x = torch.as_tensor(latent_tokens)
            dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
            shared_output = torch.zeros((x.shape[0], self.packed_weights.shape[1]),
                                        dtype=dtype, device=x.device)
        if self.group is not None:
            from . import distributed
            return distributed.mxfp4_experts(latent_tokens, self.packed_weights,
                                             self.scale_bytes, selected_experts,
                                             mixture_weights, shared_output,
                                             expert_range=self.expert_range, group=self.group,
                                             num_threads=self.num_threads)
        return mxfp4_experts(latent_tokens, self.packed_weights, self.scale_bytes,
                             selected_experts, mixture_weights, shared_output,
                             num_threads=self.num_threads)

    def extra_repr(self) -> str:
        e, o, g, _ = self.packed_weights.shape
        return f"n_experts={e}, d_out={o}, d_in={GROUP * g}"


class GptOssExperts(torch.nn.Module):
    """The experts block of gpt-oss, with its expert matrices in MXFP4.

    forward(hidden_states (T, H), router_indices (T, K), routing_weights (T, K)) -> (T, H):

        gate_up = W_gu[e] h + b_gu[e]                  per slot, (T, K, 2F), rows interleaved
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = min(gate, limit); up = clamp(up, -limit, limit)
        a = (up + 1) * gate * sigmoid(alpha * gate)     (float32, float64 for float64 input)
        out = sum_k p_k (W_down[e] a_k + b_down[e])

    Buffers: ``gate_up_blocks`` (E, 2F, H/32, 16), ``gate_up_scales`` (E, 2F, H/32),
    ``down_blocks`` (E, H, F/32, 16), ``down_scales`` (E, H, F/32); parameters
    ``gate_up_bias`` (E, 2F) and ``down_bias`` (E, H).

    Expert-parallel: with ``expert_range=(e0, e1)`` and ``group``, the block buffers hold
    experts e0..e1-1 (the biases, small, stay whole) and both projections run through
    :mod:`mxfp4x.distributed` (the gate/up per slot, the down combined).
    """

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: torch.Tensor

    def __init__(self, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                 gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                 down_scales: torch.Tensor, down_bias: torch.Tensor, limit: float = 7.0,
                 alpha: float = 1.702, num_threads: Optional[int] = None, expert_range=None,
                 group=None):
        super().__init__()
        e, two_f, g_h, _ = gate_up_blocks.shape
        self.expert_range, self.group = _range(expert_range, e, group), group
        if two_f % 2 or down_blocks.shape[:2] != (e, GROUP * g_h) or \
                down_blocks.shape[2] * GROUP != two_f // 2 or (expert_range is None and
                                                                gate_up_bias.shape[0] != e):
            raise ValueError(f"gate_up_blocks {tuple(gate_up_blocks.shape)} and down_blocks "
                             f"{tuple(down_blocks.shape)} do not form a gpt-oss block")
        self.limit, self.alpha, self.num_threads = float(limit), float(alpha), num_threads
        self.register_buffer("gate_up_blocks", _bytes("gate_up_blocks", gate_up_blocks))
        self.register_buffer("gate_up_scales", _bytes("gate_up_scales", gate_up_scales))
        self.register_buffer("down_blocks", _bytes("down_blocks", down_blocks))
        self.register_buffer("down_scales", _bytes("down_scales", down_scales))
        bias_dtype = torch.float64 if gate_up_bias.dtype == torch.float64 else torch.float32
        self.gate_up_bias = torch.nn.Parameter(gate_up_bias.detach().to(bias_dtype, copy=True),
                                               requires_grad=False)
        self.down_bias = torch.nn.Parameter(down_bias.detach().to(bias_dtype, copy=True),
                                            requires_grad=False)

    @classmethod
    def from_checkpoint(cls, path, layer: int, prefix: str = "model.layers.{}.mlp.experts.",
                        **kwargs) -> "GptOssExperts":
        """One layer's experts from a gpt-oss safetensors checkpoint (a file, a directory,
        or an open SafeTensorsCheckpoint), packed bytes memory-mapped, not copied; with
        ``expert_range=(e0, e1)`` only those experts' bytes are mapped."""
        ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
        p = prefix.format(layer)
        rng = kwargs.get("expert_range")

        def experts(name):  # bytes typed U8, I8 or F8_E8M0, read by view
            t = ckpt.get(p + name) if rng is None else ckpt.get_rows(p + name, *rng)
            return as_bytes(p + name, t)

        return cls(experts("gate_up_proj_blocks"), experts("gate_up_proj_scales"),
                   ckpt.get(p + "gate_up_proj_bias"), experts("down_proj_blocks"),
                   experts("down_proj_scales"), ckpt.get(p + "down_proj_bias"), **kwargs)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
        slots, combined = mxfp4_experts_slots, mxfp4_experts
        if self.group is not None:
            from . import distributed
            slots = functools.partial(distributed.mxfp4_experts_slots,
                                      expert_range=self.expert_range, group=self.group)
            combined = functools.partial(distributed.mxfp4_experts,
                                         expert_range=self.expert_range, group=self.group)
        gate_up = slots(hidden_states, self.gate_up_blocks, self.gate_up_scales,
                        router_indices, num_threads=self.num_threads).to(acc)
        gate_up = gate_up + self.gate_up_bias.to(acc)[router_indices]
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        weights = routing_weights.to(acc)
        bias = (weights.unsqueeze(-1) * self.down_bias.to(acc)[router_indices]).sum(1)
        out = combined(act, self.down_blocks, self.down_scales, router_indices, weights, bias,
                       num_threads=self.num_threads)
        return out.to(hidden_states.dtype)


def load_gpt_oss_experts(path: str, layers: Optional[Sequence[int]] = None,
                         progress: bool = True, **kwargs) -> List[GptOssExperts]:
    """Every (or the given) layer's experts of a gpt-oss checkpoint, memory-mapped, with a
    progress bar on stderr (plain lines when it is not a terminal)."""
    ckpt = SafeTensorsCheckpoint(path)
    if layers is None:
        layers = []
        while f"model.layers.{len(layers)}.mlp.experts.down_proj_blocks" in ckpt:
            layers.append(len(layers))
    out = []
    bar = Progress(len(layers), "loading experts") if progress else None
    for i, layer in enumerate(layers):
        out.append(GptOssExperts.from_checkpoint(ckpt, layer, **kwargs))
        if bar is not None:
            bar.update(i + 1)
    return out
