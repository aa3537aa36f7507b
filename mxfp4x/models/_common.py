"""What every model family's modules share: the range of experts a module holds, bytes
checked as the op checks them, and the routing hyperparameters checked."""
import math
from typing import Tuple

import numpy as np

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


def _integer(name: str, value, low: int = 1) -> int:
    """``value`` as an int of at least ``low`` (an int, or an integral float as JSON may
    hold one); a ValueError naming ``name`` otherwise."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return int(value)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or \
            not math.isfinite(float(value)):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def _flag(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and
                                               value in (0, 1)):
        return bool(value)
    raise ValueError(f"{name}: expected true or false, got {value!r}")


def check_routing(n_experts: int, top_k, n_group, topk_group, source: str):
    """(top_k, n_group, topk_group) as ints, checked against ``n_experts``: 1 <= top_k <=
    the experts the chosen groups hold, the groups dividing the experts, 1 <= topk_group
    <= n_group; a ValueError naming ``source`` and the value otherwise."""
    top_k = _integer(f"{source}: top_k (num_experts_per_token)", top_k)
    n_group = _integer(f"{source}: n_group (num_expert_group)", n_group)
    topk_group = _integer(f"{source}: topk_group", topk_group)
    if n_experts % n_group:
        raise ValueError(f"{source}: {n_group} expert groups do not divide {n_experts} "
                         f"experts (num_expert_group)")
    if topk_group > n_group:
        raise ValueError(f"{source}: topk_group {topk_group} is more than the {n_group} "
                         f"expert groups")
    most = n_experts if n_group == 1 else topk_group * (n_experts // n_group)
    if top_k > most:
        raise ValueError(f"{source}: top_k {top_k} (num_experts_per_token) is more than the "
                         f"{most} experts it can choose from ({n_experts} experts"
                         + ("" if n_group == 1 else f", the best {topk_group} of {n_group} "
                            f"groups") + ")")
    return top_k, n_group, topk_group
