"""The device-agnostic PyTorch implementation (the GPU path; also runs on CPU).

Pairs are sorted by expert; each active expert is decoded once (only its
(d_out, d_in) matrix, never the whole expert tensor) in the compute dtype and
applied to its tokens with one matmul; the per-pair results are combined in
slot order k = 0..top_k-1, so the result does not depend on the device's
reduction order across experts.
"""
import functools

import numpy as np
import torch

from . import cpu as _cpu
from .format import (
    E2M1_VALUES,
    GGUF_BLOCK_BYTES,
    GROUP,
    GROUP_BYTES,
    accumulation_dtype,
    e8m0_table_f32,
    e8m0_to_float64,
)
from .validation import check_expert_ids


def exact_on_cpu(fn):
    """Run ``fn`` (its first argument a tensor) with the calling thread's flush-to-zero,
    denormals-are-zero and rounding mode cleared when that tensor is on the CPU, then
    restored (_cpu.fpenv_enter / fpenv_exit, as the compiled kernels do): a caller's
    ``torch.set_flush_denormal(True)`` would otherwise flush the 2^-127 scale and
    subnormal latents to zero here.  Skipped while torch.compile traces (a C call is a
    graph break)."""
    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        if first.device.type != "cpu" or torch.compiler.is_compiling():
            return fn(first, *args, **kwargs)
        saved = _cpu.fpenv_enter()
        try:
            return fn(first, *args, **kwargs)
        finally:
            _cpu.fpenv_exit(saved)
    return run


_TABLES: dict = {}


# bytes of decoded weights per chunk: cache-sized on CPU, a whole expert on GPUs
_CHUNK_BYTES = {"cpu": 4 << 20}
_DEFAULT_CHUNK_BYTES = 1 << 30


def _tables(device, dtype):
    key = (str(device), dtype)
    if key not in _TABLES:
        e2m1 = torch.tensor(E2M1_VALUES, dtype=dtype)
        # byte b -> (value of its low nibble, value of its high nibble): elements 2j, 2j+1
        pairs = torch.stack((e2m1.repeat(16), e2m1.repeat_interleave(16)), dim=1)
        # float32 table is bit-exact (2^-127 is a subnormal), float64 widens it exactly
        e8m0 = torch.from_numpy(e8m0_table_f32()).to(dtype)
        _TABLES[key] = (pairs.to(device), e8m0.to(device))
    return _TABLES[key]


def _scaled_pairs(device):
    """(65536, 2) float32: row s * 256 + b holds the values of byte b's low and high
    nibble times 2^(s - 127), every one exact (subnormal for scale bytes 0-2, infinite
    past float32's range, NaN for s = 255), computed once with flush-to-zero cleared.
    Decoding by looking these up copies bits and computes nothing, so no thread's flush
    mode can change a weight (the table is 512 KiB: it stays in cache)."""
    key = ("scaled pairs", str(device))
    if key not in _TABLES:
        saved = _cpu.fpenv_enter()
        try:
            e2m1 = np.array(E2M1_VALUES)
            pairs = np.stack((np.tile(e2m1, 16), np.repeat(e2m1, 16)), axis=1)  # byte b
            with np.errstate(over="ignore", invalid="ignore"):
                v = (e8m0_to_float64(np.arange(256))[:, None, None] * pairs[None]).astype(
                    np.float32)
        finally:
            _cpu.fpenv_exit(saved)
        _TABLES[key] = torch.from_numpy(v.reshape(65536, 2)).to(device)
    return _TABLES[key]


def decode_expert(packed, scales, dtype=torch.float32):
    """(O, G, 16) (or (O, G*16)) uint8 bytes and (O, G) uint8 scales -> (O, 32 G) matrix
    of ``dtype``.  ``scales`` None: ``packed`` holds GGUF block_mxfp4 blocks, (O, G, 17)
    or (O, G*17): each the scale byte, then 16 bytes whose byte j holds elements j (low
    nibble) and j+16 (high nibble)."""
    if dtype == torch.float32:
        return _decode_f32(packed, scales)
    pairs, e8m0 = _tables(packed.device, dtype)
    if scales is None:
        d_out = packed.shape[0]
        n_groups = packed.shape[1] if packed.dim() == 3 else packed.shape[1] // GGUF_BLOCK_BYTES
        blocks = packed.reshape(d_out, n_groups, GGUF_BLOCK_BYTES)
        scales = blocks[..., 0]
        # (byte j's low nibble, its high nibble) -> elements j and j + 16
        values = torch.nn.functional.embedding(blocks[..., 1:].reshape(-1).int(), pairs)
        values = values.reshape(d_out, n_groups, GROUP_BYTES, 2).transpose(2, 3)
        values = values.reshape(d_out, n_groups, GROUP)
    else:
        d_out, n_groups = scales.shape[0], scales.shape[1]
        values = torch.nn.functional.embedding(packed.reshape(-1).int(), pairs)
        values = values.reshape(d_out, n_groups, GROUP)
    values.mul_(e8m0[scales.int()].unsqueeze(-1))
    return values.reshape(d_out, n_groups * GROUP)


def _decode_f32(packed, scales):
    """decode_expert for float32: each byte looked up with its scale byte in
    _scaled_pairs (the same bits as the products, whatever the flush mode)."""
    d_out = packed.shape[0]
    if scales is None:  # GGUF blocks: byte j holds elements j (low) and j + 16 (high)
        n_groups = packed.shape[1] if packed.dim() == 3 else packed.shape[1] // GGUF_BLOCK_BYTES
        blocks = packed.reshape(d_out, n_groups, GGUF_BLOCK_BYTES)
        index = blocks[..., :1].int() * 256 + blocks[..., 1:].int()
        values = torch.nn.functional.embedding(index, _scaled_pairs(packed.device))
        values = values.transpose(2, 3)
    else:  # byte j holds elements 2j (low) and 2j + 1 (high)
        n_groups = scales.shape[1]
        index = scales.int().unsqueeze(-1) * 256 + \
            packed.reshape(d_out, n_groups, GROUP_BYTES).int()
        values = torch.nn.functional.embedding(index, _scaled_pairs(packed.device))
    return values.reshape(d_out, n_groups * GROUP)


def _decode_rows(packed, scales, e, r0, r1, dtype):
    """Rows [r0, r1) of expert e (stacked or listed; scales None: GGUF blocks)."""
    return decode_expert(packed[e][r0:r1], None if scales is None else scales[e][r0:r1], dtype)


def d_out_of(packed):
    """Rows per expert of stacked (E, O, G, 16) bytes or of a list of (O, G, 16) tensors
    (both index as packed[e][rows])."""
    return packed.shape[1] if isinstance(packed, torch.Tensor) else packed[0].shape[0]


def _by_expert(sel):
    """Yield (expert id, pair indices) for each active expert, pairs p = t * K + k."""
    flat = sel.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist(), strict=False):
        yield e, order[start:start + n]
        start += n


def _row_chunks(device, d_in, itemsize, d_out):
    chunk_bytes = _CHUNK_BYTES.get(device.type, _DEFAULT_CHUNK_BYTES)
    chunk = max(1, chunk_bytes // max(1, d_in * itemsize))
    return [(r0, min(d_out, r0 + chunk)) for r0 in range(0, d_out, chunk)]


def _connected(out, *inputs):
    """``out``, made to depend on ``inputs`` for autograd when no product was computed (an
    empty or product-free result): their gradients are then zeros, as on the CPU path,
    instead of an error that the result needs no gradient."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        for t in inputs:  # the sum of no elements: exactly 0, whatever t holds (inf, NaN)
            out = out + t.reshape(-1)[:0].sum().to(out.dtype)
    return out


@exact_on_cpu
def slots_torch(x, packed, scales, sel):
    """(T, K, O): W_{e_tk} x_t (x_tk for per-slot latents) per slot, no weights, no sum."""
    check_expert_ids(sel, len(packed))
    compute = accumulation_dtype(x.dtype)
    slot_inputs = x.dim() == 3
    n_tokens, top_k = sel.shape
    d_out = d_out_of(packed)
    xc = x.to(compute).reshape(n_tokens * (top_k if slot_inputs else 1), x.shape[-1])
    out = torch.zeros((n_tokens * top_k, d_out), dtype=compute, device=x.device)
    chunks = _row_chunks(x.device, x.shape[-1], xc.element_size(), d_out)
    for e, pairs in _by_expert(sel):
        xe = xc[pairs if slot_inputs else pairs // top_k]
        for r0, r1 in chunks:
            weight = _decode_rows(packed, scales, e, r0, r1, compute)
            out[pairs, r0:r1] = xe @ weight.T
    if out.numel() == 0:  # no product computed: the (empty) result still depends on x
        out = _connected(out, x)
    return out.view(n_tokens, top_k, d_out).to(x.dtype)


@exact_on_cpu
def grad_latents_torch(grad, packed, scales, sel, mix, x):
    """dx = sum_k p_tk W^T grad_t, shaped and typed like x.  Per-slot latents (T, K, I)
    get per-slot gradients; a per-slot grad (T, K, O) (of the slots op) has weight 1 (mix
    is not read)."""
    check_expert_ids(sel, len(packed))
    compute = accumulation_dtype(x.dtype)
    n_tokens, top_k = sel.shape
    d_in = x.shape[-1]
    slot_inputs, slot_outputs = x.dim() == 3, grad.dim() == 3
    g = grad.to(compute).reshape(n_tokens * (top_k if slot_outputs else 1), grad.shape[-1])
    per_pair = torch.zeros((n_tokens * top_k, d_in), dtype=compute, device=x.device)
    chunks = _row_chunks(x.device, d_in, g.element_size(), d_out_of(packed))
    for e, pairs in _by_expert(sel):
        if slot_outputs:
            ge = g[pairs]
        else:
            ge = g[pairs // top_k] * mix.to(compute).reshape(-1)[pairs].unsqueeze(1)
        for r0, r1 in chunks:
            weight = _decode_rows(packed, scales, e, r0, r1, compute)
            per_pair[pairs] += ge[:, r0:r1] @ weight
    per_pair = per_pair.view(n_tokens, top_k, d_in)
    if slot_inputs:
        return per_pair.to(x.dtype)
    dx = torch.zeros((n_tokens, d_in), dtype=compute, device=x.device)
    for k in range(top_k):
        dx += per_pair[:, k]
    return dx.to(x.dtype)


@exact_on_cpu
def mxfp4_experts_torch(x, packed, scales, sel, mix, shared, out_dtype):
    """shared + sum_k p W x; x is (T, I), or (T, K, I) with one input row per slot."""
    check_expert_ids(sel, len(packed))
    compute = accumulation_dtype(x.dtype)
    slot_inputs = x.dim() == 3
    n_tokens, top_k = sel.shape
    d_out = d_out_of(packed)
    y = torch.empty((n_tokens, d_out), dtype=compute, device=x.device)
    y.copy_(shared)
    if n_tokens * top_k == 0 or d_out == 0:
        return _connected(y, x, mix).to(out_dtype)
    xc = x.to(compute).reshape(n_tokens * (top_k if slot_inputs else 1), x.shape[-1])
    w = mix.to(compute).reshape(-1)
    contrib = torch.empty((n_tokens * top_k, d_out), dtype=compute, device=x.device)
    chunks = _row_chunks(x.device, x.shape[-1], xc.element_size(), d_out)
    for e, pairs in _by_expert(sel):
        xe, we = xc[pairs if slot_inputs else pairs // top_k], w[pairs].unsqueeze(1)
        for r0, r1 in chunks:
            weight = _decode_rows(packed, scales, e, r0, r1, compute)
            contrib[pairs, r0:r1] = (xe @ weight.T) * we
    contrib = contrib.view(n_tokens, top_k, d_out)
    for k in range(top_k):
        y += contrib[:, k]
    return y.to(out_dtype)
