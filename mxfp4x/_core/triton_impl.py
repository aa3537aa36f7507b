"""The GPU kernel (Triton): routed MXFP4 experts decoded in registers, never in memory.

The (token, slot) pairs are sorted by expert and cut into tiles of up to ``TILE_TOKENS``
pairs of one expert.  A program takes one tile and ``BLOCK_O`` output rows: for each
group of 32 inputs it loads its rows' 16 packed bytes and scale byte once, decodes them
to float32 (the E2M1 nibble's magnitude bits placed in a float32's exponent and
mantissa give its value times 2^-126, exactly; times 2^126, then times the group's
2^(s - 127) built from the scale byte's bits, both exact: no table), and multiplies them
into its tile's latents with ``tl.dot`` in IEEE float32 (multiply-adds on the CUDA
cores, never TF32).  The result is the per-pair products W_e x (float32); the facade's
weighting and the sum over slots in order k = 0..K-1 follow in torch, as on the torch
path.

A pair's output row is the same chain of float32 multiply-adds over its inputs in order
whatever else its tile holds (the tile is padded with zero rows), so a token's bits do
not depend on its batch.  Calls of few pairs per expert take a second kernel, one pair
per program, that runs the same chain one ``fma`` at a time.  Experts given as a list
of tensors are read through a table of (address, row stride, group stride) per expert
(the same bits as stacked).  Float64 latents, weights whose bytes are not contiguous
within a group, lists of tensors of different shapes, and anything ``qualifies`` refuses
take the torch path.
"""
import contextlib
import functools
import importlib.util

import torch

from .torch_impl import d_out_of

TILE_TOKENS = 16  # pairs per tile: tl.dot needs 16 rows; fewer are padded with zeros
BLOCK_O = 128  # output rows per tile program; a step is one group (32 inputs)
# calls with at most this many pairs per expert (on average) take the pair kernel: one
# pair per program, the same multiply-adds in the same order (so the same bits)
PAIR_KERNEL_PAIRS_PER_EXPERT = 2
PAIR_BLOCK_O = 32
PAIR_WARPS = 1
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# the oldest Triton the kernels are written for (tl.join, tl.dot's input_precision)
MIN_TRITON = (3, 2)


@functools.lru_cache(maxsize=None)
def available():
    """Whether Triton MIN_TRITON or newer is installed (CUDA builds of torch bring it);
    imported only here, on the first call that could use it, never by ``import mxfp4x``."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    try:
        version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    except (AttributeError, ValueError):  # a build without a plain version: try it
        return True
    return version >= MIN_TRITON


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


def _tiles(flat, n_experts, tile):
    """Pairs sorted by expert and cut into tiles of one expert each: (order, tile expert,
    tile start (into order), tile pair count), on the pairs' device without a host sync;
    the tile count is the bound ceil(P / tile) + min(E, P), trailing tiles empty."""
    n_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    per_expert = (counts + tile - 1) // tile
    tile_end = torch.cumsum(per_expert, 0)
    pair_begin = torch.cumsum(counts, 0) - counts
    n_tiles = -(-n_pairs // tile) + min(n_experts, n_pairs)
    ids = torch.arange(n_tiles, device=flat.device)
    expert = torch.searchsorted(tile_end, ids, right=True)
    real = expert < n_experts
    expert = expert.clamp(max=n_experts - 1)
    local = ids - (tile_end[expert] - per_expert[expert])
    start = pair_begin[expert] + local * tile
    count = torch.where(real, (counts[expert] - local * tile).clamp(0, tile), 0)
    return order, expert, start, count.to(torch.int32)


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
    table = torch.tensor([(t.data_ptr(), t.stride(0), t.stride(1) if t.dim() == 3 else width)
                          for t in packed], dtype=torch.int64).to(device)
    if gguf:
        return table, table, (0, 0, 0), (0, 0, 0), True
    s_table = torch.tensor([(t.data_ptr(), t.stride(0), t.stride(1)) for t in scales],
                           dtype=torch.int64).to(device)
    return table, s_table, (0, 0, 0), (0, 0, 0), True


def pair_products(x, packed, scales, sel):
    """(T*K, O) float32: W_{e_tk} x_t (x_tk for per-slot latents (T, K, I)) per pair
    p = t*K + k.  ``usable`` must hold; expert ids already checked."""
    n_tokens, top_k = sel.shape
    n_experts = len(packed)
    d_out = d_out_of(packed) if n_experts or isinstance(packed, torch.Tensor) else 0
    d_in = x.shape[-1]
    n_pairs = n_tokens * top_k
    out = torch.empty((n_pairs, d_out), dtype=torch.float32, device=x.device)
    if n_pairs == 0 or d_out == 0 or n_experts == 0 or d_in == 0:
        return out.zero_()  # no product: empty sums
    xs = x.reshape(n_pairs if x.dim() == 3 else n_tokens, d_in)
    if xs.stride(-1) != 1:
        xs = xs.contiguous()
    flat = sel.reshape(-1).to(torch.int64)
    from . import triton_kernels as k

    gguf = scales is None
    w_arg, s_arg, p_strides, s_strides, listed = _weights(packed, scales, x.device)
    n_groups = d_in // 32
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _launch(k, xs, flat, out, w_arg, s_arg, p_strides, s_strides, n_groups, d_out,
                top_k, x.dim() == 3, gguf, listed, n_experts)
    return out


def _launch(k, xs, flat, out, w_arg, s_arg, p_strides, s_strides, n_groups, d_out, top_k,
            per_slot, gguf, listed, n_experts):
    """One of the two kernels over every pair (on the current device: the caller's)."""
    n_pairs = flat.numel()
    if n_pairs <= PAIR_KERNEL_PAIRS_PER_EXPERT * n_experts:
        grid = (n_pairs, -(-d_out // PAIR_BLOCK_O))
        k.pair_kernel[grid](xs, flat, out, w_arg, s_arg, n_groups, d_out, top_k, xs.stride(0),
                            *p_strides, *s_strides, PER_SLOT=per_slot, GGUF=gguf,
                            LISTED=listed, BO=PAIR_BLOCK_O, num_warps=PAIR_WARPS)
        return
    order, t_expert, t_start, t_count = _tiles(flat, n_experts, TILE_TOKENS)
    x_rows = order if per_slot else order // top_k
    grid = (t_count.numel(), -(-d_out // BLOCK_O))
    k.tile_kernel[grid](xs, x_rows, order, t_expert, t_start, t_count, w_arg, s_arg, out,
                        n_groups, d_out, xs.stride(0), *p_strides, *s_strides, GGUF=gguf,
                        LISTED=listed, TILE=TILE_TOKENS, BO=BLOCK_O)


# the per-pair products of at most this many bytes at once: longer calls run in chunks of
# tokens (a pair's bits do not depend on its chunk)
CHUNK_BYTES = 256 << 20


def _chunks(n_tokens, top_k, d_out):
    step = max(1, CHUNK_BYTES // max(1, top_k * d_out * 4))
    return [(t0, min(n_tokens, t0 + step)) for t0 in range(0, n_tokens, step)]


def experts(x, packed, scales, sel, mix, shared, out_dtype):
    """shared + sum_k p_tk W x, combined as the torch path does (weighted per pair, then
    added to the shared output slot by slot in order)."""
    n_tokens, top_k = sel.shape
    d_out = d_out_of(packed)
    y = torch.empty((n_tokens, d_out), dtype=torch.float32, device=x.device)
    y.copy_(shared)
    for t0, t1 in _chunks(n_tokens, top_k, d_out):
        contrib = pair_products(x[t0:t1], packed, scales, sel[t0:t1]).view(t1 - t0, top_k,
                                                                            d_out)
        contrib *= mix[t0:t1].to(torch.float32).unsqueeze(2)
        for k in range(top_k):
            y[t0:t1] += contrib[:, k]
    return y.to(out_dtype)


def slots(x, packed, scales, sel):
    """(T, K, O) in the latents' dtype: W_{e_tk} x per slot."""
    n_tokens, top_k = sel.shape
    d_out = d_out_of(packed)
    out = torch.empty((n_tokens, top_k, d_out), dtype=x.dtype, device=x.device)
    for t0, t1 in _chunks(n_tokens, top_k, d_out):
        out[t0:t1] = pair_products(x[t0:t1], packed, scales, sel[t0:t1]).view(
            t1 - t0, top_k, d_out)
    return out
