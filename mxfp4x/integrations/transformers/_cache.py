"""A key/value cache that grows in place (:class:`GrowingCache`): transformers'
``DynamicCache`` with its full-attention and sliding-window layers kept in buffers with
room for the tokens to come, so that a decoding step writes its token's keys and values
and hands the attention views of the buffers, instead of concatenating the whole cache
into a new tensor every step (``torch.cat``: a copy of every cached key and value of
every layer, each step).

The layers return what transformers' own return, the same keys and values in the same
order, and keep their other behaviour (``crop``, ``reorder_cache``, ``batch_select_indices``,
offloading, past recording of the sliding layers): an operation of transformers' that
replaces a layer's tensors makes the layer take them as its contents at its next
``update``.  The keys and values a layer hands out are views of its buffer, read along
their token dimension with the buffer's strides; the attention functions transformers
calls (and :func:`grouped_attention`) read such views as they are."""
from typing import Dict, Optional, Tuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

# room made at each growth beyond the tokens written: a quarter of them, at least this
# many tokens (a copy of the cache every quarter of its length, not every step)
_MIN_ROOM = 256


def _room(n: int) -> int:
    return n + max(_MIN_ROOM, n // 4)


class _Buffers:
    """One layer's key and value buffers, (batch, heads, capacity, head size), and the
    views of them the layer last handed out (which tell whether transformers replaced
    the layer's tensors since)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        b, h, n, d = keys.shape
        self.k = keys.new_empty((b, h, capacity, d))
        self.v = values.new_empty((b, h, capacity, values.shape[-1]))
        self.k[:, :, :n].copy_(keys)
        self.v[:, :, :n].copy_(values)
        self.start, self.end = 0, n
        self.view_k: Optional[torch.Tensor] = None
        self.view_v: Optional[torch.Tensor] = None

    def fits(self, new: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``new`` tokens (and their ``values``) go after the contents as they are."""
        k, v = self.k, self.v
        return (new.shape[:2] == k.shape[:2] and new.shape[-1] == k.shape[-1]
                and values.shape[:2] == v.shape[:2] and values.shape[-1] == v.shape[-1]
                and new.dtype == k.dtype and values.dtype == v.dtype
                and new.device == k.device and values.device == v.device)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        t = keys.shape[-2]
        self.k[:, :, self.end:self.end + t].copy_(keys)
        self.v[:, :, self.end:self.end + t].copy_(values)
        self.end += t

    def move_to_front(self) -> None:
        """The contents to the buffer's front."""
        s, n = self.start, self.end - self.start
        if s:
            for buf in (self.k, self.v):
                part = buf[:, :, s:self.end]
                buf[:, :, :n].copy_(part.clone() if s < n else part)
        self.start, self.end = 0, n

    def views(self, start: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, start:self.end], self.v[:, :, start:self.end]


def _current(layer) -> Optional[_Buffers]:
    """The layer's buffers if its tensors are still the views they handed out."""
    bufs = getattr(layer, "_mxfp4x_buffers", None)
    if bufs is not None and layer.keys is bufs.view_k and layer.values is bufs.view_v:
        return bufs
    return None


def _contents(layer, key_states: torch.Tensor,
              value_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The tokens the layer holds (none: the new states' first 0)."""
    if layer.keys is not None and layer.keys.numel():
        return layer.keys, layer.values
    return key_states[:, :, :0], value_states[:, :, :0]


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` (every token kept) in a buffer that grows by a
    quarter of its length at a time."""

    _mxfp4x_buffers: Optional[_Buffers] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        bufs = _current(self)
        if bufs is None or not bufs.fits(key_states, value_states) or \
                bufs.end + t > bufs.k.shape[2]:
            old_k, old_v = _contents(self, key_states, value_states)
            bufs = _Buffers(old_k, old_v, _room(old_k.shape[-2] + t))
        bufs.append(key_states, value_states)
        self.keys, self.values = bufs.views(0)
        bufs.view_k, bufs.view_v = self.keys, self.values
        self._mxfp4x_buffers = bufs
        return self.keys, self.values

    def reset(self) -> None:
        self._mxfp4x_buffers = None
        super().reset()


class GrowingSlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` (the last ``sliding_window - 1`` tokens
    kept, each step's attention over them and the new tokens) in a buffer the new tokens
    are written after, the kept ones moved to its front when it is full."""

    _mxfp4x_buffers: Optional[_Buffers] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.record_past or self.sliding_window < 2:  # transformers' own, its tensors
            return super().update(key_states, value_states, *args, **kwargs)  # replaced
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        t, keep = key_states.shape[-2], self.sliding_window - 1
        bufs = _current(self)
        if bufs is None or not bufs.fits(key_states, value_states):
            old_k, old_v = _contents(self, key_states, value_states)
            bufs = _Buffers(old_k, old_v, _room(keep + t))
        if bufs.end + t > bufs.k.shape[2]:
            bufs.move_to_front()
            if bufs.end + t > bufs.k.shape[2]:
                k, v = bufs.views(0)
                bufs = _Buffers(k, v, _room(keep + t))
        start = bufs.start
        bufs.append(key_states, value_states)
        full = bufs.views(start)
        bufs.start = max(start, bufs.end - keep)
        self.keys, self.values = bufs.views(bufs.start)
        bufs.view_k, bufs.view_v = self.keys, self.values
        self._mxfp4x_buffers = bufs
        return full

    def reset(self) -> None:
        self._mxfp4x_buffers = None
        super().reset()


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


# the model keyword a cache goes by in generate's model_kwargs (transformers' name for it
# changed from the second to the first)
_CACHE_KWARGS = ("cache", "past_key_values")


class _PrepareGrowing:
    """``generate``'s cache preparation (the model class's), its dynamic cache then made
    to grow in place: the model's own attribute, an object holding the model, so that a
    copy or a pickle of the model holds one for the copy."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, generation_config, model_kwargs, *args, **kwargs):
        model = self.model
        given = [model_kwargs.get(k) for k in _CACHE_KWARGS]
        result = type(model)._prepare_cache_for_generation(model, generation_config,
                                                          model_kwargs, *args, **kwargs)
        for key, before in zip(_CACHE_KWARGS, given, strict=True):
            made = model_kwargs.get(key)
            if before is None and type(made) is DynamicCache and \
                    not getattr(made, "offloading", False):
                grow_in_place(made)
        return result


def use_growing_cache(model: torch.nn.Module) -> bool:
    """``model.generate`` makes its dynamic caches grow in place (:func:`grow_in_place`),
    where it makes one itself (not a cache the caller passes, nor another
    ``cache_implementation``'s); returns whether the model has ``generate``'s cache
    preparation to wrap.  The model's class is left as it is."""
    if not hasattr(type(model), "_prepare_cache_for_generation"):
        return False
    setattr(model, "_prepare_cache_for_generation", _PrepareGrowing(model))  # noqa: B010
    return True
