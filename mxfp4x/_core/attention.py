"""The attention of a few query tokens over a key/value cache on CPU tensors, the query
heads grouped by the key/value head they share (:func:`decode_attention`): compiled C
(include/mxfp4x/attention.h) in one task per (sequence, key/value head), each cached key
and value read once, the softmax in float32 with gpt-oss's sink logit, the same bits
whatever the ISA, the thread count or the sequence's batch."""
from typing import Optional

import torch

from . import cpu as _cpu
from . import threads as _threads
from .activation import _C_DTYPES, _numpy
from .ops import runs_direct


def _cache_view(t: torch.Tensor) -> torch.Tensor:
    """A key or value cache as the kernel reads it: as it is where its last dimension is
    contiguous (a view of a longer buffer: the door's growing cache), else a copy."""
    t = t.detach()
    if (t.shape[3] > 1 and t.stride(3) != 1) or any(s < 0 for s in t.stride()):
        return t.contiguous()
    return t


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                     scaling: float, *, num_threads: Optional[int] = None,
                     isa: Optional[str] = None) -> Optional[torch.Tensor]:
    """``softmax(q k^T * scaling + mask, with one sink logit per head) v`` for query
    (B, HQ, TQ, D) over key and value (B, HKV, TK, D), query head h reading key/value head
    h // (HQ // HKV), returned as (B, TQ, HQ, D) in the query's dtype; ``mask`` additive,
    broadcast to (B, HQ, TQ, TK) from (1 or B, 1 or HQ, TQ, TK) (None: no mask);
    ``sinks`` (HQ,) or None.

    Each score is a chain of float32 fmas over D (exact products of 16-bit operands), the
    softmax in float32 (e^x within 1 ulp) with the sink's term in its sum, the weighted
    values a chain of fmas over the keys, the result rounded once (attention.h).

    Returns None where the kernel does not take the call: tensors not on the CPU, a
    gradient to record, dtypes other than float32/bfloat16/float16 or differing between
    query, key and value, a mask that is not a floating one of those dtypes or does not
    broadcast so."""
    dtype = query.dtype
    if dtype not in _C_DTYPES or key.dtype != dtype or value.dtype != dtype \
            or query.dim() != 4 or key.dim() != 4 or key.shape != value.shape \
            or key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3] \
            or key.shape[1] == 0 or query.shape[1] % key.shape[1] \
            or (sinks is not None and (sinks.dtype not in _C_DTYPES
                                       or sinks.shape != (query.shape[1],))) \
            or not runs_direct(tuple(t for t in (query, key, value, mask, sinks)
                                     if t is not None), ()):
        return None
    b, hq, tq, d = query.shape
    tk = key.shape[2]
    if mask is not None:
        if mask.dtype not in _C_DTYPES or mask.dim() != 4 or mask.shape[2] != tq \
                or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hq) \
                or mask.shape[3] < tk:
            return None
        mask = mask[..., :tk]
        if tk > 1 and mask.stride(3) != 1 or any(s < 0 for s in mask.stride()):
            mask = mask.contiguous()
    out = torch.empty((b, tq, hq, d), dtype=dtype)
    _cpu.attention(_numpy(query.detach().contiguous()), _numpy(_cache_view(key)),
                   _numpy(_cache_view(value)),
                   None if mask is None else _numpy(mask.detach()),
                   None if sinks is None else _numpy(sinks.detach().contiguous()),
                   _numpy(out), _C_DTYPES[dtype],
                   _C_DTYPES[mask.dtype] if mask is not None else "float32",
                   _C_DTYPES[sinks.dtype] if sinks is not None else "float32",
                   float(scaling), isa=isa or None, n_threads=_threads.resolve(num_threads))
    return out
