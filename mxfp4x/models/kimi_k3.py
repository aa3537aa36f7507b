"""The Kimi K3 MoE block over the mxfp4x ops (``mxfp4x.nn.KimiK3*``), and its float64
reference.

The block (Moonshot's ``KimiSparseMoeBlock`` in ``modeling_kimi_linear.py``):

    sel, p = router(x)                          sigmoid scores, biased choice, top-k
    h = down_proj(x)                            latent MoE: hidden -> latent
    y = sum_k p_k w2_e (situ(w1_e h) * clip(w3_e h))   routed experts, in MXFP4
    y = up_proj(rms_norm(y))                    latent -> hidden
    out = y + shared(x)                         shared experts: a dense SiTU MLP

with situ(g) = beta tanh(g / beta) sigmoid(g), clip(u) = beta_lin tanh(u / beta_lin)
(config ``activation_situ_beta`` 4.0, ``activation_situ_linear_beta`` 25.0).

``KimiK3MoE.from_checkpoint`` reads the release's safetensors layout or llama.cpp's GGUF
files (architecture ``kimi-k3``; :func:`from_gguf`): there the experts stay GGUF blocks,
read in place.
"""
import os
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .. import _dense
from .._api import mxfp4_experts, mxfp4_experts_slots
from .._format import accumulation_dtype
from .._progress import Progress
from .._validation import (
    ExpertRange,
    NumThreads,
    WeakGroup,
    as_tensor,
    check_isa,
    float_tensor,
    index_tensor,
    num_threads_arg,
    parse_expert_range,
)
from ..checkpoints import families as ck
from ..checkpoints.gguf import MXFP4, GGUFCheckpoint, is_gguf
from ._common import (
    _flag,
    _integer,
    _positive,
    _real,
    check_dims,
    check_routing,
    check_tensor,
    expert_range_of,
    gguf_integer,
    gguf_integer_if_any,
)
from ._expert_state import ExpertMatrix, _ExpertWeights, _matrix_shape, _split, _Stamp, _Weights


def _listed(scales):
    """A scale tuple as the ops take it: a list, or None for GGUF blocks."""
    return None if scales is None else list(scales)


def situ(g, beta):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def clip(u, linear_beta):
    return u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)




class KimiK3Experts(torch.nn.Module):
    """The routed experts of a Kimi K3 layer, in the latent space:
    ``forward(h (T, L), selected_experts (T, K), routing_weights (T, K)) -> (T, L)``,
    ``sum_k p_k w2_e (situ(w1_e h) * clip(w3_e h))``.

    ``w1``, ``w3``, ``w2`` are (packed, scales) of gate, up and down: lists of per-expert
    tensors ((O, in/2) or (O, in/32, 16) bytes, (O, in/32) scales), as the checkpoint
    holds them, or stacked tensors; never copied.  ``(blocks, None)``: GGUF block_mxfp4
    blocks (llama.cpp's arrangement, ``scale_bytes=None`` in the ops), a stacked (E, O,
    in/32, 17) tensor (e.g. a view of a mapped GGUF file) or a list of (O, in/32, 17),
    read in place; all three projections in one arrangement.  They become module state:
    expert ``e`` is the child module ``str(e)`` with ``w1``, ``w3``, ``w2`` each holding
    buffers ``weight_packed`` and ``weight_scale`` (the checkpoint's own names, so
    ``state_dict()`` keys read ``{e}.w1.weight_packed``; for GGUF blocks
    ``weight_packed`` holds the blocks and ``weight_scale`` is None), and ``.to()``,
    ``state_dict()`` and ``load_state_dict()`` work on them.  The gate and up products
    run as one call of the per-slot op over the 2E matrices (each decoded once); SiTU and
    the clip in float32 (float64 for float64); the down product with the weighted
    combine.

    ``expert_range``: ``(e0, e1)`` (or ``range(e0, e1)``), the global ids of the experts
    held (default all, 0..E-1).  A module holding some of the experts (a process serving
    part of a layer) refuses tokens routed elsewhere, unless ``group`` (a
    torch.distributed process group, e.g. ``torch.distributed.group.WORLD``) is given:
    then the ranks' ranges cover all experts, and every token's pairs go to the ranks
    owning their experts, which run the whole expert MLP and send back one row per pair
    (one round trip, inference).  ``isa``: the CPU instruction set of its calls (None: the default),
    checked here.
    """

    group = WeakGroup()  # held weakly: _validation.WeakGroup
    num_threads = NumThreads()  # checked whenever it is set

    def __init__(self, w1, w3, w2, beta: float = 4.0, linear_beta: Optional[float] = 25.0,
                 expert_range=None,
                 num_threads: Optional[int] = None, isa: Optional[str] = None,
                 group=None):
        super().__init__()
        self.isa, self.group = check_isa(isa), group
        self.num_threads = num_threads
        self.beta, self.linear_beta = _positive("beta", beta), None if linear_beta is None \
            else _positive("linear_beta", linear_beta)
        self.last_routing = None
        g_packed, g_scales = _split("w1", w1)
        u_packed, u_scales = _split("w3", w3)
        d_packed, d_scales = _split("w2", w2)
        if not (len(g_packed) == len(u_packed) == len(d_packed) > 0):
            raise ValueError(f"w1, w3, w2: expected the same number of experts, got "
                             f"{len(g_packed)}, {len(u_packed)}, {len(d_packed)}")
        self.n_local = len(g_packed)
        gguf = [s is None for s in (g_scales, u_scales, d_scales)]
        if len(set(gguf)) > 1:
            raise ValueError("w1, w3, w2: one arrangement for all three: GGUF blocks "
                             "(blocks, None) for all, or (packed, scales) for all; got "
                             + ", ".join("GGUF blocks" if g else "(packed, scales)"
                                         for g in gguf))
        if gguf[0]:
            g_scales, u_scales, d_scales = ([None] * self.n_local,) * 3
        d_ff, d_latent = _matrix_shape("w1[0]", g_packed[0], g_scales[0])
        shapes = {"w1": (d_ff, d_latent), "w3": (d_ff, d_latent), "w2": (d_latent, d_ff)}
        for name, (packed, scales) in (("w1", (g_packed, g_scales)), ("w3", (u_packed, u_scales)),
                                       ("w2", (d_packed, d_scales))):
            for e, (p, sc) in enumerate(zip(packed, scales, strict=True)):
                got = _matrix_shape(f"{name}[{e}]", p, sc)
                if got != shapes[name]:
                    raise ValueError(f"{name}[{e}]: expected a {shapes[name][0]} x "
                                     f"{shapes[name][1]} matrix (as w1[0] says), got "
                                     f"{got[0]} x {got[1]}")
        self.d_latent, self.d_ff = d_latent, d_ff
        self.expert_range = expert_range_of(expert_range, self.n_local, group,
                                            subset_without_group=True)
        ids = self.expert_ids = list(range(*self.expert_range))
        self._stamp = _Stamp()
        for i, e in enumerate(ids):
            self.add_module(str(e), _ExpertWeights(
                ExpertMatrix(g_packed[i], g_scales[i]), ExpertMatrix(u_packed[i], u_scales[i]),
                ExpertMatrix(d_packed[i], d_scales[i])))
        lookup = torch.full((max(ids) + 1,), -1, dtype=torch.int64)
        lookup[torch.tensor(ids)] = torch.arange(self.n_local)
        self._local = lookup
        self._weights: Optional[_Weights] = None

    # ---- the weights: module state, and what the kernels get ------------------------------

    def _experts(self) -> List[_ExpertWeights]:
        return [self._modules[str(e)] for e in self.expert_ids]  # type: ignore[misc]

    def _link(self):
        """Every expert and expert matrix bumps this module's stamp when it changes (also
        ones put in after construction)."""
        for m in self._experts():
            m.__dict__["_stamp"] = self._stamp
            for mat in (m.w1, m.w3, m.w2):
                mat.__dict__["_stamp"] = self._stamp

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if "_stamp" in self.__dict__ and isinstance(value, torch.nn.Module):
            self._stamp.bump()

    def add_module(self, name, module):
        super().add_module(name, module)
        if "_stamp" in self.__dict__:
            self._stamp.bump()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._stamp.bump()
        return out

    def __getstate__(self):
        """Copies and pickles leave out the kernel tables (a lock and the driver's objects,
        rebuilt by the next call)."""
        state = dict(super().__getstate__())
        state["_weights"] = None
        return state

    def weights(self, local_ids: Optional[torch.Tensor] = None) -> _Weights:
        """The tensors the kernels read now (rebuilt after any change of the weights:
        replaced, moved, or, for the experts ``local_ids`` a call reads, given other
        memory by ``.data =`` / ``.set_()``)."""
        w = self._weights
        if w is None or w.stamp != self._stamp.value or (
                local_ids is not None and not w.current(torch.unique(local_ids).tolist())):
            self._link()
            w = self._weights = _Weights(self._stamp.value, self._experts())
        return w

    # what the kernels read now, as tuples (gate then up for the one per-slot call of both)
    gate_up_packed = property(lambda self: self.weights().gate_up_packed)
    gate_up_scales = property(lambda self: self.weights().gate_up_scales)
    down_packed = property(lambda self: self.weights().down_packed)
    down_scales = property(lambda self: self.weights().down_scales)

    # ---- checks ---------------------------------------------------------------------------

    def local_ids(self, selected_experts: torch.Tensor) -> torch.Tensor:
        """Local indices (0..n_local-1) of global expert ids; IndexError for an id this
        module does not hold."""
        sel = selected_experts.to(torch.int64)
        lookup = self._local if self._local.device == sel.device else self._local.to(sel.device)
        inside = (sel >= 0) & (sel < len(lookup))
        local = torch.where(inside, lookup[sel.clamp(0, len(lookup) - 1)], -1)
        if bool((local < 0).any()):
            bad = int(sel[local < 0][0])
            if bad < 0 and selected_experts.dtype == getattr(torch, "uint64", None):
                bad += 1 << 64  # an id >= 2^63, wrapped by the int64 view: as passed
            if self.expert_ids == list(range(self.n_local)):
                raise IndexError(f"selected_experts: expert id {bad} is outside [0, "
                                 f"{self.n_local}) (this module holds {self.n_local} experts)")
            raise IndexError(f"selected_experts: expert {bad} is not held by this module "
                             f"(it holds {self.n_local} experts, ids {self.expert_ids[0]}..."
                             f"{self.expert_ids[-1]})")
        return local

    def _check(self, h, selected_experts, routing_weights):
        """The op's checks, in the module's own terms: (h float, ids int64 local, weights)."""
        h = float_tensor("h", as_tensor("h", h))
        if h.dim() != 2 or h.shape[1] != self.d_latent:
            raise ValueError(f"h: expected (n_tokens, {self.d_latent}) latents, got shape "
                             f"{tuple(h.shape)}")
        sel = index_tensor("selected_experts", as_tensor("selected_experts", selected_experts))
        if sel.dim() != 2 or sel.shape[0] != h.shape[0]:
            raise ValueError(f"selected_experts: expected (n_tokens, top_k) = "
                             f"({h.shape[0]}, top_k) as h, got shape {tuple(sel.shape)}")
        mix = float_tensor("routing_weights", as_tensor("routing_weights", routing_weights))
        if tuple(mix.shape) != tuple(sel.shape):
            raise ValueError(f"routing_weights: expected shape {tuple(sel.shape)} as "
                             f"selected_experts, got {tuple(mix.shape)}")
        for name, t in (("selected_experts", sel), ("routing_weights", mix)):
            if t.device != h.device:
                raise ValueError(f"{name}: on device {t.device}, but h is on {h.device}")
        return h, self.local_ids(sel), mix

    # ---- compute --------------------------------------------------------------------------

    def _direct(self, x: torch.Tensor) -> bool:
        """CPU inference: call the driver with the tables built once (a K3 layer passes
        2688 expert tensors; re-reading them on every call would cost milliseconds)."""
        return x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad)

    def _slots(self, x, table_index, packed, scales, sel, w: _Weights):
        if self._direct(x):
            from .. import _cpu_impl
            return _cpu_impl.experts(x, w.cpu_tables()[table_index], None, sel.to(torch.int64),
                                     None, None, self.num_threads or 0, per_slot_outputs=True,
                                     isa=self.isa)
        return mxfp4_experts_slots(x, list(packed), _listed(scales), sel,
                                   num_threads=self.num_threads, isa=self.isa)

    def mlp(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """w2_e (situ(w1_e x) * clip(w3_e x)) per row (P, L), for local expert ids (P,):
        the per-pair work of an expert-parallel owner, in the compute dtype."""
        acc = accumulation_dtype(rows.dtype)
        w = self.weights(local_ids)
        ids = local_ids.view(-1, 1).to(torch.int64)
        gu = self._slots(rows, 0, w.gate_up_packed, w.gate_up_scales,
                         torch.cat((ids, ids + self.n_local), dim=1), w).to(acc)
        act = situ(gu[:, 0], self.beta) * clip(gu[:, 1], self.linear_beta)
        return self._slots(act, 1, w.down_packed, w.down_scales, ids, w)[:, 0]

    def forward(self, h: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            # the whole forward inside the ranks' agreement: an error on one rank reaches
            # every rank (mxfp4x.distributed._scope)
            from ..distributed import _scope
            return _scope.run(self.group, self, self._forward, h, selected_experts,
                              routing_weights)
        return self._one_process(h, selected_experts, routing_weights)

    def _forward(self, h, selected_experts, routing_weights) -> torch.Tensor:
        from ..distributed import expert_parallel
        out, self.last_routing = expert_parallel(
            self.mlp, h, selected_experts, routing_weights, expert_range=self.expert_range,
            d_out=self.d_latent, group=self.group, num_threads=self.num_threads, isa=self.isa)
        return out

    def _one_process(self, h, selected_experts, routing_weights) -> torch.Tensor:
        h, sel, mix = self._check(h, selected_experts, routing_weights)
        acc = accumulation_dtype(h.dtype)
        w = self.weights(sel)
        top_k = sel.shape[1]
        both = torch.cat((sel, sel + self.n_local), dim=1)  # gate slots, then up slots
        gu = self._slots(h, 0, w.gate_up_packed, w.gate_up_scales, both, w).to(acc)
        act = situ(gu[:, :top_k], self.beta) * clip(gu[:, top_k:], self.linear_beta)
        zeros = torch.zeros((h.shape[0], self.d_latent), dtype=acc, device=h.device)
        if self._direct(act) and self._direct(h):
            from .. import _cpu_impl
            out = _cpu_impl.experts(act, w.cpu_tables()[1], None, sel, mix.to(acc), zeros,
                                    self.num_threads or 0, isa=self.isa)
        else:
            out = mxfp4_experts(act, list(w.down_packed), _listed(w.down_scales), sel,
                                mix.to(acc), zeros, num_threads=self.num_threads, isa=self.isa)
        return out.to(h.dtype)

    def extra_repr(self) -> str:
        form = ", gguf blocks" if self._experts()[0].w1.weight_scale is None else ""
        return (f"n_experts={self.n_local}, d_latent={self.d_latent}, d_ff={self.d_ff}, "
                f"beta={self.beta}, linear_beta={self.linear_beta}{form}")


def block_config(config: dict, source: str) -> Dict[str, Any]:
    """The block's hyperparameters from ``config`` (config.json's names), each checked:
    ``num_experts`` and ``num_experts_per_token`` required; the group counts 1 where
    missing or null (no grouped routing); ``routed_scaling_factor`` 1.0, ``moe_renormalize``
    true and ``rms_norm_eps`` 1e-5 where missing.  A ValueError naming ``source`` and the
    key otherwise (a missing key, a string, a null)."""
    def get(name, default=None, required=False):
        if name not in config:
            if required:
                raise ValueError(f"{source}: {name!r} is missing")
            return default
        return config[name]

    n_experts = _integer(f"{source}: num_experts", get("num_experts", required=True))
    groups = get("num_expert_group")
    chosen = get("topk_group")
    top_k, n_group, topk_group = check_routing(
        n_experts, get("num_experts_per_token", required=True),
        1 if groups is None else groups, 1 if chosen is None else chosen, source)
    eps = _real(f"{source}: rms_norm_eps", get("rms_norm_eps", 1e-5))
    if eps <= 0:
        raise ValueError(f"{source}: rms_norm_eps: expected a positive number, got {eps!r}")
    return dict(num_experts=n_experts, num_experts_per_token=top_k, num_expert_group=n_group,
                topk_group=topk_group,
                routed_scaling_factor=_real(f"{source}: routed_scaling_factor",
                                            get("routed_scaling_factor", 1.0)),
                moe_renormalize=_flag(f"{source}: moe_renormalize",
                                      get("moe_renormalize", True)),
                rms_norm_eps=eps)


def situ_betas(config: dict, source: str = "config.json"):
    """(beta, linear_beta) of SiTU from a K3 text config.  The released config states
    both (4.0 and 25.0); the public ports disagree on what a missing key means (1.0 in
    some readers, 4.0 in others), so a config without them is refused rather than
    guessed.  ``activation_situ_linear_beta`` may be null (no clip on the up branch)."""
    for key in ("activation_situ_beta", "activation_situ_linear_beta"):
        if key not in config:
            raise ValueError(f"{source}: {key!r} is missing; Kimi K3's config states it "
                             f"(4.0 and 25.0 as released)")
    beta = _positive(f"{source}: activation_situ_beta", config["activation_situ_beta"])
    linear = config["activation_situ_linear_beta"]
    return beta, None if linear is None else _positive(
        f"{source}: activation_situ_linear_beta", linear)


class KimiK3Router(torch.nn.Module):
    """The sigmoid router: ``forward(x (T, H)) -> (selected (T, K) int64, weights (T, K))``.

    scores = sigmoid(x W^T) in float32 (float64 for float64 x); the choice ranks
    scores + ``e_score_correction_bias`` (grouped when ``n_group > topk_group > 0``: the
    ``topk_group`` groups with the best two-expert sums); the weights are the unbiased
    scores of the chosen experts, renormalised to sum to 1 (``renormalize``), times
    ``scaling``.  Ties go to the lower expert id (a stable sort), so the choice is
    deterministic.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                 renormalize: bool = True, scaling: float = 1.0, n_group: int = 1,
                 topk_group: int = 1):
        super().__init__()
        if weight.dim() != 2 or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"router: expected a weight (n_experts, hidden) and a bias "
                             f"(n_experts,), got {tuple(weight.shape)} and "
                             f"{tuple(bias.shape)}")
        routing = check_routing(weight.shape[0], top_k, n_group, topk_group, "router")
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = routing
        self.renormalize = _flag("router: renormalize", renormalize)
        self.scaling = _real("router: scaling", scaling)
        self._wide: tuple = ()  # (what the weight was, it in the accumulation dtype, its memory)

    def _weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The router weight in the accumulation dtype, converted once (not per call: at
        one token, converting the bf16 weight cost more than the product) and again only
        when the weight is replaced or modified in place."""
        w = self.weight
        if w.dtype == dtype or (w.requires_grad and torch.is_grad_enabled()):
            return w.to(dtype)
        key = (w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape), dtype)
        wide = self._wide  # read once: a call in another thread may replace it meanwhile
        if not wide or wide[0] != key:
            # the entry keeps the converted weight's source memory alive: a weight put in
            # its place later cannot reuse that address and pass for it
            wide = self._wide = (key, w.detach().to(dtype), w.detach())
        return wide[1]

    def __getstate__(self):
        """Copies and pickles leave the converted weight out (made again when needed)."""
        state = self.__dict__.copy()
        state["_wide"] = ()
        return state

    def forward(self, x: torch.Tensor, num_threads: Optional[int] = None):
        """``num_threads``: the CPU threads of the scores' compiled product (None:
        torch.get_num_threads()); :class:`KimiK3MoE` passes its experts' count."""
        acc = accumulation_dtype(x.dtype)
        if acc == torch.float32 and _dense.takes(x, self.weight):
            # a few tokens, bf16 weight: the product of the float32-widened weight, read
            # as bf16 at the memory's rate (mxfp4x._dense)
            scores = torch.sigmoid(_dense.linear(x, self.weight, num_threads=num_threads,
                                                 out_dtype=acc))
        else:
            scores = torch.sigmoid(F.linear(x.to(acc), self._weight_in(acc)))
        choice = scores + self.bias.to(acc)
        n_tok, n_exp = choice.shape
        if self.n_group > 1 and self.n_group > self.topk_group:
            groups = choice.view(n_tok, self.n_group, -1)
            group_score = groups.topk(2, dim=-1).values.sum(-1)
            keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool)
            mask.scatter_(1, keep[:, :self.topk_group], True)
            choice = choice.masked_fill(~mask.repeat_interleave(n_exp // self.n_group, 1),
                                        float("-inf"))
        selected = torch.sort(choice, dim=-1, descending=True, stable=True).indices
        selected = selected[:, :self.top_k]
        weights = scores.gather(1, selected)
        if self.top_k > 1 and self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return selected, weights * self.scaling


# the block's dense tensors: KimiK3MoE's arguments, what each is, and the checkpoint's name
DENSE_PARTS = {
    "down_proj": ("the latent down projection", "routed_expert_down_proj.weight"),
    "norm_weight": ("the latent norm", "routed_expert_norm.weight"),
    "up_proj": ("the latent up projection", "routed_expert_up_proj.weight"),
    "shared_gate": ("the shared experts' gate", "shared_experts.gate_proj.weight"),
    "shared_up": ("the shared experts' up", "shared_experts.up_proj.weight"),
    "shared_down": ("the shared experts' down", "shared_experts.down_proj.weight"),
}


def dense_shapes(hidden: int, latent: int, d_shared: int) -> Dict[str, tuple]:
    """The shape of each dense tensor of a block (by :data:`DENSE_PARTS` name) that the
    router's hidden size, the routed experts' latent size and the shared experts' width
    imply: what a checkpoint's tensors are checked against, from either file format."""
    return {"down_proj": (latent, hidden), "norm_weight": (latent,),
            "up_proj": (hidden, latent), "shared_gate": (d_shared, hidden),
            "shared_up": (d_shared, hidden), "shared_down": (hidden, d_shared)}


def check_block(router_weight: torch.Tensor, experts: "KimiK3Experts",
                dense: Mapping[str, Optional[torch.Tensor]],
                names: Optional[Dict[str, str]] = None) -> Dict[str, int]:
    """Every dense tensor of a block (``dense``: by :data:`DENSE_PARTS` name, the norm
    None for none) against the shape the router (n_experts, hidden), the routed experts'
    latent size and the shared experts' gate (d_shared, hidden) imply; the router's
    experts against the ids ``experts`` holds.  A ValueError naming the tensor (``names``:
    as the file names it), its shape and the shape expected: a tensor of one row would
    broadcast, silently, in the forward.  Returns the sizes (hidden, latent, d_shared)."""
    def name(k):
        return (names or {}).get(k, k)

    rows, hidden = check_tensor(name("router"), router_weight, (None, None),
                                "the router: n_experts by hidden").shape
    if experts.expert_range[1] > rows:
        raise ValueError(f"{name('router')}: the router scores {rows} experts, but the "
                         f"routed experts hold ids {experts.expert_range[0]} to "
                         f"{experts.expert_range[1] - 1}")
    gate = check_tensor(name("shared_gate"), dense["shared_gate"], (None, hidden),
                        DENSE_PARTS["shared_gate"][0] + ": d_shared by hidden")
    shapes = dense_shapes(hidden, experts.d_latent, gate.shape[0])
    for k, (what, _) in DENSE_PARTS.items():
        if dense[k] is not None or k != "norm_weight":
            check_tensor(name(k), dense[k], shapes[k], what)
    return dict(hidden=hidden, latent=experts.d_latent, d_shared=gate.shape[0])


def _rms_norm(y, weight, eps):
    """Moonshot's KimiRMSNorm: normalise in float32 (float64 for float64), then weight."""
    z = y.to(accumulation_dtype(y.dtype))
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(y.dtype) * z.to(y.dtype)


def _linear(x, w, num_threads):
    """F.linear with the weight in x's dtype; bf16 weights at a few tokens through the
    compiled kernels on ``num_threads`` threads (mxfp4x._dense: torch's bf16
    matrix-vector product reads them at about half the memory's rate)."""
    return _dense.linear(x, w, num_threads=num_threads)


class KimiK3MoE(torch.nn.Module):
    """One Kimi K3 MoE layer: ``forward(x (T, hidden)) -> (T, hidden)`` (see the module
    docstring).  The dense parts (router, latent projections, norm, shared experts) are
    plain torch in the input's dtype with the checkpoint's weights (bf16 as released; a
    float32 input upcasts them each call); the routed experts are
    :class:`KimiK3Experts`.  ``experts.num_threads`` (``num_threads`` of
    :meth:`from_checkpoint`) is the thread count of every compiled product of the block:
    the routed experts, and at a few tokens the router, latent projections and shared
    experts (torch's own ops keep torch's threads)."""

    def __init__(self, router: KimiK3Router, down_proj: torch.Tensor,
                 experts: KimiK3Experts, norm_weight: Optional[torch.Tensor],
                 up_proj: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor,
                 shared_down: torch.Tensor, norm_eps: float = 1e-5):
        super().__init__()
        check_block(router.weight, experts, dict(
            down_proj=down_proj, norm_weight=norm_weight, up_proj=up_proj,
            shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down))
        self.router, self.experts = router, experts
        frozen = dict(requires_grad=False)
        self.down_proj = torch.nn.Parameter(down_proj.detach(), **frozen)
        self.up_proj = torch.nn.Parameter(up_proj.detach(), **frozen)
        self.norm_weight = None if norm_weight is None else torch.nn.Parameter(
            norm_weight.detach(), **frozen)
        self.shared_gate = torch.nn.Parameter(shared_gate.detach(), **frozen)
        self.shared_up = torch.nn.Parameter(shared_up.detach(), **frozen)
        self.shared_down = torch.nn.Parameter(shared_down.detach(), **frozen)
        self.norm_eps = float(norm_eps)

    def shared(self, x):
        acc, n = accumulation_dtype(x.dtype), self.experts.num_threads
        g, u = _linear(x, self.shared_gate, n).to(acc), _linear(x, self.shared_up, n).to(acc)
        act = situ(g, self.experts.beta) * clip(u, self.experts.linear_beta)
        return _linear(act.to(x.dtype), self.shared_down, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.group is not None:
            # the router, projections, norm and shared experts inside the ranks'
            # agreement too: a failure in any of them on one rank reaches every rank
            from ..distributed import _scope
            return _scope.run(self.experts.group, self, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.experts.num_threads  # the whole block's compiled products
        selected, weights = self.router(x, num_threads=n)
        h = _linear(x, self.down_proj, n)
        y = self.experts(h, selected, weights)
        if self.norm_weight is not None:
            y = _rms_norm(y, self.norm_weight, self.norm_eps)
        return _linear(y, self.up_proj, n) + self.shared(x)

    @classmethod
    def from_checkpoint(cls, path, layer: int, expert_range=None,
                        num_threads: Optional[int] = None, progress: bool = True,
                        group=None, config: Optional[dict] = None) -> "KimiK3MoE":
        """Layer ``layer`` of a Kimi K3 checkpoint folder (``config.json`` and one or
        sharded ``.safetensors`` files), or of a GGUF file of llama.cpp's converter
        (architecture ``kimi-k3``; one ``.gguf`` file or any file of a split set
        ``-0000i-of-0000N.gguf``; see :func:`from_gguf`).  ``expert_range`` ((e0, e1) or
        a range) maps only those experts' bytes; the bytes stay views of the files'
        mappings.  ``group``: expert-parallel over this torch.distributed group
        (``expert_range`` then this rank's range; see :class:`KimiK3Experts`).
        ``config``: for a GGUF file only, hyperparameters its metadata lacks, by their
        ``config.json`` names (a safetensors checkpoint has its config.json)."""
        num_threads_arg(num_threads)  # before any file is read
        if isinstance(path, GGUFCheckpoint) or is_gguf(os.fspath(path) if isinstance(
                path, (str, os.PathLike)) else ""):
            return from_gguf(cls, path, layer, expert_range=expert_range,
                             num_threads=num_threads, group=group, config=config)
        if config is not None:
            raise TypeError("config: only for GGUF files (a safetensors checkpoint's "
                            "hyperparameters come from its config.json)")
        root = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path.root
        # every key under the name read here, as transformers' KimiLinearConfig takes it
        config = ck.KIMI_K3.config(ck.read_config(root), ck.config_path(root))
        hyper = block_config(config, ck.config_path(root))
        ckpt = ck.open_checkpoint(path)
        layout = ck.KIMI_K3
        prefix = ck.find_prefix(ckpt, layout, layer)
        base = prefix + layout.block.format(layer=layer)
        n_experts = hyper["num_experts"]
        rng = ExpertRange(0, n_experts) if expert_range is None else \
            parse_expert_range(expert_range)
        e0, e1 = rng
        if not 0 <= e0 < e1 <= n_experts:
            raise ValueError(f"expert_range: expected 0 <= e0 < e1 <= {n_experts} (the "
                             f"checkpoint's experts), got {(e0, e1)}")
        ids = list(range(e0, e1))
        bar = Progress(len(ids), f"layer {layer} experts") if progress else None
        proj = ck.load_experts(ckpt, layout, layer, ids, prefix, bar)
        beta, linear_beta = situ_betas(config)
        routed = KimiK3Experts(proj["gate"], proj["up"], proj["down"], beta=beta,
                               linear_beta=linear_beta, expert_range=rng,
                               num_threads=num_threads, group=group)
        source = ck.config_path(root)
        norm_flag = config.get("latent_moe_use_norm")  # missing or null: no norm
        use_norm = norm_flag is not None and _flag(f"{source}: latent_moe_use_norm",
                                                   norm_flag)
        # router, then the dense parts by KimiK3MoE's argument names
        parts = {"router": "gate.weight", "router_bias": "gate.e_score_correction_bias"}
        parts.update({k: v[1] for k, v in DENSE_PARTS.items()
                      if use_norm or k != "norm_weight"})
        for k, n in parts.items():
            if base + n not in ckpt:
                why = (f" ({source} sets latent_moe_use_norm)" if k == "norm_weight" else "")
                raise ValueError(f"{ckpt.root}: no tensor {base + n!r} "
                                 f"({DENSE_PARTS.get(k, ('the router',))[0]} of layer "
                                 f"{layer}){why}")
        got = ckpt.get_many([base + n for n in parts.values()])
        dense = {k: got[base + n] for k, n in parts.items()}
        names = {k: f"{ckpt.byte_range(base + n)[0]}: tensor {base + n!r}"
                 for k, n in parts.items()}
        rows = check_tensor(names["router"], dense["router"], (None, None),
                            "the router: n_experts by hidden").shape[0]
        if rows != n_experts:
            raise ValueError(f"{names['router']}: the router scores {rows} experts, "
                             f"config.json's num_experts is {n_experts}")
        norm = dense.get("norm_weight")
        sizes = check_block(dense["router"], routed, {**dense, "norm_weight": norm}, names)

        def stated(key):
            return _integer(f"{source}: {key}", config[key]) if key in config else None
        shared = stated("num_shared_experts")
        check_dims(source, {
            "hidden_size": (stated("hidden_size"), sizes["hidden"],
                            f"tensor {base + parts['router']!r} has columns"),
            "routed_expert_hidden_size": (stated("routed_expert_hidden_size"),
                                          sizes["latent"], "the routed experts' latents are"),
            "moe_intermediate_size": (stated("moe_intermediate_size"), routed.d_ff,
                                      "the routed experts' width is"),
            "moe_intermediate_size x num_shared_experts": (
                None if shared is None else routed.d_ff * shared, sizes["d_shared"],
                f"tensor {base + parts['shared_gate']!r} has rows")})
        router = KimiK3Router(
            dense["router"], dense["router_bias"],
            top_k=hyper["num_experts_per_token"], renormalize=hyper["moe_renormalize"],
            scaling=hyper["routed_scaling_factor"], n_group=hyper["num_expert_group"],
            topk_group=hyper["topk_group"])
        return cls(router, dense["down_proj"], routed, norm, dense["up_proj"],
                   dense["shared_gate"], dense["shared_up"], dense["shared_down"],
                   norm_eps=hyper["rms_norm_eps"])


# ---- GGUF files (llama.cpp's converter, architecture "kimi-k3") -------------------------

# The hyperparameters ``KimiK3Model.set_gguf_parameters`` (llama.cpp
# ``conversion/kimi_k3.py``) writes, under the names of ``gguf-py``'s ``Keys``, by the
# config.json name each comes from.  The group counts are optional (llama.cpp reads a
# missing one as no grouped routing; K3 has one group); the others are required, from
# the file or from ``config=``.
GGUF_KEYS: Dict[str, str] = {
    "num_experts": "{arch}.expert_count",
    "num_experts_per_token": "{arch}.expert_used_count",
    "routed_scaling_factor": "{arch}.expert_weights_scale",
    "moe_renormalize": "{arch}.expert_weights_norm",
    "num_expert_group": "{arch}.expert_group_count",
    "topk_group": "{arch}.expert_group_used_count",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "activation_situ_beta": "{arch}.activation.situ_beta",
    "activation_situ_linear_beta": "{arch}.activation.situ_linear_beta",
}
_GGUF_OPTIONAL = {"num_expert_group": 1, "topk_group": 1}
_GGUF_COUNTS = ("num_experts", "num_experts_per_token", "num_expert_group", "topk_group")
GGUF_GATING_FUNC_KEY = "{arch}.expert_gating_func"
GGUF_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _same(a, b) -> bool:
    """Whether a file's value and a config's agree (floats as the file's float32)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and np.float32(a) == np.float32(b)
    return a == b


def gguf_config(ckpt: GGUFCheckpoint, config: Optional[dict] = None) -> Dict[str, Any]:
    """The block's hyperparameters from a K3 GGUF file's metadata, by config.json names
    (:data:`GGUF_KEYS`); ``config`` fills what the file lacks (a value in both that
    differs is an error).  A required one in neither is a ``ValueError``: it is not
    guessed."""
    arch = ckpt.architecture
    config = ck.KIMI_K3.config(config or {}, "config")  # its aliases, as config.json's
    out: Dict[str, Any] = {}
    for name, key in GGUF_KEYS.items():
        key = key.format(arch=arch)
        if key in ckpt.metadata:
            # counts: stored as integers (a float, a bool or a string is refused, as
            # llama.cpp reads them as integers); the rest checked by block_config
            value = gguf_integer(ckpt, key) if name in _GGUF_COUNTS else ckpt.metadata[key]
            if name in config and not _same(value, config[name]):
                raise ValueError(f"{ckpt.root}: {key} is {value!r}, but config gives "
                                 f"{name} = {config[name]!r}")
            out[name] = value
        elif name in config:
            out[name] = config[name]
        elif name in _GGUF_OPTIONAL:
            out[name] = _GGUF_OPTIONAL[name]
        else:
            raise ValueError(f"{ckpt.root}: metadata key {key!r} is missing; pass "
                             f"config={{{name!r}: ...}} (config.json's value) to "
                             f"from_checkpoint")
    gating = gguf_integer_if_any(ckpt, GGUF_GATING_FUNC_KEY.format(arch=arch), low=0)
    if gating is not None and gating != GGUF_GATING_SIGMOID:
        raise ValueError(f"{ckpt.root}: {GGUF_GATING_FUNC_KEY.format(arch=arch)} is "
                         f"{gating!r}; Kimi K3's router is sigmoid ({GGUF_GATING_SIGMOID})")
    return out


def _gguf_dense(ckpt: GGUFCheckpoint, name: str, shape: tuple, what: str) -> torch.Tensor:
    """A dense tensor of the block: F32/F16/BF16 as a view of a mapping of just its bytes,
    other types (Q8_0, ...) dequantized once to float32; its shape checked."""
    if name not in ckpt:
        raise ValueError(f"{ckpt.root}: no tensor {name!r} ({what})")
    info = ckpt.tensor(name)
    if info.ggml_type == MXFP4:
        t = ckpt.dequantize(name)
    elif len(info.shape) >= 2 or (len(info.shape) == 1 and info.type_name in (
            "F32", "F16", "BF16", "F64")):
        t = ckpt.get_rows(name, 0, info.shape[0])
    else:
        t = ckpt.get(name)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{info.path}: tensor {name!r} ({what}) is {info.type_name} "
                         f"{list(t.shape)}, expected {list(shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{info.path}: tensor {name!r} ({what}) is {info.type_name}, "
                         f"expected a float type")
    return t


def from_gguf(cls, path, layer: int, expert_range=None, num_threads: Optional[int] = None,
              group=None, config: Optional[dict] = None) -> "KimiK3MoE":
    """:meth:`KimiK3MoE.from_checkpoint` of a GGUF file (llama.cpp's ``kimi-k3``): the
    routed experts as GGUF blocks read in place (views of a mapping of just the
    ``expert_range``'s bytes), the dense parts (router and its bias, latent projections
    and norm, shared experts) loaded once (:func:`_gguf_dense`), the hyperparameters from
    the metadata (:func:`gguf_config`)."""
    num_threads_arg(num_threads)  # before any file is read
    ckpt = ck.open_gguf(path)
    naming = ck.GGUF_KIMI_K3
    if ckpt.architecture not in naming.architectures:
        raise ValueError(f"{ckpt.root}: general.architecture is {ckpt.architecture!r}, "
                         f"expected {naming.architectures[0]!r} (llama.cpp's Kimi K3)")
    raw = gguf_config(ckpt, config)
    cfg = block_config(raw, f"{ckpt.root} (metadata or config)")
    n_experts = cfg["num_experts"]
    rng = ExpertRange(0, n_experts) if expert_range is None else \
        parse_expert_range(expert_range)
    e0, e1 = rng
    if not 0 <= e0 < e1 <= n_experts:
        raise ValueError(f"expert_range: expected 0 <= e0 < e1 <= {n_experts} (the "
                         f"file's experts), got {(e0, e1)}")
    name = naming.tensor(layer, "down")
    if name in ckpt and ckpt.tensor(name).shape[:1] != (n_experts,):
        raise ValueError(f"{ckpt.root}: tensor {name!r} holds {ckpt.tensor(name).shape[0]} "
                         f"experts, the metadata {n_experts}")
    blocks = ck.load_gguf_experts(ckpt, layer, rng, naming=naming)
    beta, linear_beta = situ_betas(raw, f"{ckpt.root} (metadata or config)")
    routed = KimiK3Experts((blocks["gate"], None), (blocks["up"], None),
                           (blocks["down"], None), beta=beta, linear_beta=linear_beta,
                           expert_range=rng, num_threads=num_threads, group=group)
    latent = routed.d_latent
    router_name = naming.router.format(layer=layer)
    if router_name not in ckpt:
        raise ValueError(f"{ckpt.root}: no tensor {router_name!r} (the router of layer "
                         f"{layer})")
    router_shape = ckpt.tensor(router_name).shape
    if len(router_shape) != 2:
        raise ValueError(f"{ckpt.root}: tensor {router_name!r} is {list(router_shape)}, "
                         f"expected (n_experts, hidden)")
    hidden = router_shape[1]
    gate_w = _gguf_dense(ckpt, router_name, (n_experts, hidden), "the router")
    bias = _gguf_dense(ckpt, str(naming.router_bias).format(layer=layer), (n_experts,),
                       "the router's score-correction bias")
    shared_name = str(naming.shared)
    sg_name = shared_name.format(layer=layer, proj="gate")
    if sg_name not in ckpt:
        raise ValueError(f"{ckpt.root}: no tensor {sg_name!r} (the shared experts' gate)")
    d_shared = ckpt.tensor(sg_name).shape[0]
    # the shapes the safetensors path and KimiK3MoE check too (dense_shapes)
    shapes = dense_shapes(hidden, latent, d_shared)
    down_name, up_name, norm_name = (n.format(layer=layer) for n in naming.other)
    gguf_names = {"down_proj": down_name, "up_proj": up_name, "norm_weight": norm_name,
                  **{f"shared_{p}": shared_name.format(layer=layer, proj=p)
                     for p in ("gate", "up", "down")}}
    dense = {k: _gguf_dense(ckpt, gguf_names[k], shapes[k], DENSE_PARTS[k][0])
             for k in DENSE_PARTS if k != "norm_weight" or norm_name in ckpt}
    down, up, norm = dense["down_proj"], dense["up_proj"], dense.get("norm_weight")
    sg, su, sd = dense["shared_gate"], dense["shared_up"], dense["shared_down"]
    # the sizes the metadata states, where it does
    sizes = ((f"{ckpt.architecture}.embedding_length", hidden,
              f"tensor {router_name!r} has columns"),
             (f"{ckpt.architecture}.expert_latent_length", latent,
              "the routed experts' latents are"),
             (f"{ckpt.architecture}.expert_feed_forward_length", routed.d_ff,
              "the routed experts' width is"))
    check_dims(str(ckpt.root), {key: (gguf_integer_if_any(ckpt, key), found, what)
                                for key, found, what in sizes})
    router = KimiK3Router(gate_w, bias, top_k=cfg["num_experts_per_token"],
                          renormalize=cfg["moe_renormalize"],
                          scaling=cfg["routed_scaling_factor"],
                          n_group=cfg["num_expert_group"], topk_group=cfg["topk_group"])
    return cls(router, down, routed, norm, up, sg, su, sd, norm_eps=cfg["rms_norm_eps"])


# ---- the released model's sizes (config.json's text_config) ----------------------------

K3_SIZES = dict(hidden_size=7168, routed_expert_hidden_size=3584, num_experts=896,
                num_experts_per_token=16, moe_intermediate_size=3072, num_shared_experts=2,
                num_hidden_layers=93, first_k_dense_replace=1)


def expert_tensors(experts: KimiK3Experts, prefix: str, layer: int) -> dict:
    """Checkpoint name -> the tensor a :class:`KimiK3Experts` hands to the kernels (for
    ``verify``)."""
    layout, n = ck.KIMI_K3, experts.n_local
    if experts.gate_up_scales is None or experts.down_scales is None:
        raise ValueError("expert_tensors: the module holds GGUF blocks, not a safetensors "
                         "checkpoint's tensors (verify a GGUF file with verify_gguf_experts)")
    out = {}
    for i, e in enumerate(experts.expert_ids):
        for role, packed, scales in (
                ("gate", experts.gate_up_packed[i], experts.gate_up_scales[i]),
                ("up", experts.gate_up_packed[n + i], experts.gate_up_scales[n + i]),
                ("down", experts.down_packed[i], experts.down_scales[i])):
            out[layout.tensor(prefix, layer, e, role, layout.packed)] = packed
            out[layout.tensor(prefix, layer, e, role, layout.scale)] = scales
    return out
