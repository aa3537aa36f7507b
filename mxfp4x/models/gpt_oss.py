"""gpt-oss (openai/gpt-oss-20b and -120b): its tensor names, router, experts, block and
``from_checkpoint``, the experts kept in MXFP4.

The checkpoint as released: layer L's experts are stacked tensors
``model.layers.L.mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`` (blocks uint8
(E, out, in/32, 16), scales uint8 (E, out, in/32), the gate/up rows interleaved: gate
rows even, up rows odd), the router ``model.layers.L.mlp.router.{weight,bias}``.
llama.cpp's GGUF files (architecture ``gpt-oss``) hold the same codes and scales as GGUF
blocks, gate and up split (``blk.L.ffn_{gate,up,down}_exps.{weight,bias}``, the router
``blk.L.ffn_gate_inp.{weight,bias}``): read in place too.
"""
import functools
import os
from typing import List, NamedTuple, Optional, Sequence

import torch

from .._api import mxfp4_experts, mxfp4_experts_slots
from .._format import GGUF_BLOCK_BYTES, GROUP, accumulation_dtype
from .._progress import Progress
from .._validation import WeakGroup, parse_expert_range
from .._validation import bytes_by_view as as_bytes
from ..checkpoints.families import gguf_naming, load_gguf_experts
from ..checkpoints.safetensors import SafeTensorsCheckpoint
from ._common import _positive, bytes_of, check_routing, expert_range_of

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                   experts_per_token=4, num_hidden_layers=24, swiglu_limit=7.0)
EXPERTS = "model.layers.{layer}.mlp.experts."  # + {gate_up,down}_proj_{blocks,scales,bias}
ROUTER = "model.layers.{layer}.mlp.router."    # + {weight,bias}


class GptOssRouter(torch.nn.Module):
    """gpt-oss's router: ``forward(x (T, H)) -> (selected (T, K) int64, weights (T, K))``,
    the top-k of ``x W^T + b`` in float32, a softmax over the chosen logits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int):
        super().__init__()
        if weight.dim() != 2 or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"router: expected a weight (n_experts, hidden) and a bias "
                             f"(n_experts,), got {tuple(weight.shape)} and "
                             f"{tuple(bias.shape)}")
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.top_k = check_routing(weight.shape[0], top_k, 1, 1, "router")[0]

    def forward(self, x: torch.Tensor):
        logits = torch.nn.functional.linear(x.float(), self.weight.float(), self.bias.float())
        values, idx = torch.topk(logits, self.top_k, dim=-1)
        return idx, torch.softmax(values, dim=-1)


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

    From a GGUF file (:meth:`from_checkpoint` on a ``.gguf``; llama.cpp splits gate/up
    into gate rows ``0::2`` and up rows ``1::2``): :meth:`from_gguf_blocks`, buffers
    ``gate_blocks`` and ``up_blocks`` (E, F, H/32, 17) and ``down_blocks`` (E, H, F/32,
    17) of GGUF block_mxfp4 blocks read in place, the scale buffers None; the gate and
    up products run as two calls, interleaved back into ``gate_up``'s order.
    """

    group = WeakGroup()  # held weakly: _validation.WeakGroup

    gate_up_blocks: torch.Tensor
    gate_up_scales: torch.Tensor
    gate_blocks: torch.Tensor  # the GGUF form's, in place of gate_up_*
    up_blocks: torch.Tensor
    down_blocks: torch.Tensor
    down_scales: Optional[torch.Tensor]

    def __init__(self, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                 gate_up_bias: torch.Tensor, down_blocks: torch.Tensor,
                 down_scales: torch.Tensor, down_bias: torch.Tensor, limit: float = 7.0,
                 alpha: float = 1.702, num_threads: Optional[int] = None, expert_range=None,
                 group=None):
        super().__init__()
        e, two_f, g_h, _ = gate_up_blocks.shape
        self.expert_range, self.group = expert_range_of(expert_range, e, group), group
        if two_f % 2 or down_blocks.shape[:2] != (e, GROUP * g_h) or \
                down_blocks.shape[2] * GROUP != two_f // 2 or (expert_range is None and
                                                                gate_up_bias.shape[0] != e):
            raise ValueError(f"gate_up_blocks {tuple(gate_up_blocks.shape)} and down_blocks "
                             f"{tuple(down_blocks.shape)} do not form a gpt-oss block")
        self.limit, self.alpha, self.num_threads = float(limit), float(alpha), num_threads
        self.register_buffer("gate_up_blocks", bytes_of("gate_up_blocks", gate_up_blocks))
        self.register_buffer("gate_up_scales", bytes_of("gate_up_scales", gate_up_scales))
        self.register_buffer("down_blocks", bytes_of("down_blocks", down_blocks))
        self.register_buffer("down_scales", bytes_of("down_scales", down_scales))
        bias_dtype = accumulation_dtype(gate_up_bias.dtype)
        self.gate_up_bias = torch.nn.Parameter(gate_up_bias.detach().to(bias_dtype, copy=True),
                                               requires_grad=False)
        self.down_bias = torch.nn.Parameter(down_bias.detach().to(bias_dtype, copy=True),
                                            requires_grad=False)

    @classmethod
    def from_gguf_blocks(cls, gate_blocks: torch.Tensor, up_blocks: torch.Tensor,
                         gate_bias: torch.Tensor, up_bias: torch.Tensor,
                         down_blocks: torch.Tensor, down_bias: torch.Tensor,
                         **kwargs) -> "GptOssExperts":
        """The block from llama.cpp's tensors: GGUF block_mxfp4 blocks gate and up (E, F,
        H/32, 17), down (E, H, F/32, 17), read in place; biases gate, up (E, F) and down
        (E, H). ``kwargs`` as the constructor's."""
        for name, t in (("gate_blocks", gate_blocks), ("up_blocks", up_blocks),
                        ("down_blocks", down_blocks)):
            if t.dim() != 4 or t.shape[3] != GGUF_BLOCK_BYTES:
                raise ValueError(f"{name}: expected GGUF blocks (E, O, G, {GGUF_BLOCK_BYTES})"
                                 f", got {tuple(t.shape)}")
        e, f, g_h, _ = gate_blocks.shape
        if up_blocks.shape != gate_blocks.shape or tuple(down_blocks.shape[:3]) != (
                e, GROUP * g_h, f // GROUP) or f % GROUP:
            raise ValueError(f"gate_blocks {tuple(gate_blocks.shape)}, up_blocks "
                             f"{tuple(up_blocks.shape)} and down_blocks "
                             f"{tuple(down_blocks.shape)} do not form a gpt-oss block")
        if tuple(gate_bias.shape) != tuple(up_bias.shape):
            raise ValueError(f"gate_bias {tuple(gate_bias.shape)} and up_bias "
                             f"{tuple(up_bias.shape)} differ")
        gate_up_bias = torch.stack((gate_bias, up_bias), dim=-1).flatten(-2)  # interleaved
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        rng, group = kwargs.pop("expert_range", None), kwargs.pop("group", None)
        m.expert_range, m.group = expert_range_of(rng, e, group), group
        if rng is None and gate_up_bias.shape[0] != e:
            raise ValueError(f"gate_bias: {gate_bias.shape[0]} experts, the blocks {e}")
        m.limit = float(kwargs.pop("limit", 7.0))
        m.alpha = float(kwargs.pop("alpha", 1.702))
        m.num_threads = kwargs.pop("num_threads", None)
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        m.register_buffer("gate_blocks", bytes_of("gate_blocks", gate_blocks))
        m.register_buffer("up_blocks", bytes_of("up_blocks", up_blocks))
        m.register_buffer("down_blocks", bytes_of("down_blocks", down_blocks))
        m.register_buffer("down_scales", None)
        bias_dtype = accumulation_dtype(gate_up_bias.dtype)
        m.gate_up_bias = torch.nn.Parameter(gate_up_bias.detach().to(bias_dtype, copy=True),
                                            requires_grad=False)
        m.down_bias = torch.nn.Parameter(down_bias.detach().to(bias_dtype, copy=True),
                                         requires_grad=False)
        return m

    @classmethod
    def from_checkpoint(cls, path, layer: int, prefix: str = EXPERTS,
                        **kwargs) -> "GptOssExperts":
        """One layer's experts from a gpt-oss checkpoint: safetensors (a file, a
        directory, or an open SafeTensorsCheckpoint) or GGUF (a ``.gguf`` file, a split
        set, or an open GGUFCheckpoint), expert bytes memory-mapped, not copied; with
        ``expert_range=(e0, e1)`` only those experts' bytes are mapped."""
        gguf = _gguf_of(path)
        if gguf is not None:
            return _gguf_experts(gguf, layer, **kwargs)
        ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
        p = prefix.format(layer=layer)
        rng = kwargs.get("expert_range")
        rng = None if rng is None else parse_expert_range(rng)

        def experts(name):  # bytes typed U8, I8 or F8_E8M0, read by view
            t = ckpt.get(p + name) if rng is None else ckpt.get_rows(p + name, *rng)
            return as_bytes(p + name, t)

        return cls(experts("gate_up_proj_blocks"), experts("gate_up_proj_scales"),
                   ckpt.get(p + "gate_up_proj_bias"), experts("down_proj_blocks"),
                   experts("down_proj_scales"), ckpt.get(p + "down_proj_bias"), **kwargs)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        gate_up = GateAndUp(self.gate_blocks, self.up_blocks) if "gate_blocks" in \
            self._buffers else (self.gate_up_blocks, self.gate_up_scales)
        return gpt_oss_experts(hidden_states, router_indices, routing_weights,
                               gate_up, self.gate_up_bias,
                               (self.down_blocks, self.down_scales), self.down_bias,
                               limit=self.limit, alpha=self.alpha,
                               num_threads=self.num_threads, expert_range=self.expert_range,
                               group=self.group)


class GateAndUp(NamedTuple):
    """gate and up experts as separate GGUF block_mxfp4 blocks (E, F, H/32, 17), as
    llama.cpp stores gpt-oss: the ``gate_up`` of :func:`gpt_oss_experts` in two."""
    gate: torch.Tensor
    up: torch.Tensor


def gpt_oss_experts(hidden_states: torch.Tensor, router_indices: torch.Tensor,
                    routing_weights: torch.Tensor, gate_up, gate_up_bias: torch.Tensor, down,
                    down_bias: torch.Tensor, limit: float = 7.0, alpha: float = 1.702,
                    num_threads: Optional[int] = None, expert_range=None,
                    group=None) -> torch.Tensor:
    """The forward of :class:`GptOssExperts` as a function: ``gate_up`` and ``down`` are
    (blocks, scales) pairs of uint8 tensors in the checkpoint's layout (scales None:
    GGUF blocks; ``gate_up`` may be a :class:`GateAndUp` of GGUF blocks); the modules
    that hold these tensors under other names (``mxfp4x.integrations.transformers``) call
    it."""
    slots, combined = mxfp4_experts_slots, mxfp4_experts
    if group is not None:
        from .. import distributed
        slots = functools.partial(distributed.mxfp4_experts_slots,
                                  expert_range=expert_range, group=group)
        combined = functools.partial(distributed.mxfp4_experts,
                                     expert_range=expert_range, group=group)
    if isinstance(gate_up, GateAndUp):  # two calls, interleaved back: rows 2j gate, 2j+1 up
        gate_out = slots(hidden_states, gate_up.gate, None, router_indices,
                         num_threads=num_threads)  # checks the inputs
        up_out = slots(hidden_states, gate_up.up, None, router_indices,
                       num_threads=num_threads)
        gate_up_out = torch.stack((gate_out, up_out), dim=-1).flatten(-2)
    else:
        gate_up_out = slots(hidden_states, gate_up[0], gate_up[1], router_indices,
                            num_threads=num_threads)  # checks the inputs
    out_dtype = gate_up_out.dtype  # the latents' (integer latents: the default float dtype)
    try:
        acc = accumulation_dtype(out_dtype)
        gate_up_out = gate_up_out.to(acc) + gate_up_bias.to(acc)[router_indices]
        gate, up = gate_up_out[..., 0::2], gate_up_out[..., 1::2]
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        weights = torch.as_tensor(routing_weights).to(acc)
        bias = (weights.unsqueeze(-1) * down_bias.to(acc)[router_indices]).sum(1)
    except BaseException as exc:
        if group is None:
            raise
        distributed.fail_on_every_rank(exc, group)  # the others wait in `combined`
    out = combined(act, down[0], down[1], router_indices, weights, bias,
                   num_threads=num_threads)
    return out.to(out_dtype)


class GptOssMoE(torch.nn.Module):
    """One gpt-oss MoE layer: ``forward(x (T, H)) -> (T, H)``, the router then the experts
    (:class:`GptOssRouter`, :class:`GptOssExperts`)."""

    def __init__(self, router: GptOssRouter, experts: GptOssExperts):
        super().__init__()
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        selected, weights = self.router(x)
        return self.experts(x, selected, weights)

    @classmethod
    def from_checkpoint(cls, path, layer: int, top_k: Optional[int] = None,
                        expert_range=None, num_threads: Optional[int] = None,
                        group=None) -> "GptOssMoE":
        """Layer ``layer`` of a gpt-oss checkpoint (a file or a folder); ``top_k`` from its
        config.json (``experts_per_token``) unless given; ``expert_range=(e0, e1)`` maps
        only those experts' bytes (expert-parallel with ``group``). A GGUF file (or split
        set) gives the router, the biases and ``top_k`` (``gpt-oss.expert_used_count``)
        too."""
        gguf = _gguf_of(path)
        if gguf is not None:
            naming = gguf_naming(gguf.architecture)
            if top_k is None:
                top_k = _gguf_int(gguf, "expert_used_count")
            bias = naming.router_bias or ""  # gpt-oss's router has a bias
            router = GptOssRouter(gguf.get(naming.router.format(layer=layer)),
                                  gguf.get(bias.format(layer=layer)), top_k)
            return cls(router, _gguf_experts(gguf, layer, expert_range=expert_range,
                                             num_threads=num_threads, group=group))
        ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
        from ..checkpoints.families import config_path, read_config
        try:
            config = read_config(ckpt.root)
        except FileNotFoundError:
            if top_k is None:
                raise
            config = {}  # top_k given, a file without its config.json: gpt-oss's clamp
        source = config_path(ckpt.root)
        if top_k is None:
            if "experts_per_token" not in config:
                raise ValueError(f"{source}: 'experts_per_token' is missing; pass top_k=")
            top_k = config["experts_per_token"]
        # the activation's clamp as the checkpoint states it (gpt-oss: 7.0)
        limit = _positive(f"{source}: swiglu_limit", config.get("swiglu_limit", 7.0))
        r = ROUTER.format(layer=layer)
        router = GptOssRouter(ckpt.get(r + "weight"), ckpt.get(r + "bias"), top_k)
        experts = GptOssExperts.from_checkpoint(ckpt, layer, expert_range=expert_range,
                                                num_threads=num_threads, group=group,
                                                limit=limit)
        return cls(router, experts)


def load_gpt_oss_experts(path: str, layers: Optional[Sequence[int]] = None,
                         progress: bool = True, **kwargs) -> List[GptOssExperts]:
    """Every (or the given) layer's experts of a gpt-oss checkpoint, memory-mapped, with a
    progress bar on stderr (plain lines when it is not a terminal)."""
    ckpt = SafeTensorsCheckpoint(path)
    if layers is None:
        layers = []
        while EXPERTS.format(layer=len(layers)) + "down_proj_blocks" in ckpt:
            layers.append(len(layers))
    out = []
    bar = Progress(len(layers), "loading experts") if progress else None
    for i, layer in enumerate(layers):
        out.append(GptOssExperts.from_checkpoint(ckpt, layer, **kwargs))
        if bar is not None:
            bar.update(i + 1)
    return out


def _gguf_of(path):
    """An open GGUFCheckpoint for a GGUF ``path`` (or one given), else None."""
    from ..checkpoints.gguf import GGUFCheckpoint, is_gguf

    if isinstance(path, GGUFCheckpoint):
        return path
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path) and is_gguf(path):
        return GGUFCheckpoint(os.fspath(path))
    return None


def _gguf_int(ckpt, key: str) -> int:
    full = f"{ckpt.architecture}.{key}"
    if full not in ckpt.metadata:
        raise ValueError(f"{ckpt.root}: no {full!r} in the GGUF metadata")
    return int(ckpt.metadata[full])


def _gguf_experts(ckpt, layer: int, **kwargs) -> GptOssExperts:
    """Layer ``layer``'s experts of a gpt-oss GGUF (llama.cpp's names, families.py)."""
    if ckpt.architecture != "gpt-oss":
        raise ValueError(f"{ckpt.root}: architecture {ckpt.architecture!r}, expected "
                         f"'gpt-oss' (llama.cpp's name for gpt-oss GGUF files)")
    naming = gguf_naming(ckpt.architecture)
    blocks = load_gguf_experts(ckpt, layer, kwargs.get("expert_range"), naming=naming)

    def bias(role):
        name = naming.expert_bias.format(layer=layer, proj=naming.roles[role])
        if name not in ckpt:
            raise ValueError(f"{ckpt.root}: no tensor {name!r} (the {role} experts' bias "
                             f"of layer {layer})")
        return ckpt.get(name)

    return GptOssExperts.from_gguf_blocks(blocks["gate"], blocks["up"], bias("gate"),
                                          bias("up"), blocks["down"], bias("down"), **kwargs)
