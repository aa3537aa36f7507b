"""What every model family's modules share: the range of experts a module holds, and
bytes checked as the op checks them."""
from typing import Tuple

from .._validation import as_tensor, byte_tensor, parse_expert_range


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
    e0, e1 = parse_expert_range(expert_range)
    if e1 - e0 != n_local:
        raise ValueError(f"expert_range: {(e0, e1)} names {e1 - e0} experts, the bytes hold "
                         f"{n_local}")
    if group is None and e0 != 0 and not subset_without_group:
        raise ValueError("expert_range: a module holding some of the experts needs group= "
                         "(torch.distributed) to reach the others")
    return e0, e1


def _positive(name, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a positive number, got {value!r}") from None
    if not (v > 0 and v != float("inf")):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return v
