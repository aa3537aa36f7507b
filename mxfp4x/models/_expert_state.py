"""Per-expert MXFP4 matrices as module state: each expert's gate, up and down bytes are
buffers named as per-expert checkpoints name them (``{e}.w1.weight_packed`` ...), and a
stamp shared with the holding module tells it when a weight was replaced or moved, so the
kernel tables it caches are rebuilt (never a table pointing into freed memory).

Two arrangements of the bytes, as the ops take them: ``"split"`` (gpt-oss's and the
compressed-tensors checkpoints': packed bytes and their scale bytes) and ``"gguf"``
(llama.cpp's block_mxfp4 blocks, scale byte first, read in place: ``weight_packed``
holds the (O, G, 17) blocks and ``weight_scale`` is None, as ``scale_bytes=None`` in the
ops).  One module holds one arrangement: a kernel table reads one."""
import threading
from typing import Optional, Sequence, Tuple

import torch

from .._core.coerce import bytes_by_view
from .._core.format import GGUF_BLOCK_BYTES, GROUP, GROUP_BYTES
from ._common import BytesByView


def _split(name, weights):
    """(packed, scales) of one projection: a pair of lists, or stacked tensors (E, O,
    G, 16) / (E, O, G) seen as lists of per-expert views (nothing copied); bytes typed
    int8 or float8_e8m0fnu are viewed as uint8.  ``(blocks, None)``: GGUF blocks, a
    stacked (E, O, G, 17) tensor or a list of (O, G, 17); scales come back None."""
    try:
        packed, scales = weights
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a (packed, scales) pair, got "
                        f"{type(weights).__name__}") from None
    if scales is None:  # GGUF blocks
        if isinstance(packed, torch.Tensor):
            packed = list(packed.unbind(0))
        packed = list(packed)
        for e, p in enumerate(packed):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{name}[{e}]: expected a torch tensor, got "
                                f"{type(p).__name__}")
            packed[e] = bytes_by_view(f"{name}[{e}] blocks", p)
        return packed, None
    if isinstance(packed, torch.Tensor):
        packed, scales = list(packed.unbind(0)), list(scales.unbind(0))
    packed, scales = list(packed), list(scales)
    if len(packed) != len(scales):
        raise ValueError(f"{name}: {len(packed)} packed tensors but {len(scales)} scale "
                         f"tensors")
    for e, (p, sc) in enumerate(zip(packed, scales, strict=True)):
        if not isinstance(p, torch.Tensor) or not isinstance(sc, torch.Tensor):
            raise TypeError(f"{name}[{e}]: expected torch tensors, got "
                            f"{type(p).__name__} and {type(sc).__name__}")
        packed[e] = bytes_by_view(f"{name}[{e}] packed", p)
        scales[e] = bytes_by_view(f"{name}[{e}] scales", sc)
    return packed, scales


class _Stamp:
    """A counter shared by a module and its expert matrices: bumped whenever a weight
    tensor is replaced or moved, so cached kernel tables are rebuilt.  Bumped under a
    lock: where threads run Python at once (a free-threaded build), two changing weights
    together could otherwise lose a bump, and the counter return to a value a rebuild
    recorded (its tables then kept)."""

    __slots__ = ("value",)
    _lock = threading.Lock()

    def __init__(self):
        self.value = 0

    def bump(self):
        with _Stamp._lock:
            self.value += 1


class _Stamped(torch.nn.Module):
    """A module whose changes bump the stamp it is linked to (the expert module that
    holds it links it, KimiK3Experts._link)."""

    def _changed(self):
        stamp = self.__dict__.get("_stamp")
        if stamp is not None:
            stamp.bump()


class ExpertMatrix(BytesByView, _Stamped):
    """One MXFP4 matrix of one expert: buffers ``weight_packed`` (O, in/2) or (O, in/32,
    16) and ``weight_scale`` (O, in/32), uint8, named as Kimi K3's checkpoint names them;
    or, for GGUF blocks (``scale`` None), ``weight_packed`` (O, in/32, 17) and
    ``weight_scale`` None.  Replacing either (assignment, ``load_state_dict(assign=True)``,
    ``.to()``) is seen by the module that holds it; an in-place change of the bytes is
    seen as well (the kernels read the tensors' memory), and so is other memory given to
    a buffer in place (``.data =``, ``.set_()``: _Weights.current).  ``load_state_dict``
    reads int8 and float8_e8m0fnu entries by view, as the checkpoint readers do."""

    _byte_buffers = ("weight_packed", "weight_scale")
    weight_packed: torch.Tensor
    weight_scale: Optional[torch.Tensor]

    def __init__(self, packed: torch.Tensor, scale: Optional[torch.Tensor]):
        super().__init__()
        self._stamp: Optional[_Stamp] = None
        self.register_buffer("weight_packed", packed)
        self.register_buffer("weight_scale", scale)

    @property
    def form(self) -> str:
        """The bytes' arrangement: "split" (packed bytes and scale bytes) or "gguf"."""
        return "gguf" if self.weight_scale is None else "split"

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in ("weight_packed", "weight_scale"):
            self._changed()

    def register_buffer(self, name, tensor, persistent=True):
        super().register_buffer(name, tensor, persistent)
        self._changed()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._changed()
        return out


class _ExpertWeights(_Stamped):
    """Gate (``w1``), up (``w3``) and down (``w2``) of one expert.  A matrix put in its
    place (``experts["3"].w1 = ExpertMatrix(...)``) bumps the stamp of the module that
    holds it, as a replaced buffer does."""

    def __init__(self, w1: ExpertMatrix, w3: ExpertMatrix, w2: ExpertMatrix):
        super().__init__()
        self._stamp: Optional[_Stamp] = None
        self.w1, self.w3, self.w2 = w1, w3, w2

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if isinstance(value, torch.nn.Module):
            self._changed()

    def add_module(self, name, module):
        super().add_module(name, module)
        self._changed()


def _mark(t: Optional[torch.Tensor]):
    """Where a tensor's bytes are and how they are laid out: what a kernel table built
    from it points into."""
    return None if t is None else (t.data_ptr(), t.shape, t.stride())


class _Weights:
    """What one state of the module's weights hands to the kernels: the tensors as
    tuples (gate then up, for the one per-slot call of both; the scale tuples None for
    GGUF blocks) and, built on first use, the CPU driver's tables (which own the tensors
    they point into, not their memory: ``.data =`` or ``.set_()`` on a buffer gives the
    same tensor other memory and frees the old, without a module-level change to stamp,
    so ``current`` compares each expert's tensors with where they were, for the experts a
    call reads)."""

    def __init__(self, stamp: int, experts: Sequence[_ExpertWeights]):
        self.stamp = stamp
        self.form = experts[0].w1.form
        for e, m in enumerate(experts):
            for name, mat in (("w1", m.w1), ("w3", m.w3), ("w2", m.w2)):
                if mat.form != self.form:
                    raise ValueError(f"expert {e} {name}: {mat.form} bytes in a module of "
                                     f"{self.form} bytes (one arrangement per module: give "
                                     f"GGUF blocks with weight_scale None everywhere, or "
                                     f"scale bytes everywhere)")
        g = [(m.w1.weight_packed, m.w1.weight_scale) for m in experts]
        u = [(m.w3.weight_packed, m.w3.weight_scale) for m in experts]
        d = [(m.w2.weight_packed, m.w2.weight_scale) for m in experts]
        gguf = self.form == "gguf"
        self.gate_up_packed = tuple(p for p, _ in g + u)
        self.gate_up_scales: Optional[tuple] = None if gguf else tuple(sc for _, sc in g + u)
        self.down_packed = tuple(p for p, _ in d)
        self.down_scales: Optional[tuple] = None if gguf else tuple(sc for _, sc in d)
        self.tables = None
        self.lock = threading.Lock()
        self.marks = [self._marks(e) for e in range(len(experts))]

    def _marks(self, e: int):
        n = len(self.down_packed)
        ts: Tuple[Optional[torch.Tensor], ...] = (
            self.gate_up_packed[e], self.gate_up_packed[n + e], self.down_packed[e])
        if self.gate_up_scales is not None and self.down_scales is not None:
            ts += (self.gate_up_scales[e], self.gate_up_scales[n + e], self.down_scales[e])
        return tuple(_mark(t) for t in ts)

    def current(self, ids: Sequence[int]) -> bool:
        """Whether experts ``ids`` (local indices) still have the memory and layout these
        tables were built from."""
        return all(self._marks(e) == self.marks[e] for e in ids)

    def cpu_tables(self):
        if self.tables is None:
            with self.lock:
                if self.tables is None:
                    from .._core import cpu_impl as _cpu_impl
                    self.tables = (
                        _cpu_impl.experts_of(self.gate_up_packed, self.gate_up_scales),
                        _cpu_impl.experts_of(self.down_packed, self.down_scales))
        return self.tables


def _matrix_shape(name, packed, scales):
    """(d_out, d_in) of one expert's bytes, (O, in/2) or (O, in/32, 16), scales (O, in/32);
    or GGUF blocks (O, in/32, 17) or (O, in/32 * 17), scales None."""
    if scales is None:
        width = GGUF_BLOCK_BYTES
        if packed.dim() == 3 and packed.shape[2] == width:
            return packed.shape[0], packed.shape[1] * GROUP
        if packed.dim() == 2 and packed.shape[1] % width == 0:
            return packed.shape[0], packed.shape[1] // width * GROUP
        raise ValueError(f"{name}: expected GGUF blocks (d_out, d_in/32, {width}) or (d_out, "
                         f"d_in/32 * {width}) (scales None), got shape {tuple(packed.shape)}")
    if packed.dim() == 3 and packed.shape[2] == GROUP_BYTES:
        n_groups = packed.shape[1]
    elif packed.dim() == 2 and packed.shape[1] % GROUP_BYTES == 0:
        n_groups = packed.shape[1] // GROUP_BYTES
    else:
        raise ValueError(f"{name}: expected packed bytes (d_out, d_in/2) or (d_out, d_in/32, "
                         f"16), got shape {tuple(packed.shape)}")
    if tuple(scales.shape) != (packed.shape[0], n_groups):
        raise ValueError(f"{name}: expected scales ({packed.shape[0]}, {n_groups}) for packed "
                         f"{tuple(packed.shape)}, got {tuple(scales.shape)}")
    return packed.shape[0], n_groups * GROUP
