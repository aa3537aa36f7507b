"""A key/value cache that grows in place (:class:`GrowingCache`): transformers'
``DynamicCache`` with its full-attention and sliding-window layers kept in buffers with
room for the tokens to come, so that a decoding step writes its token's keys and values
and hands the attention views of the buffers, instead of concatenating the whole cache
into a new tensor every step (``torch.cat``: a copy of every cached key and value of
every layer, each step).

The layers return what transformers' own return, the same keys and values in the same
order, and keep their other behaviour (``crop``, ``reorder_cache``, ``batch_select_indices``,
offloading, past recording of the sliding layers): an operation of transformers' that
replaces a layer's tensors drops its buffers, and the layer takes those tensors as its
contents at its next ``update`` (beam search's ``reorder_cache`` reorders the buffers
themselves).  The keys and values a layer hands out are views of its
buffer, read along their token dimension with the buffer's strides (the attention
functions transformers calls, and :func:`grouped_attention`, read such views as they
are); a view once handed out is never written again (new tokens go after it, a full
buffer is replaced, not moved).  An update that autograd records (states that require a
gradient) runs transformers' own, as do a sliding layer's past recording and a window
below 2."""
import weakref
from typing import Dict, Optional, Tuple

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

# room made at each growth beyond the tokens written: a quarter of them, at least this
# many tokens (a copy of the cache every quarter of its length, not every step)
_MIN_ROOM = 256


_CPU = torch.device("cpu")


def _room(n: int) -> int:
    return n + max(_MIN_ROOM, n // 4)


class _Buffers:
    """One layer's key and value buffers, (batch, heads, capacity, head size): their
    contents are tokens [start, end); and the views of them the layer last handed out
    (which tell whether transformers replaced the layer's tensors since)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        b, h, n, d = keys.shape
        self.k = keys.new_empty((b, h, capacity, d))
        self.v = values.new_empty((b, h, capacity, values.shape[-1]))
        self.k[:, :, :n].copy_(keys)
        self.v[:, :, :n].copy_(values)
        self.start, self.end = 0, n
        self.view_k: Optional[torch.Tensor] = None
        self.view_v: Optional[torch.Tensor] = None

    def takes(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether these new tokens go after the contents as ``torch.cat`` would join them
        (same batch, heads, head size, dtype and device), in the room left, by a write
        allowed here (not into an inference-mode tensor outside inference mode)."""
        return (values.shape[:2] == keys.shape[:2] and values.dtype == keys.dtype
                and values.device == keys.device
                and self.fits(tuple(keys.shape[:2]), keys.shape[-1], values.shape[-1],
                              keys.dtype, keys.device, keys.shape[-2]))

    def fits(self, batch_heads: Tuple[int, ...], k_dim: int, v_dim: int,
             dtype: torch.dtype, device: torch.device, tokens: int) -> bool:
        """Whether ``tokens`` new tokens of these (batch, heads), head sizes, dtype and
        device go after the contents, in the room left, by a write allowed here (not into
        an inference-mode tensor outside inference mode)."""
        k, v = self.k, self.v
        return (tuple(k.shape[:2]) == batch_heads and tuple(v.shape[:2]) == batch_heads
                and k.shape[-1] == k_dim and v.shape[-1] == v_dim
                and k.dtype == dtype and v.dtype == dtype
                and k.device == device and v.device == device
                and self.end + tokens <= k.shape[2]
                and (torch.is_inference_mode_enabled() or not k.is_inference()))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        t = keys.shape[-2]
        self.k[:, :, self.end:self.end + t].copy_(keys)
        self.v[:, :, self.end:self.end + t].copy_(values)
        self.end += t

    def views(self, start: int) -> Tuple[torch.Tensor, torch.Tensor]:
        n = self.end - start
        return self.k.narrow(2, start, n), self.v.narrow(2, start, n)


def _current(layer) -> Optional[_Buffers]:
    """The layer's buffers if its tensors are still the views they handed out."""
    bufs = layer._mxfp4x_buffers
    if bufs is not None and layer.keys is bufs.view_k and layer.values is bufs.view_v:
        return bufs
    return None


def _recorded(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    """Whether autograd records this update (it saves views that writes would change):
    the new states or the layer's tokens require a gradient."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (key_states, value_states, layer.keys, layer.values))


def _joined(layer, key_states: torch.Tensor,
            value_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The layer's tokens and the new ones, as transformers joins them (``torch.cat``,
    its dtype promotion and its errors), or the new ones alone."""
    if layer.keys is not None and layer.keys.numel():
        return (torch.cat([layer.keys, key_states], dim=-2),
                torch.cat([layer.values, value_states], dim=-2))
    return key_states, value_states


class _Growing(CacheLayerMixin):
    """What the two growing layers share: their buffers, handing out views of them, and
    dropping them when one of transformers' operations replaces the layer's tensors.  (A
    subclass of transformers' base, so that a layer of theirs can take a growing class.)"""

    _mxfp4x_buffers: Optional[_Buffers] = None
    keys: Optional[torch.Tensor]
    values: Optional[torch.Tensor]

    def _hand_out(self, bufs: _Buffers, start: int) -> None:
        self.keys, self.values = bufs.views(start)
        bufs.view_k, bufs.view_v = self.keys, self.values
        self._mxfp4x_buffers = bufs

    def _settle(self) -> None:
        if _current(self) is None:
            self._mxfp4x_buffers = None

    def _mxfp4x_room(self, batch: int, tokens: int, heads: int, head_dim: int,
                     dtype: torch.dtype) -> Optional[Tuple[_Buffers, int, int]]:
        """Where a decoding step may write ``tokens`` new tokens' keys and values straight
        into the buffers (mxfp4x's compiled attention step, :mod:`._decode`): the
        buffers, the new tokens' position and the first token the step's attention reads
        (what :meth:`update` would hand it); None where :meth:`update` must take them (no
        buffers yet, or other shapes, no room, an update transformers' code runs).  The
        caller writes them there, then calls :meth:`_mxfp4x_commit`."""
        bufs = _current(self)
        if bufs is None or _recorded(self, bufs.view_k, bufs.view_v):  # type: ignore[arg-type]
            return None
        if not (bufs.fits((batch, heads), head_dim, head_dim, dtype, _CPU, tokens)
                and bufs.k.is_contiguous() and bufs.v.is_contiguous()):
            return None
        return bufs, bufs.end, bufs.start

    def _mxfp4x_commit(self, bufs: _Buffers, tokens: int) -> None:
        """The layer after :meth:`_mxfp4x_room`'s caller wrote ``tokens`` tokens: what
        :meth:`update` leaves."""
        bufs.end += tokens
        self._hand_out(bufs, bufs.start)

    def crop(self, *args, **kwargs):
        super().crop(*args, **kwargs)  # type: ignore[misc]
        self._settle()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reordering of the sequences: the buffers reordered whole (their
        room too), so that the next step's tokens still go after the contents."""
        bufs = _current(self)
        if bufs is None or not self.get_seq_length():  # type: ignore[attr-defined]
            super().reorder_cache(beam_idx)  # type: ignore[misc]
            self._settle()
            return
        idx = beam_idx.to(bufs.k.device)
        bufs.k, bufs.v = bufs.k.index_select(0, idx), bufs.v.index_select(0, idx)
        self._hand_out(bufs, bufs.start)

    def batch_repeat_interleave(self, *args, **kwargs):
        super().batch_repeat_interleave(*args, **kwargs)  # type: ignore[misc]
        self._settle()

    def batch_select_indices(self, *args, **kwargs):
        super().batch_select_indices(*args, **kwargs)  # type: ignore[misc]
        self._settle()

    def offload(self, *args, **kwargs):
        super().offload(*args, **kwargs)  # type: ignore[misc]
        self._settle()

    def prefetch(self, *args, **kwargs):
        super().prefetch(*args, **kwargs)  # type: ignore[misc]
        self._settle()

    def reset(self) -> None:
        self._mxfp4x_buffers = None
        super().reset()  # type: ignore[misc]


class GrowingLayer(_Growing, DynamicLayer):
    """transformers' ``DynamicLayer`` (every token kept) in a buffer that grows by a
    quarter of its length at a time."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        if _recorded(self, key_states, value_states):
            self._mxfp4x_buffers = None
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        bufs = _current(self)
        if bufs is not None and bufs.takes(key_states, value_states):
            bufs.append(key_states, value_states)
        else:  # a new buffer: the views handed out keep the old one's tokens
            k, v = _joined(self, key_states, value_states)
            bufs = _Buffers(k, v, _room(k.shape[-2]))
        self._hand_out(bufs, 0)
        return self.keys, self.values  # type: ignore[return-value]


class GrowingSlidingWindowLayer(_Growing, DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` (the last ``sliding_window - 1`` tokens
    kept, each step's attention over them and the new tokens) in a buffer the new tokens
    are written after; a full buffer is replaced by one that starts with the kept ones."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.record_past or self.sliding_window < 2 or \
                _recorded(self, key_states, value_states):
            self._mxfp4x_buffers = None  # transformers' own, its tensors then replaced
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keep = self.sliding_window - 1
        bufs = _current(self)
        if bufs is not None and bufs.takes(key_states, value_states):
            start = bufs.start
            bufs.append(key_states, value_states)
        else:  # the kept tokens and the new ones in a new buffer
            k, v = _joined(self, key_states, value_states)
            bufs, start = _Buffers(k, v, _room(k.shape[-2])), 0
        full = bufs.views(start)
        bufs.start = max(start, bufs.end - keep)
        self._hand_out(bufs, bufs.start)
        return full

    def _mxfp4x_room(self, *args, **kwargs):
        if self.record_past or self.sliding_window < 2:
            return None
        return super()._mxfp4x_room(*args, **kwargs)

    def _mxfp4x_commit(self, bufs: _Buffers, tokens: int) -> None:
        self.cumulative_length += tokens
        bufs.end += tokens
        bufs.start = max(bufs.start, bufs.end - (self.sliding_window - 1))
        self._hand_out(bufs, bufs.start)


_GROWING: Dict[type, type] = {DynamicLayer: GrowingLayer,
                              DynamicSlidingWindowLayer: GrowingSlidingWindowLayer}


def grow_in_place(cache: DynamicCache) -> DynamicCache:
    """``cache``'s layers of transformers' two dynamic kinds, not yet written, become
    their growing forms (in place; other layers, and layers holding tokens, as they
    are); returns ``cache``."""
    for layer in cache.layers:
        cls = _GROWING.get(type(layer))
        if cls is not None and not getattr(layer, "is_initialized", True):
            layer.__class__ = cls
    return cache


class GrowingCache(DynamicCache):
    """transformers' ``DynamicCache`` whose full-attention and sliding-window layers grow
    in place (:class:`GrowingLayer`, :class:`GrowingSlidingWindowLayer`); the same
    arguments. Pass it to ``generate`` or a forward as ``cache=GrowingCache(config=
    model.config)``; models loaded through the door take it in ``generate`` by default."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        grow_in_place(self)
        if getattr(self, "layer_class_to_replicate", None) is DynamicLayer:  # no config:
            self.layer_class_to_replicate = GrowingLayer  # layers made as they are needed


# the model keyword a cache goes by in generate's model_kwargs (transformers' name for it
# changed from the second to the first)
_CACHE_KWARGS = ("cache", "past_key_values")


class _PrepareGrowing:
    """``generate``'s cache preparation (the model class's), its dynamic cache then made
    to grow in place: the model's own attribute, holding the model by a weak reference
    (no cycle keeps a deleted model alive); a copy or a pickle of the model holds one for
    the copy."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        model = self._model()
        given = [model_kwargs.get(k) for k in _CACHE_KWARGS]
        result = type(model)._prepare_cache_for_generation(model, generation_config,
                                                          model_kwargs, *args, **kwargs)
        for key, before in zip(_CACHE_KWARGS, given, strict=True):
            made = model_kwargs.get(key)
            if before is None and type(made) is DynamicCache and \
                    not getattr(made, "offloading", False):
                grow_in_place(made)
        return result

    @property
    def model(self) -> Optional[torch.nn.Module]:
        return self._model()

    def __deepcopy__(self, memo):
        model = self._model()
        return _PrepareGrowing(memo.get(id(model), model))

    def __reduce__(self):
        return _PrepareGrowing, (self._model(),)


def use_growing_cache(model: torch.nn.Module) -> bool:
    """``model.generate`` makes its dynamic caches grow in place (:func:`grow_in_place`),
    where it makes one itself (not a cache the caller passes, nor another
    ``cache_implementation``'s); returns whether the model has ``generate``'s cache
    preparation to wrap.  The model's class is left as it is."""
    if not hasattr(type(model), "_prepare_cache_for_generation"):
        return False
    setattr(model, "_prepare_cache_for_generation", _PrepareGrowing(model))  # noqa: B010
    return True
