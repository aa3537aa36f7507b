"""What every model family's modules share: the range of experts a module holds, bytes
checked as the op checks them (and read by view where a state dict loads them), the
shapes of a block's tensors and the routing hyperparameters checked."""
import math
import reprlib
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import numpy as np
import torch

from .._core.arguments import ExpertRange, parse_expert_range
from .._core.coerce import as_tensor, byte_tensor, bytes_by_view


def bytes_of(name, t):
    """uint8 bytes, checked as the op checks them (never a silent wrap-around)."""
    return byte_tensor(name, as_tensor(name, t))


def view_loaded_bytes(state_dict: dict, prefix: str, names: Iterable[str]) -> None:
    """The entries ``prefix + name`` of a state dict being loaded into byte buffers, typed
    int8 or float8_e8m0fnu, replaced by their uint8 views: the bytes themselves, never a
    cast by value (which turns E8M0 byte s into the integer part of 2^(s-127): 0 for
    every scale below 127, the usual ones).  Another dtype is a TypeError naming the
    entry.  torch's ``load_state_dict`` hands each module a dict of its own, so the
    caller's is untouched (and the replacement is a view of the same bytes anyway)."""
    for name in names:
        key = prefix + name
        t = state_dict.get(key)
        if isinstance(t, torch.Tensor) and t.dtype != torch.uint8:
            state_dict[key] = bytes_by_view(f"state_dict[{key!r}]", t)


class BytesByView(torch.nn.Module):
    """A module whose uint8 buffers (``_byte_buffers``) hold MXFP4 bytes: ``load_state_dict``
    reads int8 and float8_e8m0fnu entries for them by view (:func:`view_loaded_bytes`), as
    the checkpoint readers do, with ``assign=True`` too."""

    _byte_buffers: Tuple[str, ...] = ()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        view_loaded_bytes(state_dict, prefix, self._byte_buffers)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def view_loaded_bytes_hook(module, state_dict, prefix, *args) -> None:
    """:func:`view_loaded_bytes` as a ``register_load_state_dict_pre_hook`` hook, for the
    byte buffers a module of another library's class names in ``_mxfp4x_byte_buffers``
    (a module-level function: the module still pickles)."""
    view_loaded_bytes(state_dict, prefix, getattr(module, "_mxfp4x_byte_buffers", ()))


def check_tensor(label: str, t, shape: Sequence[Optional[int]], what: str = "",
                 floating: bool = True) -> Any:
    """``t`` as a tensor of ``shape`` (None: any size along that axis; the rank always
    counts), a float tensor where ``floating``; a ValueError naming ``label``, its shape
    and the shape expected otherwise (a wrong shape would broadcast, or index past the
    tensor, at the first forward)."""
    want = "(" + ", ".join("*" if n is None else str(n) for n in shape) + \
        ("," if len(shape) == 1 else "") + ")"
    about = f" ({what})" if what else ""
    if not isinstance(t, (torch.Tensor, np.ndarray)):  # numpy bytes are taken by view
        raise TypeError(f"{label}: expected a torch tensor of shape {want}{about}, got "
                        f"{type(t).__name__}")
    if t.ndim != len(shape) or any(n is not None and n != m
                                   for n, m in zip(shape, t.shape, strict=True)):
        raise ValueError(f"{label}: expected shape {want}{about}, got {tuple(t.shape)}")
    is_float = t.is_floating_point() if isinstance(t, torch.Tensor) else t.dtype.kind == "f"
    if floating and not is_float:
        raise ValueError(f"{label}: expected a float tensor{about}, got {t.dtype}")
    return t


def check_dims(source: str, expected: Dict[str, Tuple[Optional[int], int, str]]) -> None:
    """Sizes a config (or GGUF metadata) states against the ones the tensors have:
    ``expected`` maps the key to (the stated value or None when absent, the tensors'
    value, which tensors say so); a ValueError naming ``source`` and the key on a
    difference."""
    for key, (stated, found, where) in expected.items():
        if stated is not None and stated != found:
            raise ValueError(f"{source}: {key} is {stated}, but {where} {found}")


def config_integer(config: dict, source: str, key: str) -> Optional[int]:
    """``config[key]`` as an int of at least 1, None where the config does not state it:
    a size for :func:`check_dims`; a ValueError naming ``source`` and the key for what is
    not one."""
    return _integer(f"{source}: {key}", config[key]) if key in config else None


def check_gguf_dims(ckpt, found: Dict[str, Tuple[int, str]]) -> None:
    """:func:`check_dims` of the sizes a GGUF file's metadata states (``{arch}.<key>``,
    integers, where the file has them): ``found`` maps ``<key>`` to (the tensors' value,
    which tensors say so)."""
    keys = {key: f"{ckpt.architecture}.{key}" for key in found}
    check_dims(str(ckpt.root), {keys[key]: (gguf_integer_if_any(ckpt, keys[key]), value, where)
                                for key, (value, where) in found.items()})


def require_tensor(ckpt, name: str, what: str) -> None:
    """A ValueError naming the checkpoint and the tensor where ``ckpt`` lacks ``name``
    (``what`` it is)."""
    if name not in ckpt:
        raise ValueError(f"{ckpt.root}: no tensor {name!r} ({what})")


def expert_range_of(expert_range, n_local: int, group) -> ExpertRange:
    """(e0, e1) of the experts a module holds: all of them (0, n_local) unless
    ``expert_range`` says which.  ``expert_range`` is a pair (e0, e1) or a ``range`` of
    step 1.  With ``group`` (torch.distributed) the ranks exchange the tokens routed to
    the experts others hold; without, a token routed to an expert outside the range is an
    IndexError (:func:`held_ids`)."""
    if expert_range is None:
        if group is not None:
            raise ValueError("expert_range: an expert-parallel module (group=...) needs the "
                             "range (e0, e1) of the experts it holds")
        return ExpertRange(0, n_local)
    e0, e1 = rng = parse_expert_range(expert_range)
    if e1 - e0 != n_local:
        raise ValueError(f"expert_range: {(e0, e1)} names {e1 - e0} experts, the bytes hold "
                         f"{n_local}")
    return rng


def held_ids(selected_experts, expert_range: ExpertRange):
    """The local indices (id - e0) of global expert ids, for a module holding experts
    [e0, e1) without a group; an IndexError naming the first id it does not hold."""
    e0, e1 = expert_range
    sel = torch.as_tensor(selected_experts)
    if sel.is_floating_point() or sel.is_complex() or sel.dtype == torch.bool:
        return sel  # the op names what it expected
    sel = sel.to(torch.int64)
    outside = (sel < e0) | (sel >= e1)
    if bool(outside.any()):
        raise IndexError(f"selected_experts: expert {int(sel[outside][0])} is not held by "
                         f"this module (it holds experts {e0}..{e1 - 1}; pass group= to "
                         f"reach the others)")
    return sel - e0


def expert_range_within(expert_range, n_experts: int, whose: str) -> ExpertRange:
    """(e0, e1) of the experts a load maps: all ``n_experts`` when ``expert_range`` is
    None, else a non-empty range within them; a ValueError naming ``whose`` experts they
    are otherwise."""
    rng = ExpertRange(0, n_experts) if expert_range is None else \
        parse_expert_range(expert_range)
    e0, e1 = rng
    if not 0 <= e0 < e1 <= n_experts:
        raise ValueError(f"expert_range: expected 0 <= e0 < e1 <= {n_experts} ({whose}), "
                         f"got {(e0, e1)}")
    return rng


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


def gguf_integer(ckpt, key: str, low: int = 1) -> int:
    """GGUF metadata value ``key`` as an int of at least ``low``, stored as one of GGUF's
    integer types: a float (even 2.0), a bool, a string or an array is refused, never
    rounded or parsed (llama.cpp reads these keys as integers).  A ValueError naming the
    file and the key otherwise, a missing key included."""
    if key not in ckpt.metadata:
        raise ValueError(f"{ckpt.root}: no {key!r} in the GGUF metadata")
    value = ckpt.metadata[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{ckpt.root}: metadata key {key!r}: expected an integer, got "
                         f"{type(value).__name__} {reprlib.repr(value)}")
    if value < low:
        raise ValueError(f"{ckpt.root}: metadata key {key!r}: expected an integer >= {low}, "
                         f"got {value}")
    return int(value)


def gguf_integer_if_any(ckpt, key: str, low: int = 1) -> Optional[int]:
    """:func:`gguf_integer` of a key the file may lack (None then)."""
    return gguf_integer(ckpt, key, low) if key in ckpt.metadata else None


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
