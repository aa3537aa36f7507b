"""What every model family's modules share: the range of experts a module holds, and
bytes checked as the op checks them."""
from typing import Optional, Tuple

from .._validation import as_tensor, byte_tensor


def bytes_of(name, t):
    """uint8 bytes, checked as the op checks them (never a silent wrap-around)."""
    return byte_tensor(name, as_tensor(name, t))


def expert_range_of(expert_range, n_local: int, group, *, subset_without_group: bool = False
                    ) -> Tuple[int, int]:
    """(e0, e1) of the experts a module holds: all of them (0, n_local) unless
    ``expert_range`` says which.  ``expert_range`` is a pair (e0, e1) or a ``range`` of
    step 1.  A module holding some of the experts needs ``group`` (torch.distributed) to
    reach the others, unless it may refuse tokens routed elsewhere
    (``subset_without_group``)."""
    if expert_range is None:
        if group is not None:
            raise ValueError("expert_range: an expert-parallel module (group=...) needs the "
                             "range (e0, e1) of the experts it holds")
        return 0, n_local
    if isinstance(expert_range, range):
        if expert_range.step != 1:
            raise ValueError(f"expert_range: expected a range of step 1, got {expert_range}")
        expert_range = (expert_range.start, expert_range.stop)
    try:
        e0, e1 = (_index("expert_range", v) for v in expert_range)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"expert_range: expected (e0, e1), got {expert_range!r} ({exc})"
                        ) from None
    if e1 - e0 != n_local or e0 < 0:
        raise ValueError(f"expert_range: {(e0, e1)} names {e1 - e0} experts, the bytes hold "
                         f"{n_local}")
    if group is None and e0 != 0 and not subset_without_group:
        raise ValueError("expert_range: a module holding some of the experts needs group= "
                         "(torch.distributed) to reach the others")
    return e0, e1


def _index(name, value) -> int:
    import operator

    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected integers, got {type(value).__name__}") from None


def optional_float(value) -> Optional[float]:
    return None if value is None else float(value)


def _pair(expert_range):
    """(e0, e1) of a range or a pair, unchecked (expert_range_of checks)."""
    if isinstance(expert_range, range):
        return expert_range.start, expert_range.stop
    e0, e1 = expert_range
    return int(e0), int(e1)


def _positive(name, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a positive number, got {value!r}") from None
    if not (v > 0 and v != float("inf")):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return v
