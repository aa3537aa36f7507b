"""A module's whole forward (and backward) inside the ranks' agreement.

An expert-parallel module does more than its exchanges: a router, projections, a norm,
shared experts, an activation between two exchanges.  Any of these can fail on one rank
only (an allocation, an input only that rank got wrong).  Run outside the agreement, such
a failure lets that rank leave the forward while its peers wait in the next exchange, and
the next request of the failed rank would meet them there: one layer's exchange paired
with another's.  :func:`run` closes that door:

* every agreement made inside carries the call's place, the module's number (``site``,
  numbered per group in the order this process first runs them: every rank runs the same
  model) and the exchange's number in this forward (``seq``), so mismatched exchanges are
  an error on every rank, never a result;
* an exception on one rank anywhere in the forward that its peers do not know of yet is
  posted to the agreement they wait in, so every rank raises in the same forward;
* a last agreement closes the forward, so a failure after the last exchange reaches the
  peers before any of them returns;
* with a gradient to compute, the forward runs as one autograd node whose backward runs
  the module's own graph inside the same protection (failures posted, a closing
  agreement), so a failure in the dense parts' backward cannot leave a peer waiting in an
  exchange's backward.

Scopes of one group nest: a module called inside another's forward (the experts of a
block) joins the outer scope.
"""
import weakref
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence

import numpy as np
import torch

from ._agreement import (
    _CLOSE,
    _CLOSE_BACKWARD,
    _F,
    _FACTS,
    _FAILED_IN_LAYER,
    _START,
    _STATE,
    _check_shared,
    _group_key,
    _raise_failures,
    _verdicts,
)

_SITES: "weakref.WeakKeyDictionary[Any, Dict[Any, int]]" = weakref.WeakKeyDictionary()
_KEYED_SITES: Dict[Any, Dict[Any, int]] = {}  # layers named by a hashable key (a str, an int)
_NEXT_SITE: Dict[Any, int] = {}  # group key -> the number the next new layer gets


class _Scope:
    """One open forward (or backward) of a module in a group."""

    def __init__(self, key, site: int):
        self.key, self.site, self.seq = key, site, 0


def site_of(owner: Any, group) -> int:
    """The layer's number in ``group`` (-1 without one): given the first time the layer
    runs in that group, in this process's order.  ``owner``: a module (any object that
    takes a weak reference), or a hashable key such as a layer's name."""
    if owner is None:
        return -1
    key = _group_key(group)
    try:
        sites = _SITES.setdefault(owner, {})
    except TypeError:  # no weak reference: a str, an int, a tuple
        sites = _KEYED_SITES.setdefault(owner, {})
    if key not in sites:
        sites[key] = _NEXT_SITE.get(key, 0)
        _NEXT_SITE[key] = sites[key] + 1
    return sites[key]


def _known(exc: Optional[BaseException]) -> bool:
    """Whether every rank raised for ``exc`` already (an agreement raised it, or it wraps
    one that did)."""
    agreed = _STATE.agreed
    seen = 0
    while exc is not None and seen < 64:
        if exc is agreed:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _fail(exc: BaseException, group, known: bool) -> NoReturn:
    """Raises ``exc`` here, after posting it to the agreement the other ranks wait in,
    unless they know of it already (``known``: _known(exc) while the scope was open)."""
    if not known:
        try:  # posts exc (an interrupt: without waiting)
            _verdicts(_START, exc, group, None, _FAILED_IN_LAYER)
        except BaseException:  # noqa: BLE001 - exc itself, or a lost peer: exc matters
            pass
    raise exc


def _close(scope: _Scope, group, step: int) -> None:
    """The closing agreement: every rank finished the forward (or backward) in step, in
    the same module."""
    facts = np.zeros(len(_FACTS), dtype=np.int64)
    facts[_F["site"]], facts[_F["seq"]] = scope.site, scope.seq
    rows = _verdicts(step, None, group, facts)
    _raise_failures(rows, None, step, "failed in its module", "no rank finished it")
    _check_shared(rows[:, 2:2 + len(_FACTS)], ("site", "seq"))


def _open(scope: _Scope) -> None:
    _STATE.scopes.append(scope)


def _shut(scope: _Scope) -> None:
    _STATE.scopes.remove(scope)
    if not _STATE.scopes:
        _STATE.agreed = None  # the exception (and its frames) is not kept past the scope


class _Box:
    """What the autograd node needs besides tensors."""

    def __init__(self, scope: _Scope, group, fn: Callable, args: Sequence,
                 slots: List[int], n_params: int):
        self.scope, self.group, self.fn = scope, group, fn
        self.args: Optional[List[Any]] = list(args)
        self.slots, self.n_params = slots, n_params


class _Guarded(torch.autograd.Function):
    """The forward as one node: runs ``fn`` with a graph of its own, and in backward that
    graph inside the scope's protection.  Inputs: the box, the tensor arguments, then the
    module's parameters that need a gradient."""

    @staticmethod
    def forward(ctx, box: _Box, *tensors):
        n_args = len(tensors) - box.n_params
        inner = [t.detach().requires_grad_(t.requires_grad) for t in tensors[:n_args]]
        args = list(box.args or ())
        for slot, t in zip(box.slots, inner, strict=True):
            args[slot] = t
        with torch.enable_grad():
            out = box.fn(*args)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"an expert-parallel forward must return a tensor, got "
                            f"{type(out).__name__}")
        ctx.box, ctx.out = box, out
        ctx.wrt = [t for t in inner if t.requires_grad] + list(tensors[n_args:])
        ctx.wants = [t.requires_grad for t in inner] + [True] * box.n_params
        box.args = None  # only the graph is kept, not the caller's objects
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        box = ctx.box
        scope = _Scope(box.scope.key, box.scope.site)
        _open(scope)
        try:
            if ctx.out.requires_grad and ctx.wrt:
                grads = list(torch.autograd.grad(ctx.out, ctx.wrt, grad, allow_unused=True,
                                                 retain_graph=True))
            else:
                grads = [None] * len(ctx.wrt)
        except BaseException as exc:
            known = _known(exc)
            _shut(scope)
            _fail(exc, box.group, known)
        _shut(scope)
        _close(scope, box.group, _CLOSE_BACKWARD)
        out: List[Optional[torch.Tensor]] = [None]
        it = iter(grads)
        out.extend(next(it) if want else None for want in ctx.wants)
        return tuple(out)


def run(group, owner: Any, fn: Callable, *args):
    """``fn(*args)``, a module's forward, inside the agreement of ``group`` (see the module
    docstring); ``owner`` the module or a key naming the layer (None: no layer)."""
    key = _group_key(group)
    if any(s.key == key for s in _STATE.scopes):
        return fn(*args)  # the experts of a block: one scope, the block's
    scope = _Scope(key, -1)
    _open(scope)
    try:
        scope.site = site_of(owner, group)
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        params = [p for p in owner.parameters() if p.requires_grad] \
            if isinstance(owner, torch.nn.Module) else []
        grad = torch.is_grad_enabled() and (
            any(args[i].requires_grad for i in slots) or bool(params))
        if grad:
            out = _Guarded.apply(_Box(scope, group, fn, args, slots, len(params)),
                                 *(args[i] for i in slots), *params)
        else:
            out = fn(*args)
    except BaseException as exc:
        known = _known(exc)
        _shut(scope)
        _fail(exc, group, known)
    _shut(scope)
    _close(scope, group, _CLOSE)
    return out
