"""The keyword arguments' rules, each the one reading of its argument for the ops, the
modules and their loaders: ``isa``, ``num_threads`` (and a module's ``num_threads``
attribute) and ``expert_range``.  Every error names the argument."""
import operator
from typing import NamedTuple, Optional

import numpy as np

from . import cpu as _cpu
from . import threads as _threads

# ISA names, fixed at import: checked in plain Python, so torch.compile traces the check
_COMPILED_ISAS = tuple(_cpu.compiled_isas())
_RUNNABLE_ISAS = tuple(_cpu.runnable_isas())

_RANGE_LIMIT = 2 ** 62


class ExpertRange(NamedTuple):
    """A parsed ``expert_range``: the experts e0..e1-1, Python ints, 0 <= e0 <= e1.  A
    tuple, so it compares equal to ``(e0, e1)``; :func:`parse_expert_range` returns it,
    and takes it back as it is (a load parses what the user gave once, and hands this on
    to every step)."""
    e0: int
    e1: int


def parse_expert_range(expert_range) -> ExpertRange:
    """``expert_range`` as (e0, e1), Python ints with 0 <= e0 <= e1 <= 2^62 (larger cannot
    be real, and fits int64), from a pair or a range of step 1: the one reading of the
    held experts, for the ops, the modules and their loaders.  A TypeError or ValueError
    naming ``expert_range`` otherwise."""
    if isinstance(expert_range, ExpertRange):
        return expert_range
    if isinstance(expert_range, range):
        if expert_range.step != 1:
            raise ValueError(f"expert_range: expected a range of step 1, got {expert_range}")
        expert_range = (expert_range.start, expert_range.stop)
    if isinstance(expert_range, (str, bytes)) or not hasattr(expert_range, "__iter__"):
        raise TypeError(f"expert_range: expected a pair of ints (e0, e1) or a range, got "
                        f"{type(expert_range).__name__}")
    values = list(expert_range)
    if len(values) != 2:
        raise ValueError(f"expert_range: expected a pair of ints (e0, e1), got {len(values)} "
                         f"values")
    try:
        if any(isinstance(v, bool) for v in values):
            raise TypeError
        e0, e1 = (operator.index(v) for v in values)
    except TypeError:
        raise TypeError(f"expert_range: expected a pair of ints (e0, e1), got "
                        f"{tuple(type(v).__name__ for v in values)}") from None
    if not 0 <= e0 <= e1 <= _RANGE_LIMIT:
        raise ValueError(f"expert_range: expected (e0, e1) with 0 <= e0 <= e1, got "
                         f"{(e0, e1)}")
    return ExpertRange(e0, e1)


def check_range_within(expert_range: ExpertRange, n_experts: int, what: str) -> None:
    """A ValueError naming ``expert_range`` when it passes the ``n_experts`` experts
    ``what`` holds (before a read of rows that are not there)."""
    if expert_range.e1 > n_experts:
        raise ValueError(f"expert_range: {tuple(expert_range)} passes the {n_experts} "
                         f"experts of {what}")


def check_isa(isa, name="isa"):
    """None (the default ISA) or the name of an ISA this CPU runs; ValueError otherwise."""
    if isa is None:
        return None
    if not isinstance(isa, str) or isa not in _COMPILED_ISAS:
        raise ValueError(f"{name}={isa!r} is not an ISA of mxfp4x; choose one of "
                         f"{list(_RUNNABLE_ISAS)} (compiled: {list(_COMPILED_ISAS)})")
    if isa not in _RUNNABLE_ISAS:
        raise ValueError(f"{name}={isa!r}: this CPU (or OS) cannot run {isa}; choose one of "
                         f"{list(_RUNNABLE_ISAS)}")
    return isa


def num_threads_arg(num_threads) -> Optional[int]:
    """The one rule for a ``num_threads`` the user gives, to an op, a module or a loader:
    None (torch.get_num_threads() when a call runs) or a positive int (numpy integers
    too), returned as a Python int.  A bool, a float (even 2.0) or a string is a
    TypeError, 0 or less a ValueError, each naming ``num_threads``."""
    if num_threads is None:
        return None
    if isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer)):
        raise TypeError(f"num_threads: expected None or a positive int, got "
                        f"{type(num_threads).__name__} {num_threads!r}")
    if num_threads < 1:
        raise ValueError(f"num_threads: expected None or a positive int, got {num_threads}")
    return int(num_threads)


def check_num_threads(num_threads):
    """:func:`num_threads_arg`, capped as mxfp4x._core.threads caps it (a larger request is
    accepted), or 0 for "torch.get_num_threads() when the kernel runs"."""
    n = num_threads_arg(num_threads)
    return 0 if n is None else _threads.resolve(n)


class NumThreads:
    """A module's ``num_threads`` attribute, checked by :func:`num_threads_arg` whenever it
    is set (in the constructor and afterwards), so a bad count is refused where it is
    given, not at the first forward after a model of many GB has loaded.  Reads give None
    or a Python int."""

    def __set_name__(self, owner, name):
        self.key = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return obj.__dict__.get(self.key)

    def __set__(self, obj, value):
        obj.__dict__[self.key] = num_threads_arg(value)
