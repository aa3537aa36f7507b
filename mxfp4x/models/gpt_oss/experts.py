"""gpt-oss's experts in MXFP4 (:class:`GptOssExperts`): the gate/up product per slot, the
clamped SwiGLU, the down product with the weighted combine; the same as a function of
the tensors (:func:`gpt_oss_experts`), for modules that hold them under other names."""
import functools
from typing import NamedTuple, Optional

import torch

from ..._core.activation import gpt_oss_swiglu, mix_rows
from ..._core.api import mxfp4_experts, mxfp4_experts_slots
from ..._core.arguments import NumThreads, num_threads_arg, parse_expert_range
from ..._core.format import accumulation_dtype
from ..._core.weak_group import WeakGroup
from .._common import BytesByView, bytes_of, expert_range_of, held_ids
from .tensors import _GGUF, _SPLIT, check_experts


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

    Some of the experts: with ``expert_range=(e0, e1)`` the block buffers hold experts
    e0..e1-1 (the biases, small, stay whole).  With ``group`` both projections run
    through :mod:`mxfp4x.distributed` (the gate/up per slot, the down combined); without,
    a token routed to an expert outside the range is an IndexError.

    From a GGUF file (:meth:`from_checkpoint` on a ``.gguf``; llama.cpp splits gate/up
    into gate rows ``0::2`` and up rows ``1::2``): :meth:`from_gguf_blocks`, buffers
    ``gate_blocks`` and ``up_blocks`` (E, F, H/32, 17) and ``down_blocks`` (E, H, F/32,
    17) of GGUF block_mxfp4 blocks read in place, the scale buffers None; the gate and
    up products run as two calls, interleaved back into ``gate_up``'s order.
    """

    group = WeakGroup()  # held weakly: _core/weak_group.py
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
        from .gguf import _gguf_of, experts_from_gguf  # here: they import this module
        from .loading import experts_from_safetensors

        gguf = _gguf_of(path)
        if gguf is not None:
            return experts_from_gguf(gguf, layer, limit=7.0 if limit is None else limit,
                                     alpha=1.702 if alpha is None else alpha,
                                     num_threads=num_threads, expert_range=rng, group=group)
        return experts_from_safetensors(cls, path, layer, prefix, limit=limit, alpha=alpha,
                                        num_threads=num_threads, expert_range=rng,
                                        group=group)

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        if self.group is not None:  # the whole forward inside the ranks' agreement
            from ...distributed import _scope
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
                    group=None, act_dtype: Optional[torch.dtype] = None,
                    isa: Optional[str] = None) -> torch.Tensor:
    """The forward of :class:`GptOssExperts` as a function: ``gate_up`` and ``down`` are
    (blocks, scales) pairs of uint8 tensors in the checkpoint's layout (scales None:
    GGUF blocks; ``gate_up`` may be a :class:`GateAndUp` of GGUF blocks); the modules
    that hold these tensors under other names (``mxfp4x.integrations.transformers``) call
    it.  ``act_dtype``: the dtype the SwiGLU output is rounded to (once) before the down
    projection; None keeps it in the accumulation dtype (float32, float64 for float64).
    ``isa``: the CPU instruction set of both projections (None: the process's default)."""
    if group is not None:  # the whole computation inside the ranks' agreement
        from ...distributed import _scope
        return _scope.run(group, None, _experts_parallel, hidden_states, router_indices,
                          routing_weights, gate_up, gate_up_bias, down, down_bias, limit,
                          alpha, num_threads, expert_range, group, act_dtype, isa)
    return _experts_parallel(hidden_states, router_indices, routing_weights, gate_up,
                             gate_up_bias, down, down_bias, limit, alpha, num_threads,
                             expert_range, group, act_dtype, isa)


def _experts_parallel(hidden_states, router_indices, routing_weights, gate_up, gate_up_bias,
                      down, down_bias, limit, alpha, num_threads, expert_range, group,
                      act_dtype=None, isa=None):
    """gpt_oss_experts' body (on one process when ``group`` is None)."""
    slots = functools.partial(mxfp4_experts_slots, isa=isa)
    combined = functools.partial(mxfp4_experts, isa=isa)
    weight_ids = router_indices  # the biases, whole, take the global ids
    if group is None and expert_range is not None and expert_range[0]:
        weight_ids = held_ids(router_indices, expert_range)  # some experts, no group
    if group is not None:
        from ... import distributed
        slots = functools.partial(distributed.mxfp4_experts_slots,
                                  expert_range=expert_range, group=group, isa=isa)
        combined = functools.partial(distributed.mxfp4_experts,
                                     expert_range=expert_range, group=group, isa=isa)
    if isinstance(gate_up, GateAndUp):  # two calls, interleaved back: rows 2j gate, 2j+1 up
        gate_out = slots(hidden_states, gate_up.gate, None, weight_ids,
                         num_threads=num_threads)  # checks the inputs
        up_out = slots(hidden_states, gate_up.up, None, weight_ids,
                       num_threads=num_threads)
        gate_up_out = torch.stack((gate_out, up_out), dim=-1).flatten(-2)
    else:
        gate_up_out = slots(hidden_states, gate_up[0], gate_up[1], weight_ids,
                            num_threads=num_threads)  # checks the inputs
    out_dtype = gate_up_out.dtype  # the latents' (integer latents: the default float dtype)
    acc = accumulation_dtype(out_dtype)
    act = gpt_oss_swiglu(gate_up_out, gate_up_bias, router_indices, limit, alpha,
                         act_dtype, num_threads=num_threads, isa=isa)
    weights = torch.as_tensor(routing_weights).to(acc)
    bias = mix_rows(weights, down_bias, router_indices, num_threads=num_threads, isa=isa)
    out = combined(act, down[0], down[1], weight_ids, weights, bias,
                   num_threads=num_threads)
    return out.to(out_dtype)
