"""Expert parallelism over ``torch.distributed``: one MoE layer's experts split across
processes (and hosts), each rank holding a contiguous range of them.

``mxfp4_experts(latent_tokens, packed_local, scales_local, selected_experts,
mixture_weights, shared_output, *, expert_range, group=None)`` returns, on every rank, its
own tokens' rows of ``shared + sum_k p W_e x``, **bit-identical** (CPU tensors) to
``mxfp4x.mxfp4_experts`` run on all tokens and all experts in one process:

1. every rank checks its inputs; one small ``all_gather`` tells every rank whether all
   are valid and consistent (so a bad input on one rank is an error on every rank, raised
   before any data moves: nothing hangs), and the expert ranges (checked once per group:
   they must cover [0, E) without overlap, in rank order);
2. the (token, slot) pairs travel to the ranks that own their experts with
   ``all_to_all_single`` (uneven splits): each token's latent row once per destination
   rank, and per pair its row there and its local expert id;
3. the owner computes the per-slot products ``W_e x`` with the local kernels (batch
   invariant: the same bits as in one process) in the compute dtype;
4. they come back with a second ``all_to_all_single``, and the home rank combines
   ``shared + sum_k p W x`` with the CPU driver's own combine (``mxfp4x._cpu.combine``:
   its order, ascending expert id then slot, and its arithmetic).

``mxfp4_experts_slots`` is the per-slot form (W x per slot, no combine); latents may be
per slot (T, K, I) in both, as in the single-process op, so gate/up and down projections
are expert-parallel.  Both are differentiable in the latents (and the first in the mixture
weights and the shared output), the gradient crossing the same all-to-alls.

Devices: CPU tensors over gloo; CUDA tensors over NCCL take the same code path (the
products then come from the PyTorch implementation, whose matmuls are not batch
invariant: equal within rounding, not bitwise).  Every rank of the group must call the
op the same number of times, and backward likewise (as with DistributedDataParallel).
"""
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from . import _cpu, _threads
from ._dispatch import _check_backend
from ._ops import mxfp4_experts_grad_latents_list_op, mxfp4_experts_grad_latents_op, slots_op
from ._validation import (
    check_inputs,
    check_isa,
    check_num_threads,
    expert_id_error,
    is_expert_list,
)

__all__ = ["mxfp4_experts", "mxfp4_experts_slots", "ExpertRouting", "expert_parallel"]

_DTYPE_CODE = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_VERIFIED: Dict[Any, Tuple[Tuple[int, int], ...]] = {}  # group -> ranges, checked once


def _compute(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_key(group):
    return id(group) if group is not None else "world"


class _Plan:
    """What every rank agreed on for one call."""

    def __init__(self, ranges, rank, world):
        self.ranges, self.rank, self.world = ranges, rank, world
        self.d_out = 0
        self.starts = torch.tensor([r[0] for r in ranges], dtype=torch.int64)
        self.n_experts = ranges[-1][1] if ranges else 0


def _agree(local_error: Optional[BaseException], meta: List[int], group) -> _Plan:
    """One all_gather: every rank's verdict on its own inputs and the facts that must
    agree.  Raises on every rank if any rank failed or the ranks disagree."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor([0 if local_error is None else 1] + meta, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, _to_backend(mine, group), group=group)
    rows = [g.cpu().tolist() for g in gathered]
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        messages: List[Any] = [None] * world
        dist.all_gather_object(messages, None if local_error is None else
                               f"{type(local_error).__name__}: {local_error}", group=group)
        if local_error is not None:
            raise local_error
        raise RuntimeError(f"mxfp4x.distributed: rank {failed[0]} rejected its inputs, so "
                           f"no rank ran the call: {messages[failed[0]]}")
    # meta: [e0, e1, d_in, d_out, dtype code, top_k, latents per slot, outputs per slot,
    #        grad]
    facts = {i: {row[i + 1] for row in rows} - ({-1} if i == 3 else set())
             for i in range(2, len(meta))}
    names = {2: "d_in", 3: "d_out", 4: "latent dtype", 5: "top_k", 6: "latent form",
             7: "output form", 8: "requires_grad"}
    for i, values in facts.items():
        if len(values) > 1:
            raise ValueError(f"mxfp4x.distributed: the ranks disagree on {names[i]} "
                             f"({sorted(values)}); every rank must call the same op on the "
                             f"same layer")
    ranges = tuple((row[1], row[2]) for row in rows)
    key = _group_key(group)
    if _VERIFIED.get(key) != ranges:
        expect = 0
        for r, (e0, e1) in enumerate(ranges):
            if e0 != expect or e1 < e0:
                raise ValueError(f"expert_range: the ranks' ranges {list(ranges)} must cover "
                                 f"[0, E) in rank order without gaps or overlap (rank {r} "
                                 f"starts at {e0}, expected {expect})")
            expect = e1
        _VERIFIED[key] = ranges
    plan = _Plan(ranges, rank, world)
    plan.d_out = max(facts[3]) if facts.get(3) else 0
    return plan


def _agree_ids(sel, plan, meta, group):
    """The global expert count is known once the ranges are agreed: ids are checked
    before any data moves, and a bad one is an error on every rank (a second small
    all_gather)."""
    bad = None
    if sel.numel():
        lo, hi = int(sel.min()), int(sel.max())
        if lo < 0 or hi >= plan.n_experts:
            bad = expert_id_error(lo if lo < 0 else hi, plan.n_experts)
    _agree(bad, meta, group)


def _to_backend(t, group):
    """NCCL moves CUDA tensors only."""
    backend = dist.get_backend(group)
    if backend == "nccl" and not t.is_cuda:
        return t.cuda()
    return t


class ExpertRouting:
    """The pairs of one call, routed to the ranks owning their experts: built once, used
    for the products' way out and back (and by the backward pass)."""

    def __init__(self, plan: _Plan, sel: torch.Tensor, rows_per_slot: bool, group):
        self.plan, self.group = plan, group
        self.bytes_sent = 0          # payload this rank sent, all exchanges of the call
        self.comm_seconds = 0.0      # wall time inside the all-to-alls (waits included)
        n_tokens, top_k = sel.shape
        self.n_tokens, self.top_k = n_tokens, top_k
        flat = sel.reshape(-1).to(torch.int64).cpu()
        owner = torch.searchsorted(plan.starts, flat, right=True) - 1
        self.order = torch.argsort(owner, stable=True)        # pairs grouped by owner
        pair_rows = torch.arange(flat.numel()) if rows_per_slot else \
            torch.arange(flat.numel()) // max(top_k, 1)
        sent_owner = owner[self.order]
        self.send_pairs = torch.bincount(sent_owner, minlength=plan.world)
        # each source row once per destination: (owner, row) unique, in order
        key = sent_owner * max(1, flat.numel()) + pair_rows[self.order]
        uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)
        self.send_rows_index = uniq % max(1, flat.numel())     # rows of x to send, grouped
        self.send_rows = torch.bincount(uniq // max(1, flat.numel()), minlength=plan.world)
        row_start = torch.cumsum(self.send_rows, 0) - self.send_rows
        local_row = inverse - row_start[sent_owner]            # index in that owner's batch
        local_expert = flat[self.order] - plan.starts[sent_owner]
        meta = torch.stack((local_row, local_expert), dim=1).contiguous()
        counts = torch.stack((self.send_rows, self.send_pairs), dim=1).contiguous()
        got = self._exchange(counts, [1] * plan.world, [1] * plan.world)
        self.recv_rows, self.recv_pairs = got[:, 0].clone(), got[:, 1].clone()
        recv_meta = self._exchange(meta, self.send_pairs.tolist(), self.recv_pairs.tolist())
        src_base = torch.cumsum(self.recv_rows, 0) - self.recv_rows
        src_of_pair = torch.repeat_interleave(torch.arange(plan.world), self.recv_pairs)
        self.recv_row_of_pair = recv_meta[:, 0] + src_base[src_of_pair]
        self.recv_expert = recv_meta[:, 1]

    def _exchange(self, t: torch.Tensor, send: Sequence[int], recv: Sequence[int]
                  ) -> torch.Tensor:
        """all_to_all_single of rows (split sizes in rows), any dtype (moved as bytes)."""
        t = t.contiguous()
        shape = t.shape[1:]
        width = int(np.prod(shape, dtype=np.int64)) * t.element_size()
        as_bytes = t.view(torch.uint8).reshape(t.shape[0], width) if t.numel() else \
            torch.empty((t.shape[0], width), dtype=torch.uint8)
        out = torch.empty((int(sum(recv)), width), dtype=torch.uint8)
        src = _to_backend(as_bytes, self.group)
        dst = _to_backend(out, self.group)
        t0 = time.perf_counter()
        dist.all_to_all_single(dst, src, output_split_sizes=list(map(int, recv)),
                               input_split_sizes=list(map(int, send)), group=self.group)
        self.comm_seconds += time.perf_counter() - t0
        mine = self.plan.rank
        self.bytes_sent += (int(sum(send)) - int(send[mine])) * width  # not to itself
        return dst.cpu().view(t.dtype).reshape((int(sum(recv)),) + tuple(shape))

    def send_rows_of(self, x_rows: torch.Tensor) -> torch.Tensor:
        """The rows each owner needs (once per owner), arriving as the owner's batch."""
        return self._exchange(x_rows[self.send_rows_index], self.send_rows.tolist(),
                              self.recv_rows.tolist())

    def pairs_out(self, per_pair: torch.Tensor) -> torch.Tensor:
        """Per-pair rows (home order p) to their owners (received grouped by source)."""
        return self._exchange(per_pair[self.order], self.send_pairs.tolist(),
                              self.recv_pairs.tolist())

    def pairs_back(self, results: torch.Tensor) -> torch.Tensor:
        """Per-pair results computed by the owners, back home in pair order p."""
        back = self._exchange(results, self.recv_pairs.tolist(), self.send_pairs.tolist())
        out = torch.empty_like(back)
        out[self.order] = back
        return out


def _validate(latent_tokens, packed_local, scales_local, selected_experts, mixture_weights,
              shared_output, expert_range, per_slot_outputs):
    """Local checks (no communication); returns the checked tensors and the meta row."""
    from ._validation import SKIP
    e0, e1 = (int(v) for v in expert_range)
    if e0 < 0 or e1 < e0:
        raise ValueError(f"expert_range: expected (e0, e1) with 0 <= e0 <= e1, got "
                         f"{tuple(expert_range)}")
    if isinstance(packed_local, (list, tuple)) and len(packed_local) == 0:
        # a rank holding no experts: an empty stacked placeholder (d_out from the shared
        # output when there is one, else agreed with the other ranks)
        d_in = torch.as_tensor(latent_tokens).shape[-1]
        d_out = shared_output.shape[-1] if shared_output is not None and not \
            per_slot_outputs else 0
        packed_local = torch.empty((0, d_out, d_in // 32, 16), dtype=torch.uint8)
        scales_local = torch.empty((0, d_out, d_in // 32), dtype=torch.uint8)
    n_local = len(packed_local) if is_expert_list(packed_local) else None
    x, packed, scales, sel, mix, shared = check_inputs(
        latent_tokens, packed_local, scales_local, selected_experts,
        SKIP if per_slot_outputs else mixture_weights,
        SKIP if per_slot_outputs else shared_output)
    n_local = len(packed) if n_local is None else n_local
    if n_local != e1 - e0:
        raise ValueError(f"packed_local: holds {n_local} experts, but expert_range "
                         f"{(e0, e1)} names {e1 - e0}")
    return x, packed, scales, sel, mix, shared, (e0, e1)


def _local_products(routing: ExpertRouting, recv_x: torch.Tensor, packed, scales, threads,
                    isa, dtype):
    """W_e x per received pair, in the compute dtype, with the local kernels."""
    compute = _compute(dtype)
    x_pairs = recv_x[routing.recv_row_of_pair]
    if x_pairs.dtype != compute:
        x_pairs = x_pairs.to(compute)  # exact: the kernels upcast 16-bit latents anyway
    sel = routing.recv_expert.view(-1, 1).to(x_pairs.device)
    if sel.shape[0] == 0:
        return torch.empty((0, routing.plan.d_out), dtype=compute, device=x_pairs.device)
    return slots_op(packed)(x_pairs, packed, scales, sel, threads, isa or "").reshape(
        sel.shape[0], -1)


def _d_out(packed):
    return packed.shape[1] if isinstance(packed, torch.Tensor) else packed[0].shape[0]


class _EPFunction(torch.autograd.Function):
    """Forward and backward of the expert-parallel products (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, mix, shared, packed, scales, sel, plan, group, threads, isa,
                per_slot_outputs):
        slot_x = x.dim() == 3
        routing = ExpertRouting(plan, sel, slot_x, group)
        rows = x.reshape(-1, x.shape[-1]).detach()
        recv_x = routing.send_rows_of(rows.cpu() if not rows.is_cuda else rows)
        local = _local_products(routing, recv_x, packed, scales, threads, isa, x.dtype)
        dots = routing.pairs_back(local.cpu() if not local.is_cuda else local)
        dots = dots.to(x.device)
        n_tokens, top_k = sel.shape
        d_out = plan.d_out
        ctx.d_out = d_out
        ctx.routing, ctx.packed, ctx.scales = routing, packed, scales
        ctx.threads, ctx.isa, ctx.per_slot_outputs = threads, isa, per_slot_outputs
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        if per_slot_outputs:
            ctx.save_for_backward()
            return dots.view(n_tokens, top_k, d_out).to(x.dtype)
        compute = _compute(x.dtype)
        out = shared.detach().to(compute, copy=True).contiguous()
        w = mix.detach().to(compute).contiguous()
        if out.device.type == "cpu":
            _cpu.combine(out.numpy(), dots.numpy(), sel.to(torch.int64).contiguous().numpy(),
                         w.numpy(), n_threads=_threads.resolve(threads))
        else:  # the PyTorch implementation's order: slot by slot
            contrib = (dots.view(n_tokens, top_k, d_out) * w.unsqueeze(-1))
            for k in range(top_k):
                out += contrib[:, k]
        ctx.save_for_backward(dots, mix)
        ctx.shared_dtype = shared.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        routing = ctx.routing
        compute = _compute(ctx.x_dtype)
        n_tokens, top_k = routing.n_tokens, routing.top_k
        g = grad.to(compute)
        d_x = d_mix = d_shared = None
        if ctx.per_slot_outputs:
            per_pair = g.reshape(n_tokens * top_k, ctx.d_out)
        else:
            dots, mix = ctx.saved_tensors
            if ctx.needs_input_grad[1]:
                acc = torch.float64 if mix.dtype == torch.float64 else compute
                d_mix = (dots.view(n_tokens, top_k, ctx.d_out).to(acc) * g.to(acc).unsqueeze(1)
                         ).sum(-1).to(mix.dtype)
            if ctx.needs_input_grad[2]:
                d_shared = grad.to(ctx.shared_dtype)
            per_pair = (g.unsqueeze(1) * mix.detach().to(compute).unsqueeze(-1)).reshape(
                n_tokens * top_k, ctx.d_out)
        # W^T (p g) per pair, on the owners, back home (always exchanged: every rank takes
        # part, whether or not it needs d_x)
        sent = routing.pairs_out(per_pair.cpu() if not per_pair.is_cuda else per_pair)
        op = mxfp4_experts_grad_latents_op if isinstance(ctx.packed, torch.Tensor) \
            else mxfp4_experts_grad_latents_list_op
        d_in = ctx.x_shape[-1]
        n = sent.shape[0]
        if n:
            local = op(sent.view(n, 1, ctx.d_out), ctx.packed, ctx.scales,
                       routing.recv_expert.view(-1, 1), None,
                       torch.empty((n, 1, d_in), dtype=compute), ctx.threads,
                       ctx.isa or "").reshape(n, d_in)
        else:
            local = torch.empty((0, d_in), dtype=compute)
        back = routing.pairs_back(local).to(grad.device)
        if ctx.needs_input_grad[0]:
            if len(ctx.x_shape) == 3:
                d_x = back.view(ctx.x_shape)
            else:
                d_x = back.view(n_tokens, top_k, d_in).sum(1)
            d_x = d_x.to(ctx.x_dtype)
        return d_x, d_mix, d_shared, None, None, None, None, None, None, None, None


def _run(latent_tokens, packed_local, scales_local, selected_experts, mixture_weights,
         shared_output, expert_range, group, num_threads, isa, per_slot_outputs):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("mxfp4x.distributed: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group (torchrun sets it up)")
    error: Optional[BaseException] = None
    meta = [0] * 8
    checked = None
    try:
        _check_backend("auto", isa)
        threads = check_num_threads(num_threads)
        checked = _validate(latent_tokens, packed_local, scales_local, selected_experts,
                            mixture_weights, shared_output, expert_range, per_slot_outputs)
        x, packed, scales, sel, mix, shared, (e0, e1) = checked
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, mix, shared))
        # d_out is unknown (-1) on a rank with no experts and no shared output
        d_out = _d_out(packed) if len(packed) or not per_slot_outputs else -1
        meta = [e0, e1, x.shape[-1], d_out, _DTYPE_CODE[x.dtype], sel.shape[1],
                int(x.dim() == 3), int(per_slot_outputs), int(grad)]
    except (ValueError, TypeError, IndexError, RuntimeError) as exc:
        error = exc
        meta = [0] * 9
    plan = _agree(error, meta, group)
    x, packed, scales, sel, mix, shared, _ = checked
    if isinstance(packed, torch.Tensor) and packed.shape[0] == 0 and \
            packed.shape[1] != plan.d_out:
        packed = torch.empty((0, plan.d_out) + tuple(packed.shape[2:]), dtype=torch.uint8)
        scales = torch.empty((0, plan.d_out, packed.shape[2]), dtype=torch.uint8)
    _agree_ids(sel, plan, meta, group)
    return _EPFunction.apply(x, mix, shared, packed, scales, sel, plan, group, threads, isa,
                             per_slot_outputs)


def mxfp4_experts(latent_tokens, packed_local, scales_local, selected_experts,
                  mixture_weights, shared_output, *, expert_range: Tuple[int, int],
                  group=None, num_threads: Optional[int] = None,
                  isa: Optional[str] = None) -> torch.Tensor:
    """``shared_output + sum_k p W_e x`` for this rank's tokens, its experts
    ``expert_range = (e0, e1)`` given as ``packed_local`` / ``scales_local`` (stacked
    (e1-e0, O, G, 16) / (e1-e0, O, G), or lists), the other experts on the other ranks
    of ``group``.  Bit-identical (CPU) to :func:`mxfp4x.mxfp4_experts` on all tokens and
    experts in one process.  Latents may be (T, I) or per slot (T, K, I)."""
    return _run(latent_tokens, packed_local, scales_local, selected_experts, mixture_weights,
                shared_output, expert_range, group, num_threads, isa, False)


def mxfp4_experts_slots(latent_tokens, packed_local, scales_local, selected_experts, *,
                        expert_range: Tuple[int, int], group=None,
                        num_threads: Optional[int] = None,
                        isa: Optional[str] = None) -> torch.Tensor:
    """Per-slot ``W_e x`` (T, K, O) for this rank's tokens, expert-parallel (see
    :func:`mxfp4_experts`); bit-identical to :func:`mxfp4x.mxfp4_experts_slots`."""
    return _run(latent_tokens, packed_local, scales_local, selected_experts, None, None,
                expert_range, group, num_threads, isa, True)


def expert_parallel(local_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    latents: torch.Tensor, selected_experts: torch.Tensor,
                    mixture_weights: torch.Tensor, *, expert_range: Tuple[int, int],
                    d_out: int, group=None, num_threads: Optional[int] = None,
                    isa: Optional[str] = None):
    """A whole expert computation made expert-parallel in one round trip (inference):
    each pair's latent row goes to the owner of its expert, which runs
    ``local_fn(rows (P, I), local expert ids (P,)) -> (P, d_out)`` in the compute dtype
    (e.g. a gated MLP: gate/up, activation, down), the results come back and are combined
    ``sum_k p W x`` in the CPU driver's order, from zeros.  Returns ``(out (T, d_out) in
    the latents' dtype, the routing)`` (its ``bytes_sent`` and ``comm_seconds``).
    ``isa``: the CPU instruction set ``local_fn`` runs (None: the default), checked with
    the other inputs before any data moves, so a bad name is an error on every rank."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("mxfp4x.distributed: torch.distributed is not initialised")
    error: Optional[BaseException] = None
    x, sel, mix = latents, selected_experts, mixture_weights
    try:
        e0, e1 = (int(v) for v in expert_range)
        check_isa(isa)
        if x.dim() != 2 or sel.dim() != 2 or sel.shape[0] != x.shape[0] or \
                tuple(mix.shape) != tuple(sel.shape) or x.dtype not in _DTYPE_CODE:
            raise ValueError(f"latents (T, I) float, selected_experts and mixture_weights "
                             f"(T, K) expected, got {tuple(x.shape)} {x.dtype}, "
                             f"{tuple(sel.shape)}, {tuple(mix.shape)}")
        meta = [e0, e1, x.shape[-1], d_out, _DTYPE_CODE[x.dtype], sel.shape[1], 0, 0, 0]
    except (ValueError, TypeError) as exc:
        error, meta = exc, [0] * 9
    plan = _agree(error, meta, group)
    _agree_ids(sel, plan, meta, group)
    routing = ExpertRouting(plan, sel, False, group)
    recv = routing.send_rows_of(x.detach().cpu())
    compute = _compute(x.dtype)
    rows = recv[routing.recv_row_of_pair].to(compute)
    local = local_fn(rows, routing.recv_expert) if rows.shape[0] else \
        torch.empty((0, d_out), dtype=compute)
    dots = routing.pairs_back(local.to(compute).contiguous())
    out = torch.zeros((x.shape[0], d_out), dtype=compute)
    _cpu.combine(out.numpy(), dots.numpy(), sel.to(torch.int64).cpu().contiguous().numpy(),
                 mix.detach().to(compute).cpu().contiguous().numpy(),
                 n_threads=_threads.resolve(num_threads))
    return out.to(x.dtype), routing
