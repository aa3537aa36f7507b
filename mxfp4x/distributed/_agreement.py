"""The ranks' agreement: one fixed-size row per rank (status, step, the facts that must
agree, an error's text) gathered before any data moves and before every return trip, so
that an error on one rank is an error on every rank.

Among the facts is the call's place: the module whose forward makes the call (its number
in this process, ``site``; -1 for a direct call) and which exchange of that forward it is
(``seq``), so that two ranks can never pair one layer's exchange with another's."""
import contextlib
import datetime
import threading
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from .._core.arguments import _RANGE_LIMIT
from .._core.coerce import _dtype_name, _min_max
from .._core.validation import expert_id_error

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_VERIFIED: Dict[Any, Tuple[Tuple[int, int], ...]] = {}  # group -> ranges, checked once

# The verdict row every rank contributes to each agreement (int64 words):
#   [status, step, *facts, *message]
# one layout for every agreement, so that even ranks out of step exchange rows that
# parse, and see it.
_OK, _FAILED, _INTERRUPTED, _FAILED_IN_LAYER = 0, 1, 2, 3  # the last: posted by a scope
_START, _PRODUCTS, _GRADIENTS, _CLOSE, _CLOSE_BACKWARD, _BACKWARD = 0, 1, 2, 3, 4, 5
_STEP_NAMES = {_START: "starting a call", _PRODUCTS: "sending back its products",
               _GRADIENTS: "sending back its gradient products",
               _BACKWARD: "starting a call's backward",
               _CLOSE: "finishing a module's forward",
               _CLOSE_BACKWARD: "finishing a module's backward"}
_OPS = ("mxfp4_experts", "mxfp4_experts_slots", "expert_parallel")
_FACTS = ("op", "e0", "e1", "d_in", "d_out", "dtype", "top_k", "slot_latents", "grad",
          "routes", "lo", "hi", "site", "seq")
_F = {name: i for i, name in enumerate(_FACTS)}
_MESSAGE_BYTES = 512  # an error's text, cut to this, travels in the row (no pickling)
_ROW = 2 + len(_FACTS) + _MESSAGE_BYTES // 8
_INT64 = (-2 ** 63, 2 ** 63 - 1)
_LIMIT = _RANGE_LIMIT  # sizes above this cannot be real, and fit in int64
# how long an interrupted rank's posted verdict waits for its peers (ranks in step
# arrive within one layer's work; longer would only delay the interrupted process's exit
# when they never come)
_POST_TIMEOUT = datetime.timedelta(seconds=30)


class _CallState(threading.local):
    """This thread's open expert-parallel scopes (innermost last; see _scope.py) and the
    last exception an agreement raised while one was open: every rank raised one there,
    so a scope that sees it pass must not report it again."""

    def __init__(self):
        self.scopes: List[Any] = []
        self.agreed: Optional[BaseException] = None


_STATE = _CallState()


def _note(exc: BaseException) -> BaseException:
    """Marks ``exc`` as known to every rank (raised by, or posted in, an agreement)."""
    if _STATE.scopes:
        _STATE.agreed = exc
    return exc


def _current_call(group) -> Tuple[int, int]:
    """(site, seq) of the next call in ``group``: the innermost open scope of that group
    and the number of this exchange in it, or (-1, 0) outside any."""
    key = _group_key(group)
    for scope in reversed(_STATE.scopes):
        if scope.key == key:
            scope.seq += 1
            return scope.site, scope.seq
    return -1, 0


def _code(table, v):
    return table[v] if 0 <= v < len(table) else f"code {v}"


# the facts every rank must share, in the order they are compared: (what a message calls
# it, how it shows a value)
_SHARED = (
    ("site", "the module making the call",
     lambda v: f"module #{v}" if v >= 0 else "a direct call, no module"),
    ("seq", "the exchange's place in its module's forward", lambda v: f"exchange {v}"),
    ("op", "the op", lambda v: _code(_OPS, v)),
    ("d_in", "d_in", str),
    ("d_out", "d_out", str),
    ("dtype", "the latents' dtype", lambda v: _dtype_name(_code(_DTYPES, v))),
    ("top_k", "top_k", str),
    ("slot_latents", "the latents' form", lambda v: "per slot (T, K, I)" if v else "(T, I)"),
    ("grad", "whether a gradient is needed", lambda v: "yes" if v else "no"),
)


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


def _row(step: int, error: Optional[BaseException], facts: Optional[np.ndarray],
         failed: int = _FAILED) -> torch.Tensor:
    """This rank's verdict row; never raises (facts were made int64 while checking)."""
    words = np.zeros(_ROW, dtype=np.int64)
    words[0] = _OK if error is None else failed if isinstance(error, Exception) \
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
              facts: Optional[np.ndarray] = None, failed: int = _FAILED) -> np.ndarray:
    """Every rank's verdict row (world, _ROW), from one all_gather.  An interrupted rank
    posts its row without waiting (its peers are at this step, or will be, and learn of
    it at once) and re-raises the interrupt.  ``failed``: the status an error posts."""
    row = _to_backend(_row(step, error, facts, failed), group)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    if error is not None and not isinstance(error, Exception):
        # bounded: a process that exits waits for its posted collective, and peers
        # that never come must not hold an interrupted process for the group's timeout
        opts = AllgatherOptions()
        opts.asyncOp, opts.timeout = True, _POST_TIMEOUT
        pg = cast(dist.ProcessGroup, group if group is not None else dist.group.WORLD)
        with contextlib.suppress(Exception):  # the interrupt matters more than the post
            pg.allgather([rows], [row], opts)
        raise _note(error)
    try:
        dist.all_gather(rows, row, group=group)
    except Exception:
        if error is None:
            raise
    else:
        return torch.stack(rows).cpu().numpy()
    raise _note(error)  # a rank that failed reports its own failure, not a peer lost meanwhile


def _raise_failures(rows: np.ndarray, error: Optional[BaseException], step: int,
                    failure: str, outcome: str) -> None:
    """After a verdict exchange: the same decision on every rank.  A rank that failed
    raises its own exception; the others name the first rank that failed."""
    failed = np.flatnonzero(rows[:, 0])
    if failed.size:
        if error is not None:
            raise _note(error)
        r = int(failed[0])
        if rows[r, 0] == _INTERRUPTED:
            raise _note(RuntimeError(f"mxfp4x.distributed: rank {r} was interrupted "
                                     f"({_message(rows[r])}), so {outcome}"))
        if rows[r, 0] == _FAILED_IN_LAYER:
            failure = "failed in its layer's own work, outside the exchanges"
            outcome = "no rank finished that layer"
        raise _note(RuntimeError(f"mxfp4x.distributed: rank {r} {failure}, so {outcome}: "
                                 f"{_message(rows[r])}"))
    steps = rows[:, 1]
    if (steps != step).any():
        where = "; ".join(f"rank {r} is {_STEP_NAMES.get(int(s), f'at step {int(s)}')}"
                          for r, s in enumerate(steps))
        raise _note(RuntimeError(
            f"mxfp4x.distributed: the ranks are out of step ({where}); every rank must make "
            f"the same calls, and their backward passes, in the same order"))


def _check_shared(f: np.ndarray, names) -> None:
    """A ValueError (on every rank: it reads only the gathered rows) naming the first of
    ``names`` (from _SHARED) on which the ranks' facts differ."""
    for name, label, show in _SHARED:
        if name not in names:
            continue
        values = [(r, int(v)) for r, v in enumerate(f[:, _F[name]])
                  if not (name == "d_out" and v < 0)]  # -1: unknown on that rank
        if len({v for _, v in values}) > 1:
            raise _note(ValueError(
                f"mxfp4x.distributed: the ranks disagree on {label} "
                f"({_by_value(values, show)}); every rank must call the same op on the "
                f"same layer"))


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
    if facts is not None:
        facts[_F["site"]], facts[_F["seq"]] = _current_call(group)
    rows = _verdicts(_START, error, group, facts)
    try:
        return _plan(rows, error, group, own_ids, rank, world)
    except BaseException as exc:  # decided from the gathered rows: the same on every rank
        _note(exc)
        raise


def _plan(rows: np.ndarray, error: Optional[BaseException], group,
          own_ids: Optional[Tuple[int, int]], rank: int, world: int) -> _Plan:
    """_agree's decision, from every rank's row."""
    _raise_failures(rows, error, _START, "rejected its inputs", "no rank ran the call")
    f = rows[:, 2:2 + len(_FACTS)]
    _check_shared(f, [name for name, _, _ in _SHARED])
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
                    int(grad), int(ids is not None), lo, hi, -1, 0], dtype=np.int64)
    return row, ids


def _to_backend(t, group):
    """NCCL moves CUDA tensors only."""
    backend = dist.get_backend(group)
    if backend == "nccl" and not t.is_cuda:
        return t.cuda()
    return t
