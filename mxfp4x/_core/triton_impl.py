"""The GPU kernel (Triton): routed MXFP4 experts decoded in registers, never in memory.

Two kernels (``triton_kernels``), both reading a group of 32 inputs at a time: its rows'
16 packed bytes as one block and its scale byte, decoded in registers (the E2M1 nibble's
magnitude bits placed in a float32's exponent and mantissa give its value times 2^-126,
exactly; times 2^126, then times the group's 2^(s - 127) built from the scale byte's
bits, both exact: no table).

* **Float32 latents** run float32 multiply-adds on the CUDA cores (never TF32): per
  output element a chain of fmas over the inputs in order, from zero.
* **16-bit latents** (bf16, f16) run on the tensor cores: per group, the 32 products of
  its E2M1 values (exact in the latents' type) and the latents summed by ``tl.dot`` into
  a fresh float32 partial (each product exact in float32), then ``acc = fma(partial,
  scale, acc)`` with the group's power-of-two scale, groups in order.  A group's sum is
  the instruction's; its order is the same for every token and batch.

The **token kernels** (at most ``TOKEN_KERNEL_PAIRS_PER_EXPERT`` pairs per expert on
average: decoding) take one token and ``TOKEN_BLOCK_O`` rows per program, the mixture
weights and the shared output combined in the same launch: one launch per call, no host
sync, no sort. Float32 (``token_kernel``): the K slots side by side, each (slot, row)
its own fma chain (one warp: a thread holds a row's slots, independent chains); 16-bit
(``token_mma_kernel``): the slots side by side too, one batched tensor-core step a
group. Above that the pairs are sorted by expert on the device and cut into tiles of one
expert (the **tile kernel**: ``TILE_TOKENS`` pairs of float32 latents, ``MMA_TILE`` of
16-bit ones, times ``BLOCK_O`` rows), and the per-pair products are weighted and summed
over slots in order k = 0..K-1 in torch, with the token kernel's roundings. A pair's
products are the same chain (float32: the same fmas in the same order; 16-bit: the same
tensor-core instruction on a tile of the same height whose other rows are padding or
other pairs, which it does not mix), so a token's bits do not depend on its batch or on
which kernel ran.

Expert ids are checked on the host before the kernels run (``check_ids``: an IndexError
naming the id), except while a CUDA graph is being captured, where no host sync can
happen: there the token kernel gives NaN for an id outside [0, E) (it reads expert 0's
rows, never memory outside the weights) and the tile path leaves NaN in the pairs no
tile takes, so a bad id is never a silent answer. Experts given as a list of tensors are
read through a table of (address, row stride, group stride) per expert (the same bits as
stacked), built on a list's first call and kept (``_table``). Float64 latents, weights
whose bytes are not contiguous within a group, lists of tensors of different shapes, and
anything ``qualifies`` refuses take the torch path.
"""
import collections
import contextlib
import functools
import importlib.util
import os

import torch

from .torch_impl import d_out_of
from .validation import check_expert_ids

TILE_TOKENS = 16  # float32 pairs per tile: tl.dot needs 16 rows; fewer are padded with zeros
# 16-bit pairs per tile on the tensor cores, and the token kernel's tile height there: one
# height for both, so that every pair runs the same instruction (under 64: from 64 rows
# Triton may pick sm_90's wgmma for the tile kernel, never for the token kernel's batched
# dot, and the bits would follow the kernel)
MMA_TILE = 16
BLOCK_O = 128  # output rows per tile program; a step is one group (32 inputs)
# calls with at most this many pairs per expert (on average) take the token kernel: one
# token per program, the same products in the same order (so the same bits)
TOKEN_KERNEL_PAIRS_PER_EXPERT = 2
TOKEN_BLOCK_O = 32
TOKEN_WARPS = 1  # per 4 slots: 16 slots on one warp exhaust its registers (sm_90)
TOKEN_STAGES = 3  # Triton's default on CUDA: loads of later groups in flight
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MMA_DTYPES = (torch.bfloat16, torch.float16)


# the oldest Triton the kernels are written for (tl.join, tl.dot's input_precision)
MIN_TRITON = (3, 2)
# the oldest whose batched (3-D) tl.dot in a loop compiles correctly (Triton's issue 5620,
# fixed by its pull request 5936): the 16-bit token kernel's; older ones run 16-bit
# decoding calls on the tile kernel (the same instruction per pair, so the same bits)
MIN_TRITON_BATCHED_DOT = (3, 3)


def _version():
    """Triton's (major, minor), None for a build without a plain version."""
    import triton

    try:
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except (AttributeError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def available():
    """Whether Triton MIN_TRITON or newer is installed (CUDA builds of torch bring it);
    imported only here, on the first call that could use it, never by ``import mxfp4x``."""
    if importlib.util.find_spec("triton") is None:
        return False
    version = _version()
    return version is None or version >= MIN_TRITON  # no plain version: try it


@functools.lru_cache(maxsize=None)
def batched_dot():
    """Whether the installed Triton compiles the 16-bit token kernel (see
    MIN_TRITON_BATCHED_DOT)."""
    version = _version()
    return version is None or version >= MIN_TRITON_BATCHED_DOT


def _bytes(t, device, dims):
    return (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.device == device
            and t.dim() in dims)


def qualifies(x, packed, scales, others=()):
    """Whether the kernels can read this call, the device type aside: uint8 weights on the
    latents' device, shaped as the op's contract says (stacked (E, O, G, 16) and scales
    (E, O, G), GGUF blocks (E, O, G, 17), or lists of E tensors of one shape, (O, G, w) or
    (O, G*w), and (O, G)), each group's bytes contiguous; ``others`` (ids, mixture
    weights, shared output) on the latents' device too.  Anything else takes the torch
    path, which checks and reports as it always has."""
    device, d_in = x.device, x.shape[-1]
    if d_in % 32 or any(t.device != device for t in others if t is not None):
        return False
    width, n_groups = (17 if scales is None else 16), d_in // 32
    if isinstance(packed, torch.Tensor):
        if not (_bytes(packed, device, (4,)) and tuple(packed.shape[2:]) == (n_groups, width)
                and packed.stride(-1) == 1):
            return False
        return scales is None or (_bytes(scales, device, (3,))
                                  and scales.shape == packed.shape[:3])
    if not isinstance(packed, (list, tuple)) or not packed:
        return False
    first = packed[0]
    if not _bytes(first, device, (2, 3)):
        return False
    rows = first.shape[0]
    shape = (rows, n_groups, width) if first.dim() == 3 else (rows, n_groups * width)
    if any(not _bytes(t, device, (first.dim(),)) or tuple(t.shape) != shape
           or t.stride(-1) != 1 for t in packed):
        return False
    return scales is None or (
        isinstance(scales, (list, tuple)) and len(scales) == len(packed)
        and all(_bytes(t, device, (2,)) and tuple(t.shape) == (rows, n_groups)
                for t in scales))


def usable(x, packed, scales, others=()):
    """Whether the kernels take this call: CUDA tensors, Triton importable, 16- or 32-bit
    latents, and ``qualifies``."""
    if x.device.type != "cuda" or x.dtype not in DTYPES or not available():
        return False
    return qualifies(x, packed, scales, others)


def check_ids(sel, n_experts):
    """Check the expert ids on the host (an IndexError naming the id: one host sync) and
    say True; while the current CUDA stream is being captured into a graph, where a sync
    cannot happen, check nothing and say False: the kernels then turn a bad id into NaN
    (see the module's docstring)."""
    if sel.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    check_expert_ids(sel, n_experts)
    return True


def _tiles(flat, n_experts, tile):
    """Pairs sorted by expert and cut into tiles of one expert each: (order, tile expert,
    tile start (into order), tile pair count), on the pairs' device without a host sync
    (no ``bincount``, whose size is read back); the tile count is the bound
    ceil(P / tile) + min(E, P), trailing tiles empty.  Ids outside [0, E) sort before
    and after every expert's pairs, in no tile."""
    n_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    bounds = torch.searchsorted(flat[order], torch.arange(n_experts + 1, device=flat.device,
                                                          dtype=flat.dtype))
    pair_begin = bounds[:-1]
    counts = bounds[1:] - pair_begin
    per_expert = (counts + tile - 1) // tile
    tile_end = torch.cumsum(per_expert, 0)
    n_tiles = -(-n_pairs // tile) + min(n_experts, n_pairs)
    ids = torch.arange(n_tiles, device=flat.device)
    expert = torch.searchsorted(tile_end, ids, right=True)
    real = expert < n_experts
    expert = expert.clamp(max=n_experts - 1)
    local = ids - (tile_end[expert] - per_expert[expert])
    start = pair_begin[expert] + local * tile
    count = torch.where(real, (counts[expert] - local * tile).clamp(0, tile), 0)
    return order, expert, start, count.to(torch.int32)


# device tables of expert lists, keyed by what they hold: (device, ((address, row stride,
# group stride), ...)) -> int64 tensor (a few bytes an expert), the least recently used
# dropped past _TABLES_KEPT.  A table used while a CUDA graph is captured is pinned, never
# dropped: the graph holds its address, not a reference.  A table is built on a list's
# first call, a host-to-device copy, which a capture cannot hold: warm-up calls build it.
_TABLES: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()
_PINNED: dict = {}
_TABLES_KEPT = 4096


def _table(rows, device):
    key = (str(device), rows)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    table = _PINNED.get(key)
    if table is None:
        table = _TABLES.get(key)
    if table is None:
        if capturing:
            raise RuntimeError(
                "packed_weights: a list of expert tensors is first seen while a CUDA graph "
                "is being captured; its device table is a host-to-device copy, which a "
                "capture cannot hold: call once with these tensors before capturing (a "
                "warm-up, as torch.cuda.graph and torch.compile's cudagraphs expect)")
        table = torch.tensor(rows, dtype=torch.int64).to(device)
    if capturing:
        _PINNED[key] = table
        _TABLES.pop(key, None)
    elif key not in _PINNED:
        _TABLES[key] = table
        _TABLES.move_to_end(key)
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table


def _weights(packed, scales, device):
    """(packed argument, scale argument, packed strides (expert, row, group), scale
    strides (expert, row, group), listed): stacked tensors as they are; a list as tables
    of (address, row stride, group stride) per tensor, each tensor with its own strides."""
    gguf = scales is None
    if isinstance(packed, torch.Tensor):
        p_strides = packed.stride()[:3]
        if gguf:
            return packed, packed, p_strides, (0, 0, 0), False
        return packed, scales, p_strides, scales.stride(), False
    width = 17 if gguf else 16
    table = _table(tuple((t.data_ptr(), t.stride(0), t.stride(1) if t.dim() == 3 else width)
                         for t in packed), device)
    if gguf:
        return table, table, (0, 0, 0), (0, 0, 0), True
    s_table = _table(tuple((t.data_ptr(), t.stride(0), t.stride(1)) for t in scales), device)
    return table, s_table, (0, 0, 0), (0, 0, 0), True


def token_warps(slots):
    """The token kernels' warps for a tile of ``slots`` slots (a power of two)."""
    return TOKEN_WARPS * max(1, slots // 4)


def _interpreted():
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): its tl.dot
    takes bf16 operands as their uint16 storage, so the kernels widen them first."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _token_path(n_pairs, n_experts, x):
    return n_pairs <= TOKEN_KERNEL_PAIRS_PER_EXPERT * n_experts and (
        x.dtype not in MMA_DTYPES or batched_dot())


def _rows(t):
    """A 2-D view whose last dimension is contiguous (the kernels' row stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


class _Call:
    """One call's operands as the kernels take them."""

    def __init__(self, x, packed, scales, sel):
        self.n_tokens, self.top_k = sel.shape
        self.n_experts = len(packed)
        self.d_out = d_out_of(packed) if self.n_experts or isinstance(packed, torch.Tensor) \
            else 0
        self.d_in = x.shape[-1]
        self.n_pairs = self.n_tokens * self.top_k
        self.per_slot = x.dim() == 3
        self.xs = _rows(x.reshape(self.n_pairs if self.per_slot else self.n_tokens,
                                  self.d_in))
        self.sel = sel.reshape(-1)
        if not self.sel.is_contiguous():
            self.sel = self.sel.contiguous()
        self.gguf = scales is None
        self.mma = x.dtype in MMA_DTYPES
        (self.w_arg, self.s_arg, self.p_strides, self.s_strides,
         self.listed) = _weights(packed, scales, x.device)
        self.n_groups = self.d_in // 32

    def empty(self):
        """No product to run: every one an empty sum (or no pair, no row)."""
        return 0 in (self.n_pairs, self.d_out, self.n_experts, self.d_in)

    def device(self):
        return torch.cuda.device(self.xs.device) if self.xs.is_cuda else \
            contextlib.nullcontext()

    def token_kernel(self, out, mix=None, shared=None):
        """The token kernel: ``out`` (T, O) = the combined rows (mix and shared given), or
        (T*K, O) the per-pair products, in out's dtype."""
        from . import triton_kernels as k

        combine = mix is not None
        mix = _rows(mix) if combine else out
        shared = _rows(shared) if combine else out
        grid = (self.n_tokens, -(-self.d_out // TOKEN_BLOCK_O))
        args = (self.xs, self.sel, mix, shared, out, self.w_arg, self.s_arg, self.n_experts,
                self.n_groups, self.d_out, self.top_k, self.xs.stride(0), mix.stride(0),
                shared.stride(0), *self.p_strides, *self.s_strides)
        launch = dict(PER_SLOT=self.per_slot, COMBINE=combine, GGUF=self.gguf,
                      LISTED=self.listed, BO=TOKEN_BLOCK_O, num_stages=TOKEN_STAGES,
                      enable_fp_fusion=False)
        slots = 1 << (self.top_k - 1).bit_length()  # a power of two, at least K
        launch["num_warps"] = token_warps(slots)
        with self.device():
            if self.mma:
                k.token_mma_kernel[grid](*args, WIDEN=_interpreted(), KP=slots, M=MMA_TILE,
                                         **launch)
            else:
                k.token_kernel[grid](*args, INTERPRETED=_interpreted(), KP=slots, **launch)
        return out

    def tile_kernel(self, out, poison):
        """The tile kernel: ``out`` (T*K, O) float32 = the per-pair products; ``poison``:
        NaN first, for the pairs of bad ids that no tile takes."""
        from . import triton_kernels as k

        if poison:
            out.fill_(float("nan"))
        tile = MMA_TILE if self.mma else TILE_TOKENS
        flat = self.sel.to(torch.int64)
        order, t_expert, t_start, t_count = _tiles(flat, self.n_experts, tile)
        x_rows = order if self.per_slot else order // self.top_k
        grid = (t_count.numel(), -(-self.d_out // BLOCK_O))
        with self.device():
            k.tile_kernel[grid](
                self.xs, x_rows, order, t_expert, t_start, t_count, self.w_arg, self.s_arg,
                out, self.n_groups, self.d_out, self.xs.stride(0), *self.p_strides,
                *self.s_strides, GGUF=self.gguf, LISTED=self.listed, MMA=self.mma,
                WIDEN=_interpreted(),
                TILE=tile, BO=BLOCK_O, enable_fp_fusion=True)
        return out


def pair_products(x, packed, scales, sel, checked=True):
    """(T*K, O) float32: W_{e_tk} x_t (x_tk for per-slot latents (T, K, I)) per pair
    p = t*K + k.  ``usable`` must hold; ``checked``: the expert ids were checked on the
    host (``check_ids``), else a bad id's row is NaN."""
    call = _Call(x, packed, scales, sel)
    out = torch.empty((call.n_pairs, call.d_out), dtype=torch.float32, device=x.device)
    if call.empty():  # no product: empty sums; unchecked ids outside [0, E): NaN
        out.zero_()
        if not checked and call.n_pairs:
            bad = (call.sel < 0) | (call.sel >= call.n_experts)
            out.masked_fill_(bad.view(-1, 1), float("nan"))
        return out
    if _token_path(call.n_pairs, call.n_experts, x):
        return call.token_kernel(out)
    return call.tile_kernel(out, poison=not checked)


# the per-pair products of at most this many bytes at once: longer calls run in chunks of
# tokens (a pair's bits do not depend on its chunk)
CHUNK_BYTES = 256 << 20


def _chunks(n_tokens, top_k, d_out):
    step = max(1, CHUNK_BYTES // max(1, top_k * d_out * 4))
    return [(t0, min(n_tokens, t0 + step)) for t0 in range(0, n_tokens, step)]


def experts(x, packed, scales, sel, mix, shared, out_dtype, checked=True):
    """shared + sum_k p_tk W x: one token-kernel launch for a decoding call; else the
    per-pair products combined as the torch path does (weighted per pair, then added to
    the shared output slot by slot in order)."""
    n_tokens, top_k = sel.shape
    d_out = d_out_of(packed)
    if n_tokens and top_k and d_out and len(packed) and x.shape[-1] and _token_path(
            n_tokens * top_k, len(packed), x):
        out = torch.empty((n_tokens, d_out), dtype=out_dtype, device=x.device)
        return _Call(x, packed, scales, sel).token_kernel(out, mix, shared)
    y = torch.empty((n_tokens, d_out), dtype=torch.float32, device=x.device)
    y.copy_(shared)
    for t0, t1 in _chunks(n_tokens, top_k, d_out):
        contrib = pair_products(x[t0:t1], packed, scales, sel[t0:t1], checked).view(
            t1 - t0, top_k, d_out)
        contrib *= mix[t0:t1].to(torch.float32).unsqueeze(2)
        for k in range(top_k):
            y[t0:t1] += contrib[:, k]
    return y.to(out_dtype)


def slots(x, packed, scales, sel, checked=True):
    """(T, K, O) in the latents' dtype: W_{e_tk} x per slot."""
    n_tokens, top_k = sel.shape
    d_out = d_out_of(packed)
    out = torch.empty((n_tokens, top_k, d_out), dtype=x.dtype, device=x.device)
    call = _Call(x, packed, scales, sel)
    if not call.empty() and _token_path(call.n_pairs, call.n_experts, x):
        call.token_kernel(out.view(call.n_pairs, d_out))  # rounded to x's dtype there
        return out
    for t0, t1 in _chunks(n_tokens, top_k, d_out):
        out[t0:t1] = pair_products(x[t0:t1], packed, scales, sel[t0:t1], checked).view(
            t1 - t0, top_k, d_out)
    return out
