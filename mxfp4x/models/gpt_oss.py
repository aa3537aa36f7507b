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
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .._api import mxfp4_experts, mxfp4_experts_slots
from .._format import GGUF_BLOCK_BYTES, GROUP, GROUP_BYTES, accumulation_dtype
from .._progress import Progress
from .._validation import (
    ExpertRange,
    NumThreads,
    WeakGroup,
    num_threads_arg,
    parse_expert_range,
)
from ..checkpoints import families as ck
from ..checkpoints.families import GPT_OSS, gguf_naming, load_gguf_experts
from ..checkpoints.safetensors import SafeTensorsCheckpoint
from ._common import (
    BytesByView,
    _integer,
    _positive,
    _real,
    bytes_of,
    check_dims,
    check_routing,
    check_tensor,
    expert_range_of,
    gguf_integer,
    gguf_integer_if_any,
)

# the released gpt-oss-20b's sizes, under transformers' GptOssConfig names
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                   num_experts_per_tok=4, num_hidden_layers=24, swiglu_limit=7.0)


class GptOssRouter(torch.nn.Module):
    """gpt-oss's router: ``forward(x (T, H)) -> (selected (T, K) int64, weights (T, K))``,
    the top-k of ``x W^T + b`` in float32, a softmax over the chosen logits."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int):
        super().__init__()
        check_tensor("router weight", weight, (None, None), "n_experts by hidden")
        check_tensor("router bias", bias, (weight.shape[0],), "one per row of the weight")
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.top_k = check_routing(weight.shape[0], top_k, 1, 1, "router")[0]

    def forward(self, x: torch.Tensor):
        logits = torch.nn.functional.linear(x.float(), self.weight.float(), self.bias.float())
        values, idx = torch.topk(logits, self.top_k, dim=-1)
        return idx, torch.softmax(values, dim=-1)


# the experts' tensors by constructor argument (split layout, then llama.cpp's GGUF form)
_SPLIT = ("gate_up_blocks", "gate_up_scales", "gate_up_bias", "down_blocks", "down_scales",
          "down_bias")
_GGUF = ("gate_blocks", "up_blocks", "gate_bias", "up_bias", "down_blocks", "down_bias")


def checkpoint_config(root: str, required: bool = False) -> Tuple[dict, str]:
    """(config, where it is) of a gpt-oss checkpoint (a folder, or beside a file): the
    keys under the names the family reads (``GPT_OSS.config``: transformers'
    ``GptOssConfig`` names, each alias taken, one naming another value a ValueError);
    ({}, where) when there is none and it is not ``required``."""
    source = ck.config_path(root)
    try:
        raw = ck.read_config(root)
    except FileNotFoundError:
        if required:
            raise
        return {}, source
    return GPT_OSS.config(raw, source), source


def activation(config: dict, source: str, limit: Optional[float] = None,
               alpha: Optional[float] = None) -> Tuple[float, float]:
    """(limit, alpha) of the clamped SwiGLU: as given, else the config's ``swiglu_limit``
    and ``swiglu_alpha`` (transformers' GptOssConfig reads both), else their defaults
    there, gpt-oss's 7.0 and 1.702; each checked, a ValueError naming ``source``."""
    if limit is None:
        limit = _positive(f"{source}: swiglu_limit", config.get("swiglu_limit", 7.0))
    if alpha is None:
        alpha = _real(f"{source}: swiglu_alpha", config.get("swiglu_alpha", 1.702))
    return float(limit), float(alpha)


def tensor_names(prefix: str, layer: int) -> Dict[str, str]:
    """Constructor argument -> the checkpoint's name of that tensor of layer ``layer``
    (``gate_up_blocks``: ``model.layers.L.mlp.experts.gate_up_proj_blocks``), from the
    family's entry in the registry (``mxfp4x.checkpoints.families.GPT_OSS``)."""
    kinds = {"blocks": GPT_OSS.packed, "scales": GPT_OSS.scale, "bias": str(GPT_OSS.bias)}
    return {arg: GPT_OSS.tensor(prefix, layer, None, *_role_kind(arg, kinds))
            for arg in _SPLIT}


def _role_kind(arg: str, kinds: Dict[str, str]) -> Tuple[str, str]:
    role, kind = arg.rsplit("_", 1)
    return role, kinds[kind]


def _bias_rows(name: str, bias, width: int, e_local: int,
               expert_range: Optional[ExpertRange]) -> int:
    """The experts a gate/up bias holds (all of them: a module of a range indexes the
    biases by global id), checked against the blocks' ``e_local`` and ``expert_range``."""
    check_tensor(name, bias, (None, width), "n_experts by the blocks' rows")
    rows = bias.shape[0]
    if expert_range is None and rows != e_local:
        raise ValueError(f"{name}: expected shape {(e_local, width)} (a row per expert of "
                         f"the blocks), got {tuple(bias.shape)}")
    if expert_range is not None and expert_range.e1 > rows:
        raise ValueError(f"{name}: {rows} experts, fewer than expert_range "
                         f"{tuple(expert_range)} needs")
    return rows


def check_experts(tensors: Dict[str, torch.Tensor], expert_range=None,
                  names: Optional[Dict[str, str]] = None) -> Tuple[int, int, int]:
    """(n_experts, hidden, intermediate) of a gpt-oss experts block's tensors, each one
    checked against the shapes the others imply: the split layout (``gate_up_blocks``
    (E, 2F, H/32, 16), ``gate_up_scales`` (E, 2F, H/32), ``down_blocks`` (E, H, F/32,
    16), ``down_scales`` (E, H, F/32)) or llama.cpp's (``gate_blocks`` and ``up_blocks``
    (E, F, H/32, 17), ``down_blocks`` (E, H, F/32, 17)); the biases (n_experts, 2F) (or
    gate and up (n_experts, F)) and (n_experts, H), n_experts = E or, with
    ``expert_range``, at least its end.  A ValueError naming the tensor (``names``: the
    file's names for the arguments), its shape and the shape expected."""
    expert_range = None if expert_range is None else parse_expert_range(expert_range)
    n = {k: (names or {}).get(k, k) for k in tensors}
    gguf = "gate_blocks" in tensors
    width = GGUF_BLOCK_BYTES if gguf else GROUP_BYTES
    first = "gate_blocks" if gguf else "gate_up_blocks"
    blocks = check_tensor(n[first], tensors[first], (None, None, None, width),
                          f"MXFP4 blocks: n_experts, rows, hidden/32, {width}",
                          floating=False)
    e, rows, g_h, _ = blocks.shape
    if gguf:
        f = rows
        check_tensor(n["up_blocks"], tensors["up_blocks"], tuple(blocks.shape),
                     "the up experts, as the gate's", floating=False)
    else:
        if rows % 2:
            raise ValueError(f"{n[first]}: {rows} rows (shape {tuple(blocks.shape)}), "
                             f"expected an even number (gate and up rows interleaved)")
        f = rows // 2
        check_tensor(n["gate_up_scales"], tensors["gate_up_scales"], (e, rows, g_h),
                     "a scale byte per group of the blocks", floating=False)
    h = GROUP * g_h
    if f % GROUP:
        raise ValueError(f"{n[first]}: an intermediate size of {f} (shape "
                         f"{tuple(blocks.shape)}), expected a multiple of {GROUP} (the down "
                         f"experts' groups)")
    check_tensor(n["down_blocks"], tensors["down_blocks"], (e, h, f // GROUP, width),
                 f"MXFP4 blocks: n_experts, hidden, intermediate/32, {width}, the "
                 f"gate/up blocks' sizes", floating=False)
    if gguf:
        total = _bias_rows(n["gate_bias"], tensors["gate_bias"], f, e, expert_range)
        check_tensor(n["up_bias"], tensors["up_bias"], (total, f), "as the gate's bias")
    else:
        check_tensor(n["down_scales"], tensors["down_scales"], (e, h, f // GROUP),
                     "a scale byte per group of the down blocks", floating=False)
        total = _bias_rows(n["gate_up_bias"], tensors["gate_up_bias"], 2 * f, e,
                           expert_range)
    check_tensor(n["down_bias"], tensors["down_bias"], (total, h),
                 "n_experts by hidden, as the gate/up bias and the blocks")
    return total, h, f


class GptOssExperts(BytesByView):
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
    num_threads = NumThreads()  # checked whenever it is set
    # load_state_dict reads these by view (int8, float8_e8m0fnu), never by value
    _byte_buffers = ("gate_up_blocks", "gate_up_scales", "gate_blocks", "up_blocks",
                     "down_blocks", "down_scales")

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
        self.num_threads = num_threads
        rng = None if expert_range is None else parse_expert_range(expert_range)
        self.n_experts, self.hidden_size, self.intermediate_size = check_experts(dict(zip(
            _SPLIT, (gate_up_blocks, gate_up_scales, gate_up_bias, down_blocks, down_scales,
                     down_bias), strict=True)), rng)
        e = gate_up_blocks.shape[0]
        self.expert_range, self.group = expert_range_of(rng, e, group), group
        self.limit, self.alpha = float(limit), float(alpha)
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
                         limit: float = 7.0, alpha: float = 1.702,
                         num_threads: Optional[int] = None, expert_range=None,
                         group=None) -> "GptOssExperts":
        """The block from llama.cpp's tensors: GGUF block_mxfp4 blocks gate and up (E, F,
        H/32, 17), down (E, H, F/32, 17), read in place; biases gate, up (E, F) and down
        (E, H); the other arguments as the constructor's."""
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        m.num_threads = num_threads
        rng = None if expert_range is None else parse_expert_range(expert_range)
        dims = check_experts(dict(zip(_GGUF, (gate_blocks, up_blocks, gate_bias, up_bias,
                                              down_blocks, down_bias), strict=True)), rng)
        gate_up_bias = torch.stack((gate_bias, up_bias), dim=-1).flatten(-2)  # interleaved
        m.n_experts, m.hidden_size, m.intermediate_size = dims
        m.expert_range, m.group = expert_range_of(rng, gate_blocks.shape[0], group), group
        m.limit, m.alpha = float(limit), float(alpha)
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
    def from_checkpoint(cls, path, layer: int, prefix: Optional[str] = None, *,
                        limit: Optional[float] = None, alpha: Optional[float] = None,
                        num_threads: Optional[int] = None, expert_range=None,
                        group=None) -> "GptOssExperts":
        """One layer's experts from a gpt-oss checkpoint: safetensors (a file, a
        directory, or an open SafeTensorsCheckpoint) or GGUF (a ``.gguf`` file, a split
        set, or an open GGUFCheckpoint), expert bytes memory-mapped, not copied; with
        ``expert_range=(e0, e1)`` (or ``range(e0, e1)``) only those experts' bytes are
        mapped; the other arguments as the constructor's.  The tensors' names are the
        family's (``mxfp4x.checkpoints.families.GPT_OSS``), after ``prefix`` (None: the
        one the file uses).  ``limit`` and ``alpha`` None: the checkpoint's config.json's
        ``swiglu_limit`` and ``swiglu_alpha`` where it states them (:func:`activation`;
        a GGUF file: 7.0 and 1.702)."""
        num_threads_arg(num_threads)  # what is given, checked before any file is read
        rng = None if expert_range is None else parse_expert_range(expert_range)
        gguf = _gguf_of(path)
        if gguf is not None:
            return _gguf_experts(gguf, layer, limit=7.0 if limit is None else limit,
                                 alpha=1.702 if alpha is None else alpha,
                                 num_threads=num_threads, expert_range=rng, group=group)
        ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
        if limit is None or alpha is None:
            limit, alpha = activation(*checkpoint_config(ckpt.root), limit, alpha)
        p = ck.find_prefix(ckpt, GPT_OSS, layer) if prefix is None else prefix
        names = tensor_names(p, layer)
        # the bytes (typed U8, I8 or F8_E8M0, read by view) as verify hashes them
        stacks = ck.load_stacked_experts(ckpt, GPT_OSS, layer, p, rng)
        t = {f"{role}_{kind}": stacks[role][i] for role in ("gate_up", "down")
             for i, kind in enumerate(("blocks", "scales"))}
        t.update({arg: ckpt.get(names[arg]) for arg in ("gate_up_bias", "down_bias")})
        check_experts(t, rng, {arg: _where(ckpt, name) for arg, name in names.items()})
        return cls(t["gate_up_blocks"], t["gate_up_scales"], t["gate_up_bias"],
                   t["down_blocks"], t["down_scales"], t["down_bias"], limit=limit,
                   alpha=alpha, num_threads=num_threads, expert_range=rng, group=group)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        if self.group is not None:  # the whole forward inside the ranks' agreement
            from ..distributed import _scope
            return _scope.run(self.group, self, self._forward, hidden_states,
                              router_indices, routing_weights)
        return self._forward(hidden_states, router_indices, routing_weights)

    def _forward(self, hidden_states, router_indices, routing_weights) -> torch.Tensor:
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
    if group is not None:  # the whole computation inside the ranks' agreement
        from ..distributed import _scope
        return _scope.run(group, None, _experts_parallel, hidden_states, router_indices,
                          routing_weights, gate_up, gate_up_bias, down, down_bias, limit,
                          alpha, num_threads, expert_range, group)
    return _experts_parallel(hidden_states, router_indices, routing_weights, gate_up,
                             gate_up_bias, down, down_bias, limit, alpha, num_threads,
                             expert_range, group)


def _experts_parallel(hidden_states, router_indices, routing_weights, gate_up, gate_up_bias,
                      down, down_bias, limit, alpha, num_threads, expert_range, group):
    """gpt_oss_experts' body (on one process when ``group`` is None)."""
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
    acc = accumulation_dtype(out_dtype)
    gate_up_out = gate_up_out.to(acc) + gate_up_bias[router_indices].to(acc)
    gate, up = gate_up_out[..., 0::2], gate_up_out[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    act = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    weights = torch.as_tensor(routing_weights).to(acc)
    bias = (weights.unsqueeze(-1) * down_bias[router_indices].to(acc)).sum(1)
    out = combined(act, down[0], down[1], router_indices, weights, bias,
                   num_threads=num_threads)
    return out.to(out_dtype)


class GptOssMoE(torch.nn.Module):
    """One gpt-oss MoE layer: ``forward(x (T, H)) -> (T, H)``, the router then the experts
    (:class:`GptOssRouter`, :class:`GptOssExperts`)."""

    def __init__(self, router: GptOssRouter, experts: GptOssExperts):
        super().__init__()
        check_router(router.weight, router.bias, experts)
        self.router, self.experts = router, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.group is not None:
            # the router inside the ranks' agreement too: its failure on one rank reaches
            # every rank (mxfp4x.distributed._scope)
            from ..distributed import _scope
            return _scope.run(self.experts.group, self, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        selected, weights = self.router(x)
        return self.experts(x, selected, weights)

    @classmethod
    def from_checkpoint(cls, path, layer: int, top_k: Optional[int] = None,
                        expert_range=None, num_threads: Optional[int] = None,
                        group=None) -> "GptOssMoE":
        """Layer ``layer`` of a gpt-oss checkpoint (a file or a folder); ``top_k`` from its
        config.json unless given (``num_experts_per_tok``, transformers' name, or
        ``experts_per_token``, openai's; the release states both), and the activation's
        ``swiglu_limit`` and ``swiglu_alpha`` (:func:`activation`), every key read as
        transformers' GptOssConfig reads it; ``expert_range=(e0, e1)`` maps
        only those experts' bytes (expert-parallel with ``group``). A GGUF file (or split
        set) gives the router, the biases and ``top_k`` (``gpt-oss.expert_used_count``)
        too."""
        num_threads_arg(num_threads)  # what is given, checked before any file is read
        rng = None if expert_range is None else parse_expert_range(expert_range)
        gguf = _gguf_of(path)
        if gguf is not None:
            naming = gguf_naming(gguf.architecture)
            if top_k is None:
                top_k = gguf_integer(gguf, f"{gguf.architecture}.expert_used_count")
            experts = _gguf_experts(gguf, layer, expert_range=rng, num_threads=num_threads,
                                    group=group)
            names = (naming.router.format(layer=layer),
                     (naming.router_bias or "").format(layer=layer))  # gpt-oss's has a bias
            for name in names:
                if name not in gguf:
                    raise ValueError(f"{gguf.root}: no tensor {name!r} (the router of layer "
                                     f"{layer})")
            weight, bias = (gguf.get(name) for name in names)
            check_router(weight, bias, experts,
                         [f"{gguf.tensor(name).path}: tensor {name!r}" for name in names])
            return cls(GptOssRouter(weight, bias, top_k), experts)
        ckpt = path if isinstance(path, SafeTensorsCheckpoint) else SafeTensorsCheckpoint(path)
        # top_k given, a file without its config.json: gpt-oss's activation
        config, source = checkpoint_config(ckpt.root, required=top_k is None)
        if top_k is None:
            key = GPT_OSS.top_k_key
            if key not in config:
                known = [key] + [a for a, k in GPT_OSS.config_aliases.items() if k == key]
                raise ValueError(f"{source}: " + " or ".join(map(repr, known)) +
                                 " is missing; pass top_k=")
            top_k = config[key]
        limit, alpha = activation(config, source)
        prefix = ck.find_prefix(ckpt, GPT_OSS, layer)
        experts = GptOssExperts.from_checkpoint(ckpt, layer, prefix, expert_range=rng,
                                                num_threads=num_threads, group=group,
                                                limit=limit, alpha=alpha)
        def stated(key):
            return _integer(f"{source}: {key}", config[key]) if key in config else None
        check_dims(source, {
            GPT_OSS.n_experts_key: (stated(GPT_OSS.n_experts_key), experts.n_experts,
                                    "the experts' biases hold"),
            "hidden_size": (stated("hidden_size"), experts.hidden_size,
                            "the experts' blocks are"),
            "intermediate_size": (stated("intermediate_size"), experts.intermediate_size,
                                  "the experts' blocks are")})
        router = [prefix + pattern.format(layer=layer)
                  for pattern in (GPT_OSS.router, str(GPT_OSS.router_bias))]
        weight, bias = (ckpt.get(name) for name in router)
        check_router(weight, bias, experts, [_where(ckpt, name) for name in router])
        return cls(GptOssRouter(weight, bias, top_k), experts)


def load_gpt_oss_experts(path: str, layers: Optional[Sequence[int]] = None,
                         progress: bool = True, *, limit: Optional[float] = None,
                         alpha: Optional[float] = None, num_threads: Optional[int] = None,
                         expert_range=None, group=None) -> List[GptOssExperts]:
    """Every (or the given) layer's experts of a gpt-oss checkpoint, memory-mapped, with a
    progress bar on stderr (plain lines when it is not a terminal); the other arguments
    as :meth:`GptOssExperts.from_checkpoint`'s, the same for every layer."""
    num_threads_arg(num_threads)  # what is given, checked before any file is read
    rng = None if expert_range is None else parse_expert_range(expert_range)
    ckpt = SafeTensorsCheckpoint(path)
    if limit is None or alpha is None:  # config.json read once for every layer
        limit, alpha = activation(*checkpoint_config(ckpt.root), limit, alpha)
    if layers is None:  # found by name: every layer whose experts the files hold
        layers = ck.moe_layers(ckpt, GPT_OSS)
    out = []
    bar = Progress(len(layers), "loading experts") if progress else None
    for i, layer in enumerate(layers):
        out.append(GptOssExperts.from_checkpoint(ckpt, layer, limit=limit, alpha=alpha,
                                                 num_threads=num_threads, expert_range=rng,
                                                 group=group))
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


def _where(ckpt: SafeTensorsCheckpoint, name: str) -> str:
    """A checkpoint tensor named as errors name it: its file and its name."""
    return f"{ckpt.byte_range(name)[0] if name in ckpt else ckpt.root}: tensor {name!r}"


def check_router(weight: torch.Tensor, bias: torch.Tensor, experts: GptOssExperts,
                 names: Sequence[str] = ("router weight", "router bias")) -> None:
    """The router's weight (n_experts, hidden) and bias (n_experts,) against the experts
    they route to: a row per expert the experts' biases hold, the blocks' hidden size (a
    row short and an expert is never chosen; a row over and a token routed there fails,
    or reaches an expert of another rank)."""
    n, h = experts.n_experts, experts.hidden_size
    check_tensor(names[0], weight, (n, h), "n_experts by hidden, as the experts hold")
    check_tensor(names[1], bias, (n,), "one per expert")


def _gguf_experts(ckpt, layer: int, *, limit: float = 7.0, alpha: float = 1.702,
                  num_threads: Optional[int] = None,
                  expert_range: Optional[ExpertRange] = None, group=None) -> GptOssExperts:
    """Layer ``layer``'s experts of a gpt-oss GGUF (llama.cpp's names, families.py);
    ``expert_range`` parsed already."""
    if ckpt.architecture != "gpt-oss":
        raise ValueError(f"{ckpt.root}: architecture {ckpt.architecture!r}, expected "
                         f"'gpt-oss' (llama.cpp's name for gpt-oss GGUF files)")
    naming = gguf_naming(ckpt.architecture)
    blocks = load_gguf_experts(ckpt, layer, expert_range, naming=naming)
    names = {f"{role}_blocks": naming.experts.format(layer=layer, proj=naming.roles[role])
             for role in ("gate", "up", "down")}
    names.update({f"{role}_bias": str(naming.expert_bias).format(layer=layer,
                                                                 proj=naming.roles[role])
                  for role in ("gate", "up", "down")})
    t = {f"{role}_blocks": blocks[role] for role in ("gate", "up", "down")}
    for role in ("gate", "up", "down"):
        name = names[f"{role}_bias"]
        if name not in ckpt:
            raise ValueError(f"{ckpt.root}: no tensor {name!r} (the {role} experts' bias "
                             f"of layer {layer})")
        t[f"{role}_bias"] = ckpt.get(name)
    total, hidden, ff = check_experts(
        t, expert_range,
        {arg: f"{ckpt.tensor(name).path}: tensor {name!r}" for arg, name in names.items()})
    # the sizes the metadata states, where it does (llama.cpp's converter writes them)
    sizes = ((f"{ckpt.architecture}.expert_count", total, "the experts' biases hold"),
             (f"{ckpt.architecture}.embedding_length", hidden, "the experts' blocks are"),
             (f"{ckpt.architecture}.expert_feed_forward_length", ff,
              "the experts' blocks are"))
    check_dims(str(ckpt.root), {key: (gguf_integer_if_any(ckpt, key), found, what)
                                for key, found, what in sizes})
    return GptOssExperts.from_gguf_blocks(
        t["gate_blocks"], t["up_blocks"], t["gate_bias"], t["up_bias"], t["down_blocks"],
        t["down_bias"], limit=limit, alpha=alpha, num_threads=num_threads,
        expert_range=expert_range, group=group)
