"""Kimi K3's routed experts in MXFP4 (:class:`KimiK3Experts`), in the latent space, and
their activation: SiTU on the gate, the tanh clip on the up branch (the shared experts'
too, in block.py)."""
from typing import List, Optional

import torch

from ..._core.activation import situ_glu
from ..._core.api import mxfp4_experts, mxfp4_experts_slots
from ..._core.arguments import NumThreads, check_isa
from ..._core.coerce import as_tensor, float_tensor, index_tensor
from ..._core.format import accumulation_dtype
from ..._core.ops import runs_direct
from ..._core.weak_group import WeakGroup
from .._common import _positive, expert_range_of
from .._expert_state import ExpertMatrix, _ExpertWeights, _matrix_shape, _split, _Stamp, _Weights


def _listed(scales):
    """A scale tuple as the ops take it: a list, or None for GGUF blocks."""
    return None if scales is None else list(scales)


def situ(g, beta):
    """SiTU in torch ops: ``beta tanh(g / beta) sigmoid(g)`` (the modules run
    ``mxfp4x._core.activation.situ_glu``, the product with :func:`clip` in one pass)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def clip(u, linear_beta):
    """The up branch's clip in torch ops: ``linear_beta tanh(u / linear_beta)``, u for
    None."""
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

    group = WeakGroup()  # held weakly: _core/weak_group.py
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
        self.expert_range = expert_range_of(expert_range, self.n_local, group)
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

    @staticmethod
    def _direct(*tensors) -> bool:
        """Whether the op would call the CPU kernels directly (the core's rule): then the
        tables built once go in (a K3 layer passes 2688 expert tensors; re-reading them on
        every call would cost milliseconds)."""
        return runs_direct(tensors, ())

    def _slots(self, x, table_index, packed, scales, sel, w: _Weights):
        if self._direct(x, sel):  # the tables built once, through the same door
            return mxfp4_experts_slots(x, w.cpu_tables()[table_index], None, sel,
                                       num_threads=self.num_threads, isa=self.isa)
        return mxfp4_experts_slots(x, list(packed), _listed(scales), sel,
                                   num_threads=self.num_threads, isa=self.isa)

    def mlp(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """w2_e (situ(w1_e x) * clip(w3_e x)) per row (P, L), for local expert ids (P,):
        the per-pair work of an expert-parallel owner, in the compute dtype."""
        w = self.weights(local_ids)
        ids = local_ids.view(-1, 1).to(torch.int64)
        gu = self._slots(rows, 0, w.gate_up_packed, w.gate_up_scales,
                         torch.cat((ids, ids + self.n_local), dim=1), w)
        act = situ_glu(gu[:, 0], gu[:, 1], self.beta, self.linear_beta,
                       num_threads=self.num_threads, isa=self.isa)
        return self._slots(act, 1, w.down_packed, w.down_scales, ids, w)[:, 0]

    def forward(self, h: torch.Tensor, selected_experts: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            # the whole forward inside the ranks' agreement: an error on one rank reaches
            # every rank (mxfp4x.distributed._scope)
            from ...distributed import _scope
            return _scope.run(self.group, self, self._forward, h, selected_experts,
                              routing_weights)
        return self._one_process(h, selected_experts, routing_weights)

    def _forward(self, h, selected_experts, routing_weights) -> torch.Tensor:
        from ...distributed import expert_parallel
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
        gu = self._slots(h, 0, w.gate_up_packed, w.gate_up_scales, both, w)
        act = situ_glu(gu[:, :top_k], gu[:, top_k:], self.beta, self.linear_beta,
                       num_threads=self.num_threads, isa=self.isa)
        zeros = torch.zeros((h.shape[0], self.d_latent), dtype=acc, device=h.device)
        down = w.cpu_tables()[1] if self._direct(act, h, sel, mix) else None
        if down is None:
            out = mxfp4_experts(act, list(w.down_packed), _listed(w.down_scales), sel,
                                mix.to(acc), zeros, num_threads=self.num_threads, isa=self.isa)
        else:  # the table built once, through the same door
            out = mxfp4_experts(act, down, None, sel, mix.to(acc), zeros,
                                num_threads=self.num_threads, isa=self.isa)
        return out.to(h.dtype)

    def extra_repr(self) -> str:
        form = ", gguf blocks" if self._experts()[0].w1.weight_scale is None else ""
        return (f"n_experts={self.n_local}, d_latent={self.d_latent}, d_ff={self.d_ff}, "
                f"beta={self.beta}, linear_beta={self.linear_beta}{form}")
