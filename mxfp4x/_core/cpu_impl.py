"""The CPU backend in torch terms: the one place that turns tensors into a call of the
compiled driver (``mxfp4x._core.cpu.Call``), which checks it and runs it.

Memory is arranged here and nowhere else: each expert row's packed bytes and scale
bytes contiguous (outer expert / row strides pass through, so expert slices and
per-expert tensors are never copied), or for GGUF blocks (``scales`` None) each row's
17-byte blocks contiguous, read in place; latents contiguous in their own dtype (16-bit
ones stay 16-bit), expert ids int64, weights and results in the compute dtype.
"""
import weakref
from typing import Sequence, Union

import numpy as np
import torch

from . import cpu as _cpu
from . import threads as _threads
from .format import GGUF_BLOCK_BYTES, GROUP_BYTES, accumulation_dtype

Bytes = Union[torch.Tensor, Sequence[torch.Tensor]]

_DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64",
                torch.bfloat16: "bfloat16", torch.float16: "float16"}
# the shared outputs the driver starts the sums from as they are (converting exactly)
_EXACT_INTO = {torch.float32: (torch.float32, torch.bfloat16, torch.float16),
               torch.float64: tuple(_DTYPE_NAMES)}




def _rows_contiguous(t, inner):
    """t with its last ``inner`` dims C-contiguous (outer strides may be anything)."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - inner, -1):
        if t.shape[d] > 1 and t.stride(d) != expected:
            return t.contiguous()
        expected *= t.shape[d]
    return t


def _array(t):
    """A zero-copy numpy view of a contiguous CPU tensor (16-bit floats as int16).  Each
    torch op costs a small call 10-30 us when the caches are cold (as they are after the
    kernels stream the experts), so only the ops needed: no detach without a gradient."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy()


def _expert_bytes(name, t, n_groups, width=GROUP_BYTES):
    """One expert's bytes as (d_out, n_groups * width) rows: (O, G, width) or
    (O, G*width); width 16 (packed bytes) or 17 (GGUF blocks)."""
    if t.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8 bytes, got {t.dtype}")
    if t.dim() == 3 and t.shape[2] == width and (n_groups is None or t.shape[1] == n_groups):
        return _rows_contiguous(t, 2).flatten(1) if t.shape[0] else \
            t.reshape(0, t.shape[1] * width)  # (reshape(0, -1) is ambiguous)
    if t.dim() == 2 and (n_groups is None or t.shape[1] == n_groups * width) and \
            (n_groups is not None or t.shape[1] % width == 0):
        return _rows_contiguous(t, 1)
    raise ValueError(f"{name}: expected (d_out, n_groups, {width}) or (d_out, n_groups * "
                     f"{width}) bytes, got shape {tuple(t.shape)}")


def _table(n_experts, blocks, blocks_stride, row_stride_blocks, scales, scales_stride,
           row_stride_scales):
    """The driver's (E, 4) int64 table of stacked experts: per expert its first packed
    byte and first scale byte, and their row strides (numpy: a few microseconds where
    the same in torch ops took about 25 of a decode step's call)."""
    e = np.arange(n_experts, dtype=np.int64)
    table = np.empty((n_experts, 4), dtype=np.int64)
    table[:, 0] = blocks + e * blocks_stride
    table[:, 1] = scales + e * scales_stride
    table[:, 2] = row_stride_blocks
    table[:, 3] = row_stride_scales
    return table


def _stacked(packed, scales):
    """Stacked experts as the driver's table: packed (E, O, G, 16) and scales (E, O, G),
    or GGUF blocks (E, O, G, 17) with scales None.  Returns (table, d_out, n_groups,
    owner): owner the tensors the table points into (a copy where rows were not
    contiguous)."""
    if scales is None:
        width = GGUF_BLOCK_BYTES
        if packed.dim() != 4 or packed.shape[3] != width or packed.dtype != torch.uint8:
            raise ValueError(f"mxfp4x: expected uint8 GGUF blocks (E, O, G, {width}) (scales "
                             f"None), got {tuple(packed.shape)} {packed.dtype}")
        pk: torch.Tensor = _rows_contiguous(packed, 2)
        table = _table(pk.shape[0], pk.data_ptr() + 1, pk.stride(0), pk.stride(1),
                       pk.data_ptr(), pk.stride(0), pk.stride(1))
        return table, pk.shape[1], pk.shape[2], pk
    if packed.dim() != 4 or packed.shape[3] != GROUP_BYTES or not isinstance(
            scales, torch.Tensor) or tuple(scales.shape) != tuple(packed.shape[:3]) or \
            packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4x: expected uint8 packed (E, O, G, 16) and scales "
                         f"(E, O, G), got {tuple(packed.shape)} {packed.dtype} and "
                         f"{tuple(getattr(scales, 'shape', ()))} "
                         f"{getattr(scales, 'dtype', type(scales).__name__)}")
    pk = _rows_contiguous(packed, 2)
    sc: torch.Tensor = _rows_contiguous(scales, 1)
    table = _table(pk.shape[0], pk.data_ptr(), pk.stride(0), pk.stride(1), sc.data_ptr(),
                   sc.stride(0), sc.stride(1))
    return table, pk.shape[1], pk.shape[2], (pk, sc)


# The tables of stacked experts that calls were given, one per packed tensor, dropped when
# that tensor is: building one (torch and numpy ops) took 90 of a small call's 240 us with
# the caches cold, as the kernels leave them (AMD EPYC Zen 5).  A table holds addresses and
# strides, never values: it is a function of the tensors' addresses, shapes, strides and
# dtypes (_fingerprint), so an entry serves whenever those are the same (values changed in
# place are read by the next call as ever).  It owns neither tensor (the call holds them),
# so it never keeps a model's weights alive.
_TABLES: dict = {}


def _fingerprint(packed, scales):
    one = (packed.data_ptr(), packed.shape, packed.stride(), packed.dtype)
    return one if scales is None else \
        (one, scales.data_ptr(), scales.shape, scales.stride(), scales.dtype)


def _call_experts(packed: Bytes, scales: Bytes) -> _cpu.Experts:
    """experts_of for one call's duration (packed and scales stay alive through it):
    stacked tensors' tables come from _TABLES."""
    if not isinstance(packed, torch.Tensor) or not (
            scales is None or isinstance(scales, torch.Tensor)):
        return experts_of(packed, scales)
    fp = _fingerprint(packed, scales)
    key = id(packed)
    hit = _TABLES.get(key)
    if hit is not None and hit[1] == fp:
        return hit[2]
    table, d_out, n_groups, owner = _stacked(packed, scales)
    form = "split" if scales is not None else "gguf"
    given, kept = ((packed,), (owner,)) if scales is None else ((packed, scales), owner)
    if any(k is not t for k, t in zip(kept, given, strict=True)):
        # rows copied to be contiguous: the table owns the copy, and is not kept
        return _cpu.Experts(table, d_out=d_out, n_groups=n_groups, owner=owner, form=form)
    ex = _cpu.Experts(table, d_out=d_out, n_groups=n_groups, owner=None, form=form)
    _TABLES[key] = (weakref.ref(packed, _forget(key)), fp, ex)
    return ex


def _forget(key):
    """The callback that drops _TABLES[key] when its packed tensor is freed."""
    def drop(_ref):
        _TABLES.pop(key, None)
    return drop


def _gguf_experts_of(packed: Bytes) -> _cpu.Experts:
    """GGUF block_mxfp4 blocks read in place: stacked (E, O, G, 17) or a list of E
    (O, G, 17) / (O, G*17); each row's blocks contiguous (else that expert is copied)."""
    width = GGUF_BLOCK_BYTES
    if isinstance(packed, torch.Tensor):
        table, d_out, n_groups, owner = _stacked(packed, None)
        return _cpu.Experts(table, d_out=d_out, n_groups=n_groups, owner=owner, form="gguf")
    if not len(packed):
        raise ValueError("mxfp4x: expected at least one expert")
    p0 = _expert_bytes("packed_weights[0]", packed[0], None, width)
    d_out, n_groups = p0.shape[0], p0.shape[1] // width
    keep = []
    rows = []
    for i, p in enumerate(packed):
        p = _expert_bytes(f"packed_weights[{i}]", p, n_groups, width)
        if p.shape[0] != d_out:
            raise ValueError(f"expert {i}: expected GGUF blocks ({d_out}, {n_groups}, {width}), "
                             f"got {tuple(p.shape)}")
        if p.data_ptr() != packed[i].data_ptr():  # a copy (rows were not contiguous)
            keep.append(p)
        rows.append((p.data_ptr() + 1, p.data_ptr(), p.stride(0), p.stride(0)))
    per_expert = np.array(rows, dtype=np.int64).reshape(len(rows), 4)
    return _cpu.Experts(per_expert, d_out=d_out, n_groups=n_groups,
                        owner=(tuple(packed), keep), form="gguf")


def experts_of(packed: Bytes, scales: Bytes) -> _cpu.Experts:
    """The experts' description for the driver: packed (E, O, G, 16) and scales
    (E, O, G) uint8, or lists of E per-expert tensors (O, G, 16) / (O, G*16) and
    (O, G); or, with scales None, GGUF blocks (E, O, G, 17) or a list of (O, G, 17) /
    (O, G*17).  Nothing is stacked or copied (rows already contiguous); the result keeps
    the tensors alive.  An ``_cpu.Experts`` passes through (a module's cached table)."""
    if isinstance(packed, _cpu.Experts):
        return packed
    if scales is None:
        return _gguf_experts_of(packed)
    if isinstance(packed, torch.Tensor):
        table, d_out, n_groups, owner = _stacked(packed, scales)
        return _cpu.Experts(table, d_out=d_out, n_groups=n_groups, owner=owner)
    if isinstance(scales, torch.Tensor):
        raise ValueError("scale_bytes: expected a list of per-expert tensors, as "
                         "packed_weights is")
    if len(packed) != len(scales) or not len(packed):
        raise ValueError(f"mxfp4x: expected as many scale tensors as packed ones (at least "
                         f"one), got {len(packed)} and {len(scales)}")
    p0 = _expert_bytes("packed_weights[0]", packed[0], None)
    d_out, n_groups = p0.shape[0], p0.shape[1] // GROUP_BYTES
    shape_p, shape_s = tuple(packed[0].shape), (d_out, n_groups)
    u8 = torch.uint8
    keep = []
    rows = []
    for i, (p, s) in enumerate(zip(packed, scales, strict=True)):
        # the common case (contiguous uint8 entries of one shape) costs a few attribute
        # reads per expert: a checkpoint layer passes hundreds of them on every call
        if not (p.dtype == u8 and s.dtype == u8 and p.shape == shape_p and
                s.shape == shape_s and p.is_contiguous() and s.is_contiguous()):
            p = _expert_bytes(f"packed_weights[{i}]", p, n_groups)
            if s.dtype != u8 or tuple(s.shape) != shape_s or p.shape[0] != d_out:
                raise ValueError(f"expert {i}: expected packed ({d_out}, {n_groups}, 16) and "
                                 f"uint8 scales {shape_s}, got {tuple(p.shape)} and "
                                 f"{tuple(s.shape)} {s.dtype}")
            s = _rows_contiguous(s, 1)
            keep.append((p, s))
        rows.append((p.data_ptr(), s.data_ptr(), p.stride(0), s.stride(0)))
    per_expert = np.array(rows, dtype=np.int64).reshape(len(rows), 4)
    # the table owns the tensors themselves, never the caller's list: a list entry
    # replaced later must not free memory the table still points into
    return _cpu.Experts(per_expert, d_out=d_out, n_groups=n_groups,
                        owner=(tuple(packed), tuple(scales), keep))


class _Staged:
    """An operand of a chunked call, tokens [t0, t1) at a time, as the driver reads it:
    C-contiguous, of ``dtype``.  Views where the caller's tensor already is that; else
    each chunk is copied (converted) into one buffer of the longest chunk, reused: a
    caller's expanded shared output, strided latents, broadcast gradient, float64 shared
    output for float32 latents or int32 ids are never copied whole, and no chunk-sized
    copy is freed and made again per chunk (which let glibc's heap grow with T: 106
    instead of 21 MiB for 400000 tokens)."""

    def __init__(self, t, dtype, chunks):
        self.t, self.dtype, self.buf = t.detach() if t.requires_grad else t, dtype, None
        self.ready = self.t.is_contiguous() and self.t.dtype == dtype
        if not self.ready and len(chunks) > 1:
            longest = max(t1 - t0 for t0, t1 in chunks)
            self.buf = torch.empty((longest, *self.t.shape[1:]), dtype=dtype)

    def rows(self, t0, t1, per_slot=False):
        """Tokens [t0, t1) as 2-D rows: (tokens, W), or per slot (tokens * K, W).  A call of
        one chunk takes the tensor itself, or one converted copy (no slices, no buffer:
        fewer torch ops, see _array)."""
        c = self.t if t0 == 0 and t1 == self.t.shape[0] else self.t[t0:t1]
        if self.buf is not None:
            c = self.buf[:t1 - t0].copy_(c)
        elif not self.ready:  # one chunk
            c = c.to(self.dtype).contiguous()
        # explicit sizes: reshape(-1, 0) of an empty tensor is ambiguous
        return c.reshape(c.shape[0] * c.shape[1], c.shape[-1]) if per_slot else c


# Long prefills run in chunks of whole tokens, so the working memory of a call stays flat
# whatever T is: the latents in the kernel layout (on a bf16 unit instead every pair's
# latents, gathered), the float32 sums of a 16-bit result (per running thread in the
# driver: one task's columns of every row of the chunk), the routing arrays and ids and
# weights of its pairs; the driver's other per-thread scratch is bounded on its own.  A
# token's result does not depend on the other tokens of its call (batch invariance), so
# chunking never changes a bit; the weights are read once per chunk.  The chunk bound
# (_chunk_bound) covers those bytes per token (_forward_token_bytes), but never fewer
# than _MIN_CHUNK_TOKENS tokens; the chunks are then made equal (_chunks).  gpt-oss-20b
# gate/up (I = 2880, O = 5760, K = 4), bfloat16 on a bf16 unit, 2 threads: 974 tokens
# under 24 MiB, 21.4 MiB of gathered latents and 2.5 of sums.  Counted as whole float32
# result rows (O per token, beside a float32 layout copy the bf16 unit never makes), the
# sums split its T = 512 in two chunks of 256 that read every expert twice: one chunk
# took 98-100 instead of 105-107 ms on 2 threads, 186-188 instead of 198-202 on 1 (AMD
# EPYC Zen 5, alternated in one process; the same bits).  Experts of more than
# _CHUNK_WEIGHT_SHARE x _CHUNK_BYTES allow a chunk that share of their own bytes instead:
# Kimi K3's 896 w1 experts (5.2 GB) chunk by 82 MB, and bf16 T = 512 (its gathered
# latents 59 MB) runs as one chunk instead of two that each read most of the experts:
# 352-359 instead of 381-384 ms on 2 threads (AMD EPYC Zen 5, alternated).
_CHUNK_BYTES = 24 << 20
_CHUNK_WEIGHT_SHARE = 64
_MIN_CHUNK_TOKENS = 256


def _pair_bytes(item):
    """Working bytes per token-expert pair: the driver's routing (source row, destination
    row, weight).  The chunk's int64 ids and compute-dtype weights are the caller's
    tensors, or _Staged's copies where they are not (_copy_bytes)."""
    return 8 + 8 + item


def _pairs(sel, mix, t0, t1):
    """Tokens [t0, t1) of the expert ids (int64) and weights (of _mix_dtype, or None), as
    numpy arrays (``sel``, ``mix``: _Staged)."""
    return _array(sel.rows(t0, t1)), None if mix is None else _array(mix.rows(t0, t1))


def _forward_token_bytes(dtype, n_groups, d_out, top_k, k_in, k_out, n_threads, isa):
    """A forward call's working bytes per token (above): latents of ``dtype`` (``k_in``
    rows per token, ``n_groups`` groups), ``k_out`` result rows of ``d_out``, on
    ``n_threads`` threads of ``isa``."""
    compute = accumulation_dtype(dtype)
    item = 8 if compute == torch.float64 else 4
    bf16 = dtype == torch.bfloat16
    if bf16 and _cpu.has_bf16_unit(isa):  # every pair's latents gathered, and its flag
        latents = top_k * (n_groups * 32 * 2 + 1)
    else:  # the token rows in the kernel layout
        latents = item * k_in * n_groups * 32
    sums = _cpu.forward_sums_columns(d_out, n_threads, isa=isa, bf16=bf16) \
        if compute != dtype else 0
    return latents + item * k_out * sums + top_k * _pair_bytes(item)


def _mix_dtype(mix, compute):
    """The dtype the driver reads the mixture weights in: 16-bit ones as they are (it
    converts them exactly), others in the compute dtype."""
    return mix.dtype if mix is not None and mix.dtype in (torch.bfloat16, torch.float16) \
        else compute


def _mix_bytes(mix, mix_dtype, compute):
    """Bytes per token of the driver's converted copy of 16-bit mixture weights."""
    return 0 if mix is None or mix_dtype == compute else mix.shape[1] * compute.itemsize


def _copy_bytes(t, dtype):
    """Bytes per token of _Staged's buffer for ``t`` (made where ``t`` is not contiguous
    or not of ``dtype``)."""
    if t is None or (t.is_contiguous() and t.dtype == dtype):
        return 0
    return t.shape[1:].numel() * dtype.itemsize


def _chunk_bound(ex):
    """A chunk's working bytes for the experts ``ex`` (above): _CHUNK_BYTES, or
    1 / _CHUNK_WEIGHT_SHARE of the experts' packed bytes and scales where that is more."""
    weights = ex.n_experts * ex.d_out * ex.n_groups * (GROUP_BYTES + 1)
    return max(_CHUNK_BYTES, weights // _CHUNK_WEIGHT_SHARE)


def _chunks(n_tokens, bytes_per_token, bound):
    """Token ranges of at most ``bound`` bytes' tokens, as few as it allows, of equal
    length but the last: 512 tokens of 1 byte under a bound of 435 run as 256 + 256, not
    435 + 77 (a small last chunk read every selected expert again for a few tokens
    each)."""
    step = max(_MIN_CHUNK_TOKENS, bound // max(1, bytes_per_token))
    n_chunks = max(1, -(-n_tokens // step))
    step = -(-n_tokens // n_chunks) if n_tokens else step
    return [(t0, min(n_tokens, t0 + step)) for t0 in range(0, n_tokens, step)] or [(0, 0)]


def experts(x, packed, scales, sel, mix, shared, num_threads, *, per_slot_outputs=False,
            isa=None, out=None):
    """The forward product on CPU tensors.  x: (T, I), or (T, K, I) with one latent
    row per slot.  Returns shared + sum_k p W x (T, O) in x's dtype, or with
    ``per_slot_outputs`` W x per slot (T, K, O) (mix and shared then None); ``out``: a
    contiguous tensor of that shape and dtype to write it into."""
    compute = accumulation_dtype(x.dtype)
    n_tokens, top_k = sel.shape
    slot_latents = x.dim() == 3
    ex = _call_experts(packed, scales)
    k_out = top_k if per_slot_outputs else 1
    if not per_slot_outputs and tuple(shared.shape) != (n_tokens, ex.d_out):
        raise ValueError(f"shared_output: expected ({n_tokens}, {ex.d_out}), got "
                         f"{tuple(shared.shape)}")
    # the result in x's dtype, written by the driver: its sums in the compute dtype (for
    # 16-bit latents each task's float32 rows, rounded once into the result), each token's
    # starting from its shared output, converted in the driver's tasks too (so a call runs
    # on num_threads threads, no torch conversion on torch's own)
    result = torch.empty((n_tokens * k_out, ex.d_out), dtype=x.dtype) if out is None else \
        out.view(n_tokens * k_out, ex.d_out)
    # the shared output as the driver starts from it: its own dtype where the conversion
    # into the compute dtype is exact (the driver converts), else rounded once here
    start_dtype = None if per_slot_outputs else (
        shared.dtype if shared.dtype in _EXACT_INTO[compute] else compute)
    k_in = top_k if slot_latents else 1
    n_threads = _threads.resolve(num_threads)
    if per_slot_outputs:
        mix = shared = None
    mix_dtype = _mix_dtype(mix, compute)
    staged = ((x, x.dtype), (shared, start_dtype), (sel, torch.int64), (mix, mix_dtype))
    chunks = [(0, n_tokens)] if n_tokens <= _MIN_CHUNK_TOKENS else _chunks(
        n_tokens, _forward_token_bytes(x.dtype, ex.n_groups, ex.d_out, top_k, k_in, k_out,
                                       n_threads, isa) +
        sum(_copy_bytes(t, d) for t, d in staged) + _mix_bytes(mix, mix_dtype, compute),
        _chunk_bound(ex))
    xs, shared_s, sel_s, mix_s = (None if t is None else _Staged(t, d, chunks)
                                  for t, d in staged)
    for t0, t1 in chunks:
        sel64, mix_arr = _pairs(sel_s, mix_s, t0, t1)
        _cpu.Call(ex, product="forward", compute=_DTYPE_NAMES[compute],
                  selected=sel64, mix=mix_arr, src=_array(xs.rows(t0, t1, slot_latents)),
                  src_dtype=_DTYPE_NAMES[x.dtype],
                  src_rows="slot" if slot_latents else "token",
                  dst=_array(result if len(chunks) == 1 else result[t0 * k_out:t1 * k_out]),
                  dst_dtype=_DTYPE_NAMES[x.dtype],
                  dst_rows="slot" if per_slot_outputs else "token",
                  init=None if shared_s is None else _array(shared_s.rows(t0, t1)),
                  init_dtype=None if start_dtype is None else _DTYPE_NAMES[start_dtype],
                  mix_dtype=_DTYPE_NAMES[mix_dtype], isa=isa, n_threads=n_threads).run()
    return result.view(n_tokens, top_k, ex.d_out) if per_slot_outputs else result


def grad_latents(grad, packed, scales, sel, mix, x, num_threads, *, isa=None):
    """The transposed product: dx = sum_k p W^T grad, shaped and typed like x.  Per-slot
    latents (T, K, I) get per-slot rows; a per-slot grad (T, K, O) (of the per-slot
    outputs) has weight 1 (mix None)."""
    compute = accumulation_dtype(x.dtype)
    slot_latents, slot_grad = x.dim() == 3, grad.dim() == 3
    ex = _call_experts(packed, scales)
    n_tokens, top_k = sel.shape
    k_in = top_k if slot_latents else 1
    result = torch.empty((n_tokens * k_in, x.shape[-1]), dtype=x.dtype)
    # the gradient as the driver reads it: its own dtype where the conversion into the
    # compute dtype is exact (the driver converts), else rounded once here, per chunk
    g_dtype = grad.dtype if grad.dtype in _EXACT_INTO[compute] else compute
    item = 8 if compute == torch.float64 else 4
    # the driver's layout copy of dx (in the compute dtype; the driver converts the
    # gradient and rounds dx into a 16-bit result itself, on the call's threads), and a
    # chunk's copy of the gradient where it is converted or not contiguous
    if slot_grad:
        mix = None
    mix_dtype = _mix_dtype(mix, compute)
    staged = ((grad, g_dtype), (sel, torch.int64), (mix, mix_dtype))
    per_token = item * k_in * ex.n_groups * 32 + top_k * _pair_bytes(item) + \
        sum(_copy_bytes(t, d) for t, d in staged) + _mix_bytes(mix, mix_dtype, compute)
    n_threads = _threads.resolve(num_threads)
    chunks = _chunks(n_tokens, per_token, _chunk_bound(ex))
    grad_s, sel_s, mix_s = (None if t is None else _Staged(t, d, chunks) for t, d in staged)
    for t0, t1 in chunks:
        sel64, mix_arr = _pairs(sel_s, mix_s, t0, t1)
        _cpu.Call(ex, product="transposed", compute=_DTYPE_NAMES[compute],
                  selected=sel64, mix=mix_arr, src=_array(grad_s.rows(t0, t1, slot_grad)),
                  src_dtype=_DTYPE_NAMES[g_dtype], src_rows="slot" if slot_grad else "token",
                  dst=_array(result[t0 * k_in:t1 * k_in]), dst_dtype=_DTYPE_NAMES[x.dtype],
                  dst_rows="slot" if slot_latents else "token",
                  mix_dtype=_DTYPE_NAMES[mix_dtype], isa=isa, n_threads=n_threads).run()
    return result.view(x.shape)
