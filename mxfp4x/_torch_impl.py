"""The device-agnostic PyTorch implementation (the GPU path; also runs on CPU).

Pairs are sorted by expert; each active expert is decoded once (only its
(d_out, d_in) matrix, never the whole expert tensor) in the compute dtype and
applied to its tokens with one matmul; the per-pair results are combined in
slot order k = 0..top_k-1, so the result does not depend on the device's
reduction order across experts.
"""
import torch

from ._format import E2M1_VALUES, GROUP, e8m0_table_f32

_TABLES = {}


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


def decode_expert(packed, scales, dtype=torch.float32):
    """(O, G, 16) uint8 bytes and (O, G) uint8 scales -> (O, 32 G) matrix of ``dtype``."""
    pairs, e8m0 = _tables(packed.device, dtype)
    d_out, n_groups = packed.shape[0], packed.shape[1]
    values = torch.nn.functional.embedding(packed.reshape(-1).int(), pairs)
    values = values.reshape(d_out, n_groups, GROUP)
    values.mul_(e8m0[scales.int()].unsqueeze(-1))
    return values.reshape(d_out, n_groups * GROUP)


def mxfp4_experts_torch(x, packed, scales, sel, mix, shared, out_dtype):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    n_tokens, top_k = sel.shape
    d_out = packed.shape[1]
    y = torch.empty((n_tokens, d_out), dtype=compute, device=x.device)
    y.copy_(shared)
    if n_tokens * top_k == 0 or d_out == 0:
        return y.to(out_dtype)
    xc = x.to(compute)
    w = mix.to(compute).reshape(-1)
    flat = sel.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    contrib = torch.empty((n_tokens * top_k, d_out), dtype=compute, device=x.device)
    d_in = x.shape[1]
    chunk_bytes = _CHUNK_BYTES.get(x.device.type, _DEFAULT_CHUNK_BYTES)
    chunk = max(1, chunk_bytes // max(1, d_in * xc.element_size()))
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        pairs = order[start:start + n]
        start += n
        xe, we = xc[pairs // top_k], w[pairs].unsqueeze(1)
        for r0 in range(0, d_out, chunk):
            r1 = min(d_out, r0 + chunk)
            weight = decode_expert(packed[e, r0:r1], scales[e, r0:r1], compute)
            contrib[pairs, r0:r1] = (xe @ weight.T) * we
    contrib = contrib.view(n_tokens, top_k, d_out)
    for k in range(top_k):
        y += contrib[:, k]
    return y.to(out_dtype)
