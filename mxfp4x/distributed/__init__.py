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
   ``shared + sum_k p W x`` with the CPU driver's own combine (``mxfp4x._core.cpu.combine``:
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
import operator
from typing import Any, Callable, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist

from .._core import cpu as _cpu
from .._core import threads as _threads
from .._core.api import _check_backend
from .._core.arguments import check_num_threads, parse_expert_range
from .._core.coerce import _dtype_name, as_tensor, float_tensor, index_tensor
from .._core.format import accumulation_dtype
from ._agreement import _LIMIT, _OPS, _PRODUCTS, _agree, _facts
from ._autograd import _d_out, _EPFunction, _validate, empty_experts
from ._routing import ExpertRouting

__all__ = ["mxfp4_experts", "mxfp4_experts_slots", "ExpertRouting", "expert_parallel",
           "fail_on_every_rank", "run_layer"]


def _check_initialized():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("mxfp4x.distributed: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group (torchrun sets it up)")


def fail_on_every_rank(error: BaseException, group=None) -> NoReturn:
    """Raise ``error`` here and an error on every other rank of ``group``, which are in the
    first check of one of this module's ops: for code that prepares an op's inputs on each
    rank (a module's forward), whose failure on one rank must not leave the others waiting.
    Never returns."""
    _check_initialized()
    _agree(error, None, group)
    raise error  # _agree raised it already; this line only tells readers and type checkers


def run_layer(fn: Callable[..., torch.Tensor], *args, layer: Any = None, group=None
              ) -> torch.Tensor:
    """``fn(*args)``, a layer's forward that makes expert-parallel calls, inside the ranks'
    agreement, as mxfp4x's own modules run theirs: an exception of any type on one rank,
    anywhere in ``fn`` (before, between or after its exchanges) or in its backward, is an
    error on every rank in the same call, and every exchange inside carries the layer's
    identity, so that ranks can never pair one layer's exchange with another's.
    ``layer``: the layer (a module, or a hashable key such as its name; layers are
    numbered in the order each process first runs them, the same on every rank of a
    model); a module's parameters that need a gradient get it.  ``fn`` returns one
    tensor.  Costs one small all_gather more per call (two with a backward)."""
    _check_initialized()
    from . import _scope
    return _scope.run(group, layer, fn, *args)


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
        packed, scales = empty_experts(plan.d_out, packed.shape[2], scales is None)
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
    e0, e1 = parse_expert_range(expert_range)
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
    compute = accumulation_dtype(x.dtype)
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
