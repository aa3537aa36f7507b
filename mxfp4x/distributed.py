"""Expert parallelism over ``torch.distributed``: one MoE layer's experts split across
processes (and hosts), each rank holding a contiguous range of them.

``mxfp4_experts(latent_tokens, packed_local, scales_local, selected_experts,
mixture_weights, shared_output, *, expert_range, group=None)`` returns, on every rank, its
own tokens' rows of ``shared + sum_k p W_e x``, **bit-identical** (CPU tensors) to
``mxfp4x.mxfp4_experts`` run on all tokens and all experts in one process:

1. every rank checks everything about its call that can fail (ISA, thread count, types,
   dtypes, shapes, ranges, expert ids) without communicating; then one small
   ``all_gather`` of a fixed-size row per rank (its verdict, the facts the ranks must
   share, its expert range, its lowest and highest expert id, an error's text) tells every
   rank whether all are valid and consistent.  An exception of any type on one rank is
   an error on every rank, raised before any data moves: nothing hangs.  The expert
   ranges must cover [0, E) without overlap, in rank order;
2. the (token, slot) pairs travel to the ranks that own their experts with
   ``all_to_all_single`` (uneven splits): each token's latent row once per destination
   rank, and per pair its row there and its local expert id;
3. the owner computes the per-slot products ``W_e x`` with the local kernels (batch
   invariant: the same bits as in one process) in the compute dtype; the same small
   ``all_gather`` then tells every rank whether every owner succeeded, so a failure there
   is an error on every rank too, instead of a rank waiting for products that never come;
4. they come back with a second ``all_to_all_single``, and the home rank combines
   ``shared + sum_k p W x`` with the CPU driver's own combine (``mxfp4x._cpu.combine``:
   its order, ascending expert id then slot, and its arithmetic).

``mxfp4_experts_slots`` is the per-slot form (W x per slot, no combine); latents may be
per slot (T, K, I) in both, as in the single-process op, so gate/up and down projections
are expert-parallel.  Both are differentiable in the latents (and the first in the mixture
weights and the shared output), the gradient crossing the same all-to-alls (and the
owners' verdict on their gradient products likewise agreed before they come back).

A rank interrupted (KeyboardInterrupt, SystemExit) while it checks its inputs or computes
its products posts its verdict without waiting for the others and re-raises: its peers
get an error, not a wait, and the interrupt is never swallowed.

Devices: CPU tensors over gloo; CUDA tensors over NCCL take the same code path (the
products then come from the PyTorch implementation, whose matmuls are not batch
invariant: equal within rounding, not bitwise).  Every rank of the group must call the
op the same number of times, and backward likewise (as with DistributedDataParallel): a
rank that never makes a call cannot be waited for by any check.
"""
import contextlib
import datetime
import operator
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from . import _cpu, _threads
from ._api import _check_backend
from ._ops import mxfp4_experts_grad_latents_list_op, mxfp4_experts_grad_latents_op, slots_op
from ._validation import (
    SKIP,
    _dtype_name,
    _min_max,
    as_tensor,
    check_inputs,
    check_num_threads,
    expert_id_error,
    float_tensor,
    index_tensor,
    is_expert_list,
)

__all__ = ["mxfp4_experts", "mxfp4_experts_slots", "ExpertRouting", "expert_parallel"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_VERIFIED: Dict[Any, Tuple[Tuple[int, int], ...]] = {}  # group -> ranges, checked once

# The verdict row every rank contributes to each agreement (int64 words):
#   [status, step, *facts, *message]
# one layout for every agreement, so that even ranks out of step exchange rows that
# parse, and see it.
_OK, _FAILED, _INTERRUPTED = 0, 1, 2
_START, _PRODUCTS, _GRADIENTS = 0, 1, 2
_STEP_NAMES = {_START: "starting a call", _PRODUCTS: "sending back its products",
               _GRADIENTS: "sending back its gradient products"}
_OPS = ("mxfp4_experts", "mxfp4_experts_slots", "expert_parallel")
_FACTS = ("op", "e0", "e1", "d_in", "d_out", "dtype", "top_k", "slot_latents", "grad",
          "routes", "lo", "hi")
_F = {name: i for i, name in enumerate(_FACTS)}
_MESSAGE_BYTES = 512  # an error's text, cut to this, travels in the row (no pickling)
_ROW = 2 + len(_FACTS) + _MESSAGE_BYTES // 8
_INT64 = (-2 ** 63, 2 ** 63 - 1)
_LIMIT = 2 ** 62  # expert ranges and sizes above this cannot be real, and fit in int64
# how long an interrupted rank's posted verdict waits for its peers (ranks in step
# arrive within one layer's work; longer would only delay the interrupted process's exit
# when they never come)
_POST_TIMEOUT = datetime.timedelta(seconds=30)


def _code(table, v):
    return table[v] if 0 <= v < len(table) else f"code {v}"


# the facts every rank must share, in the order they are compared: (what a message calls
# it, how it shows a value)
_SHARED = (
    ("op", "the op", lambda v: _code(_OPS, v)),
    ("d_in", "d_in", str),
    ("d_out", "d_out", str),
    ("dtype", "the latents' dtype", lambda v: _dtype_name(_code(_DTYPES, v))),
    ("top_k", "top_k", str),
    ("slot_latents", "the latents' form", lambda v: "per slot (T, K, I)" if v else "(T, I)"),
    ("grad", "whether a gradient is needed", lambda v: "yes" if v else "no"),
)


def _compute(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_key(group):
    return id(group) if group is not None else "world"


def _describe(exc: BaseException) -> str:
    """``Type: message``, even for an exception whose ``str`` raises: a message must never
    be what keeps an error from reaching the other ranks."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - the type is still worth reporting
        text = "<the message could not be formatted>"
    return f"{name}: {text}" if text else name


def _row(step: int, error: Optional[BaseException], facts: Optional[np.ndarray]
         ) -> torch.Tensor:
    """This rank's verdict row; never raises (facts were made int64 while checking)."""
    words = np.zeros(_ROW, dtype=np.int64)
    words[0] = _OK if error is None else _FAILED if isinstance(error, Exception) \
        else _INTERRUPTED
    words[1] = step
    if error is None and facts is not None:
        words[2:2 + len(_FACTS)] = facts
    if error is not None:
        text = _describe(error).encode("utf-8", "replace")[:_MESSAGE_BYTES]
        words[2 + len(_FACTS):].view(np.uint8)[:len(text)] = np.frombuffer(text, np.uint8)
    return torch.from_numpy(words)


def _message(row: np.ndarray) -> str:
    raw = row[2 + len(_FACTS):].tobytes().rstrip(b"\0")
    return raw.decode("utf-8", "ignore")  # a cut may split a character


def _verdicts(step: int, error: Optional[BaseException], group,
              facts: Optional[np.ndarray] = None) -> np.ndarray:
    """Every rank's verdict row (world, _ROW), from one all_gather.  An interrupted rank
    posts its row without waiting (its peers are at this step, or will be, and learn of
    it at once) and re-raises the interrupt."""
    row = _to_backend(_row(step, error, facts), group)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    if error is not None and not isinstance(error, Exception):
        # bounded: a process that exits waits for its posted collective, and peers
        # that never come must not hold an interrupted process for the group's timeout
        opts = AllgatherOptions()
        opts.asyncOp, opts.timeout = True, _POST_TIMEOUT
        pg = cast(dist.ProcessGroup, group if group is not None else dist.group.WORLD)
        with contextlib.suppress(Exception):  # the interrupt matters more than the post
            pg.allgather([rows], [row], opts)
        raise error
    try:
        dist.all_gather(rows, row, group=group)
    except Exception:
        if error is None:
            raise
    else:
        return torch.stack(rows).cpu().numpy()
    raise error  # a rank that failed reports its own failure, not a peer lost meanwhile


def _raise_failures(rows: np.ndarray, error: Optional[BaseException], step: int,
                    failure: str, outcome: str) -> None:
    """After a verdict exchange: the same decision on every rank.  A rank that failed
    raises its own exception; the others name the first rank that failed."""
    failed = np.flatnonzero(rows[:, 0])
    if failed.size:
        if error is not None:
            raise error
        r = int(failed[0])
        if rows[r, 0] == _INTERRUPTED:
            raise RuntimeError(f"mxfp4x.distributed: rank {r} was interrupted "
                               f"({_message(rows[r])}), so {outcome}")
        raise RuntimeError(f"mxfp4x.distributed: rank {r} {failure}, so {outcome}: "
                           f"{_message(rows[r])}")
    steps = rows[:, 1]
    if (steps != step).any():
        where = "; ".join(f"rank {r} is {_STEP_NAMES.get(int(s), f'at step {int(s)}')}"
                          for r, s in enumerate(steps))
        raise RuntimeError(f"mxfp4x.distributed: the ranks are out of step ({where}); every "
                           f"rank must make the same calls, and their backward passes, in "
                           f"the same order")


def _by_value(pairs, show) -> str:
    ranks: Dict[int, List[int]] = {}
    for r, v in pairs:
        ranks.setdefault(int(v), []).append(r)
    return "; ".join(f"{show(v)} on rank{'s' if len(rs) > 1 else ''} "
                     f"{', '.join(map(str, rs))}" for v, rs in ranks.items())


class _Plan:
    """What every rank agreed on for one call."""

    def __init__(self, ranges, rank, world):
        self.ranges, self.rank, self.world = ranges, rank, world
        self.d_out = 0
        self.starts = torch.tensor([r[0] for r in ranges], dtype=torch.int64)
        self.n_experts = ranges[-1][1] if ranges else 0


def _member_rank(group) -> int:
    rank = dist.get_rank(group)
    if rank < 0:  # no other rank waits for a process outside the group
        raise ValueError("group: this process is not a member of the group it passed")
    return rank


def _agree(error: Optional[BaseException], facts: Optional[np.ndarray], group,
           own_ids: Optional[Tuple[int, int]] = None) -> _Plan:
    """One all_gather: every rank's verdict on its own inputs and the facts that must
    agree.  Raises on every rank if any rank failed or the ranks disagree (each check
    below reads only the gathered rows, so every rank reaches the same decision)."""
    rank = _member_rank(group)
    world = dist.get_world_size(group)
    rows = _verdicts(_START, error, group, facts)
    _raise_failures(rows, error, _START, "rejected its inputs", "no rank ran the call")
    f = rows[:, 2:2 + len(_FACTS)]
    for name, label, show in _SHARED:
        values = [(r, int(v)) for r, v in enumerate(f[:, _F[name]])
                  if not (name == "d_out" and v < 0)]  # -1: unknown on that rank
        if len({v for _, v in values}) > 1:
            raise ValueError(f"mxfp4x.distributed: the ranks disagree on {label} "
                             f"({_by_value(values, show)}); every rank must call the same "
                             f"op on the same layer")
    ranges = tuple((int(row[_F["e0"]]), int(row[_F["e1"]])) for row in f)
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
    known = [int(v) for v in f[:, _F["d_out"]] if v >= 0]
    plan.d_out = known[0] if known else 0
    # expert ids: only now is the global count known
    n = plan.n_experts

    def bad_id(lo, hi):
        return lo if lo < 0 else hi if hi >= n else None

    if own_ids is not None and bad_id(*own_ids) is not None:
        raise expert_id_error(bad_id(*own_ids), n)
    for r, row in enumerate(f):
        bad = bad_id(int(row[_F["lo"]]), int(row[_F["hi"]])) if row[_F["routes"]] else None
        if bad is not None:
            raise RuntimeError(f"mxfp4x.distributed: rank {r} rejected its inputs, so no rank "
                               f"ran the call: {_describe(expert_id_error(bad, n))}")
    return plan


def _facts(op, e0, e1, d_in, d_out, dtype, top_k, slot_latents, grad, sel
           ) -> Tuple[np.ndarray, Optional[Tuple[int, int]]]:
    """The facts row (int64; raises here, while checking, if a value does not fit) and
    this rank's (lowest, highest) expert id, exact, or None when it routes no pair."""
    ids = _min_max(sel) if sel.numel() else None
    lo, hi = (min(max(v, _INT64[0]), _INT64[1]) for v in ids) if ids else (0, 0)
    row = np.array([op, e0, e1, d_in, d_out, _DTYPES.index(dtype), top_k, int(slot_latents),
                    int(grad), int(ids is not None), lo, hi], dtype=np.int64)
    return row, ids


def _to_backend(t, group):
    """NCCL moves CUDA tensors only."""
    backend = dist.get_backend(group)
    if backend == "nccl" and not t.is_cuda:
        return t.cuda()
    return t


class ExpertRouting:
    """The pairs of one call, routed to the ranks owning their experts: built once, used
    for the products' way out and back (and by the backward pass).

    Building it and its exchanges are collectives: every rank of the group takes part,
    with payloads of the agreed sizes.  A rank that cannot route its pairs (an id outside
    the plan, say) still takes part in the first exchange, flagging its failure in it, so
    every rank raises there and no data moves."""

    def __init__(self, plan: _Plan, sel: torch.Tensor, rows_per_slot: bool, group):
        self.plan, self.group = plan, group
        self.bytes_sent = 0          # payload this rank sent, all exchanges of the call
        self.comm_seconds = 0.0      # wall time communicating (waits included)
        error: Optional[Exception] = None
        try:
            counts, meta = self._route(sel, rows_per_slot)
        except Exception as exc:  # reported to every rank by the counts exchange below
            error = exc
            counts = torch.zeros((plan.world, 3), dtype=torch.int64)
            counts[:, 2] = _FAILED
            meta = torch.empty((0, 2), dtype=torch.int64)
        # per destination: rows, pairs and this rank's status (free: it rides along)
        got = self._exchange(counts, [1] * plan.world, [1] * plan.world)
        failed = torch.nonzero(got[:, 2]).flatten().tolist()
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"mxfp4x.distributed: rank {failed[0]} could not route its "
                               f"pairs, so no data moved")
        self.recv_rows, self.recv_pairs = got[:, 0].clone(), got[:, 1].clone()
        recv_meta = self._exchange(meta, self.send_pairs.tolist(), self.recv_pairs.tolist())
        src_base = torch.cumsum(self.recv_rows, 0) - self.recv_rows
        src_of_pair = torch.repeat_interleave(torch.arange(plan.world), self.recv_pairs)
        self.recv_row_of_pair = recv_meta[:, 0] + src_base[src_of_pair]
        self.recv_expert = recv_meta[:, 1]

    def _route(self, sel, rows_per_slot):
        """Local: the owner of every pair, what goes where; (counts, meta) to send."""
        plan = self.plan
        if not isinstance(sel, torch.Tensor) or sel.dim() != 2:
            raise ValueError("selected_experts: expected a 2-D tensor (n_tokens, top_k)")
        index_tensor("selected_experts", sel)
        n_tokens, top_k = sel.shape
        self.n_tokens, self.top_k = n_tokens, top_k
        flat = sel.reshape(-1).to(torch.int64).cpu()
        if flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= plan.n_experts:
                raise expert_id_error(lo if lo < 0 else hi, plan.n_experts)
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
        counts = torch.stack((self.send_rows, self.send_pairs,
                              torch.zeros_like(self.send_rows)), dim=1).contiguous()
        return counts, meta

    def agree(self, step: int, error: Optional[BaseException], failure: str) -> None:
        """Every rank's verdict on its local work since the last exchange, before the next
        one: a rank that failed raises its own error, the others a RuntimeError naming it;
        nobody waits for a payload that will not come."""
        t0 = time.perf_counter()
        try:
            rows = _verdicts(step, error, self.group)
        finally:
            self.comm_seconds += time.perf_counter() - t0
        _raise_failures(rows, error, step, failure, "no rank finished the call")

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


def _expert_range(expert_range) -> Tuple[int, int]:
    """(e0, e1), Python ints with 0 <= e0 <= e1 <= 2^62, from a pair or a range of step 1
    (as the modules take it)."""
    if isinstance(expert_range, range):
        if expert_range.step != 1:
            raise ValueError(f"expert_range: expected a range of step 1, got {expert_range}")
        expert_range = (expert_range.start, expert_range.stop)
    if isinstance(expert_range, (str, bytes)) or not hasattr(expert_range, "__iter__"):
        raise TypeError(f"expert_range: expected a pair of ints (e0, e1), got "
                        f"{type(expert_range).__name__}")
    values = list(expert_range)
    if len(values) != 2:
        raise ValueError(f"expert_range: expected a pair of ints (e0, e1), got {len(values)} "
                         f"values")
    try:
        e0, e1 = (operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"expert_range: expected a pair of ints (e0, e1), got "
                        f"{tuple(type(v).__name__ for v in values)}") from None
    if not 0 <= e0 <= e1 <= _LIMIT:
        raise ValueError(f"expert_range: expected (e0, e1) with 0 <= e0 <= e1, got "
                         f"{(e0, e1)}")
    return e0, e1


def _validate(latent_tokens, packed_local, scales_local, selected_experts, mixture_weights,
              shared_output, expert_range, per_slot_outputs):
    """Local checks (no communication); returns the checked tensors and (e0, e1)."""
    e0, e1 = _expert_range(expert_range)
    if isinstance(packed_local, (list, tuple)) and len(packed_local) == 0:
        # a rank holding no experts: an empty stacked placeholder (d_out from the shared
        # output when there is one, else agreed with the other ranks)
        d_in = as_tensor("latent_tokens", latent_tokens).shape[-1]
        d_out = as_tensor("shared_output", shared_output).shape[-1] \
            if shared_output is not None and not per_slot_outputs else 0
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
        local, error = None, None
        try:
            local = _local_products(routing, recv_x, packed, scales, threads, isa, x.dtype)
        except BaseException as exc:  # re-raised by agree(), on this rank and as an error
            error = exc               # on every other
        routing.agree(_PRODUCTS, error, "failed computing its experts' products")
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
        d_in = ctx.x_shape[-1]
        d_x = d_mix = d_shared = None
        error = None
        # every rank takes part in every exchange, whether or not it needs d_x, and
        # whether or not its own part failed: a failure travels as its verdict, below
        try:
            g = grad.to(compute)
            if ctx.per_slot_outputs:
                per_pair = g.reshape(n_tokens * top_k, ctx.d_out)
            else:
                dots, mix = ctx.saved_tensors
                if ctx.needs_input_grad[1]:
                    acc = torch.float64 if mix.dtype == torch.float64 else compute
                    d_mix = (dots.view(n_tokens, top_k, ctx.d_out).to(acc) *
                             g.to(acc).unsqueeze(1)).sum(-1).to(mix.dtype)
                if ctx.needs_input_grad[2]:
                    d_shared = grad.to(ctx.shared_dtype)
                per_pair = (g.unsqueeze(1) * mix.detach().to(compute).unsqueeze(-1)).reshape(
                    n_tokens * top_k, ctx.d_out)
            per_pair = per_pair.cpu() if not per_pair.is_cuda else per_pair
        except BaseException as exc:  # re-raised by agree() below
            error = exc
            per_pair = torch.zeros((n_tokens * top_k, ctx.d_out), dtype=compute)
        # W^T (p g) per pair, on the owners, back home
        sent = routing.pairs_out(per_pair)
        n = sent.shape[0]
        local = torch.empty((0, d_in), dtype=compute)
        if error is None and n:
            op = mxfp4_experts_grad_latents_op if isinstance(ctx.packed, torch.Tensor) \
                else mxfp4_experts_grad_latents_list_op
            try:
                local = op(sent.view(n, 1, ctx.d_out), ctx.packed, ctx.scales,
                           routing.recv_expert.view(-1, 1), None,
                           torch.empty((n, 1, d_in), dtype=compute), ctx.threads,
                           ctx.isa or "").reshape(n, d_in)
            except BaseException as exc:  # re-raised by agree() below
                error = exc
        routing.agree(_GRADIENTS, error, "failed computing its experts' gradient products")
        back = routing.pairs_back(local).to(grad.device)
        if ctx.needs_input_grad[0]:
            if len(ctx.x_shape) == 3:
                d_x = back.view(ctx.x_shape)
            else:
                d_x = back.view(n_tokens, top_k, d_in).sum(1)
            d_x = d_x.to(ctx.x_dtype)
        return d_x, d_mix, d_shared, None, None, None, None, None, None, None, None


def _check_initialized():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("mxfp4x.distributed: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group (torchrun sets it up)")


def _run(latent_tokens, packed_local, scales_local, selected_experts, mixture_weights,
         shared_output, expert_range, group, num_threads, isa, per_slot_outputs):
    _check_initialized()
    error = facts = ids = None
    try:
        _check_backend("auto", isa)
        threads = check_num_threads(num_threads)
        x, packed, scales, sel, mix, shared, (e0, e1) = _validate(
            latent_tokens, packed_local, scales_local, selected_experts, mixture_weights,
            shared_output, expert_range, per_slot_outputs)
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, mix, shared))
        # d_out is unknown (-1) on a rank with no experts and no shared output
        d_out = _d_out(packed) if len(packed) or not per_slot_outputs else -1
        facts, ids = _facts(_OPS.index("mxfp4_experts_slots" if per_slot_outputs else
                                       "mxfp4_experts"), e0, e1, x.shape[-1], d_out, x.dtype,
                            sel.shape[1], x.dim() == 3, grad, sel)
    except BaseException as exc:  # re-raised by _agree, on this rank and as an error on
        error = exc               # every other
    plan = _agree(error, facts, group, ids)
    if isinstance(packed, torch.Tensor) and packed.shape[0] == 0 and \
            packed.shape[1] != plan.d_out:
        packed = torch.empty((0, plan.d_out) + tuple(packed.shape[2:]), dtype=torch.uint8)
        scales = torch.empty((0, plan.d_out, packed.shape[2]), dtype=torch.uint8)
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


def _check_parallel(local_fn, latents, selected_experts, mixture_weights, expert_range,
                    d_out, num_threads, isa):
    """expert_parallel's local checks: everything that could fail later on this rank.
    Inputs are coerced as the single-process ops coerce them (tensors, numpy arrays or
    nested lists; integer latents promoted)."""
    _check_backend("auto", isa)
    threads = check_num_threads(num_threads)
    if not callable(local_fn):
        raise TypeError(f"local_fn: expected a callable, got {type(local_fn).__name__}")
    x = float_tensor("latents", as_tensor("latents", latents))
    sel = index_tensor("selected_experts", as_tensor("selected_experts", selected_experts))
    mix = as_tensor("mixture_weights", mixture_weights)
    if x.dim() != 2:
        raise ValueError(f"latents: expected a 2-D tensor (n_tokens, d_in), got shape "
                         f"{tuple(x.shape)}")
    if sel.dim() != 2 or sel.shape[0] != x.shape[0]:
        raise ValueError(f"selected_experts: expected shape ({x.shape[0]}, top_k), got "
                         f"{tuple(sel.shape)}")
    if mix.is_complex() or mix.dtype == torch.bool:
        raise TypeError(f"mixture_weights: expected real weights, got dtype "
                        f"{_dtype_name(mix.dtype)}")
    if tuple(mix.shape) != tuple(sel.shape):
        raise ValueError(f"mixture_weights: expected shape {tuple(sel.shape)} (as "
                         f"selected_experts), got {tuple(mix.shape)}")
    e0, e1 = _expert_range(expert_range)
    try:
        d_out = operator.index(d_out)
    except TypeError:
        raise TypeError(f"d_out: expected an int, got {type(d_out).__name__}") from None
    if not 0 <= d_out <= _LIMIT:
        raise ValueError(f"d_out: expected 0 <= d_out, got {d_out}")
    facts, ids = _facts(_OPS.index("expert_parallel"), e0, e1, x.shape[-1], d_out, x.dtype,
                        sel.shape[1], False, False, sel)
    return x, sel, mix, d_out, threads, facts, ids


def _local_result(local, n_pairs, d_out) -> torch.Tensor:
    """local_fn's answer, checked: it travels as bytes, so a wrong shape would be garbage
    (or a wait) on another rank."""
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"local_fn: expected it to return a torch.Tensor, got "
                        f"{type(local).__name__}")
    if tuple(local.shape) != (n_pairs, d_out) or local.is_complex() or \
            local.dtype == torch.bool:
        raise ValueError(f"local_fn: expected real rows of shape {(n_pairs, d_out)} (pairs, "
                         f"d_out), got {tuple(local.shape)}, dtype {_dtype_name(local.dtype)}")
    return local


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

    The inputs may be tensors, numpy arrays or nested lists, as in the single-process
    ops.  ``isa``: the CPU instruction set ``local_fn`` runs (None: the default), checked
    with the other inputs before any data moves, so a bad name is an error on every
    rank.  An exception of any type in ``local_fn`` on one rank is an error on every
    rank: the owners agree that their results are ready before sending them back."""
    _check_initialized()
    error: Optional[BaseException] = None
    facts = ids = None
    try:
        x, sel, mix, d_out, threads, facts, ids = _check_parallel(
            local_fn, latents, selected_experts, mixture_weights, expert_range, d_out,
            num_threads, isa)
    except BaseException as exc:  # re-raised by _agree, on this rank and as an error on
        error = exc               # every other
    plan = _agree(error, facts, group, ids)
    routing = ExpertRouting(plan, sel, False, group)
    recv = routing.send_rows_of(x.detach().cpu())
    compute = _compute(x.dtype)
    local = torch.empty((0, d_out), dtype=compute)
    try:
        rows = recv[routing.recv_row_of_pair].to(compute)
        if rows.shape[0]:
            local = _local_result(local_fn(rows, routing.recv_expert), rows.shape[0],
                                  d_out).to(compute).contiguous()
    except BaseException as exc:  # re-raised by agree(), on this rank and as an error on
        error = exc               # every other
    routing.agree(_PRODUCTS, error, "failed in local_fn")
    dots = routing.pairs_back(local)
    out = torch.zeros((x.shape[0], d_out), dtype=compute)
    _cpu.combine(out.numpy(), dots.numpy(), sel.to(torch.int64).cpu().contiguous().numpy(),
                 mix.detach().to(compute).cpu().contiguous().numpy(),
                 n_threads=_threads.resolve(threads))
    return out.to(x.dtype), routing
