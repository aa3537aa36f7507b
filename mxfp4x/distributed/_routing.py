"""The all-to-all plan of one call: its (token, slot) pairs routed to the ranks owning their
experts, used for the products' way out and back (and by the backward pass)."""
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .._core.coerce import index_tensor
from .._core.validation import expert_id_error
from .._core.weak_group import WeakGroup
from ._agreement import (
    _FAILED,
    _note,
    _Plan,
    _raise_failures,
    _to_backend,
    _verdicts,
)


class ExpertRouting:
    """The pairs of one call, routed to the ranks owning their experts: built once, used
    for the products' way out and back (and by the backward pass).

    Building it and its exchanges are collectives: every rank of the group takes part,
    with payloads of the agreed sizes.  A rank that cannot route its pairs (an id outside
    the plan, say) still takes part in the first exchange, flagging its failure in it, so
    every rank raises there and no data moves."""

    group = WeakGroup()  # held weakly: _core/weak_group.py

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
                raise _note(error)
            raise _note(RuntimeError(f"mxfp4x.distributed: rank {failed[0]} could not route "
                                     f"its pairs, so no data moved"))
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
