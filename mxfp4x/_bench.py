"""Shared by ``python -m mxfp4x bench`` and ``benchmarks/``: model-like layers,
the memory-read floor and a torch matmul roof measured in the same process."""
import time

import numpy as np
import torch

from ._format import GROUP, GROUP_BYTES

SHAPES = {  # name: (n_experts, top_k, d_out, d_in)
    "gpt-oss-20b-gate-up": (32, 4, 5760, 2880),
    "gpt-oss-20b-down": (32, 4, 2880, 2880),
    "kimi-like": (384, 8, 4096, 7168),
}


def make_experts(n_experts, d_out, d_in, seed=0):
    """Random MXFP4 experts: every byte value, scales near 2^-4 (trained-weight range)."""
    rng = np.random.default_rng(seed)
    n_groups = d_in // GROUP
    packed = torch.from_numpy(rng.integers(0, 256, (n_experts, d_out, n_groups, GROUP_BYTES),
                                           dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(119, 125, (n_experts, d_out, n_groups),
                                           dtype=np.uint8))
    return packed, scales


def make_tokens(n_tokens, top_k, n_experts, d_in, d_out, dtype=torch.float32, seed=1,
                call=0):
    """Latents and a routing that, call after call, rotates over all experts (so
    repeated calls stream weights from memory, not from cache)."""
    g = torch.Generator().manual_seed(seed + call)
    x = torch.randn(n_tokens, d_in, generator=g).to(dtype)
    if n_tokens * top_k <= n_experts:
        base = (call * n_tokens * top_k) % n_experts
        sel = (base + torch.arange(n_tokens * top_k)) % n_experts
        sel = sel.reshape(n_tokens, top_k)
    else:
        sel = torch.stack([torch.randperm(n_experts, generator=g)[:top_k]
                           for _ in range(n_tokens)])
    mix = torch.rand(n_tokens, top_k, generator=g).to(dtype)
    shared = torch.randn(n_tokens, d_out, generator=g).to(dtype)
    return x, sel, mix, shared


def streamed_bytes(packed, scales, sel):
    """B: packed bytes + scale bytes of the distinct selected experts."""
    n = len(torch.unique(sel))
    return n * (packed[0].numel() + scales[0].numel())


def flops(n_tokens, top_k, d_out, d_in):
    return 2.0 * n_tokens * top_k * d_out * d_in


def best_time(fn, repeats=5, min_time=0.0):
    """Smallest wall time of ``repeats`` calls (fn gets the call index)."""
    best = float("inf")
    total = 0.0
    i = 0
    while i < repeats or total < min_time:
        t0 = time.perf_counter()
        fn(i)
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        i += 1
    return best


def read_floor(n_bytes, threads, repeats=5):
    """Seconds to read n_bytes once from memory with ``threads`` threads (a sum over
    a buffer rotated through > 256 MiB so it comes from DRAM, not cache)."""
    n_bufs = max(2, -(-256 * 2**20 // max(n_bytes, 1)))
    n_bufs = min(n_bufs, 64)
    bufs = [torch.ones(max(n_bytes // 4, 1), dtype=torch.float32) for _ in range(n_bufs)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return best_time(lambda i: bufs[i % n_bufs].sum(), repeats=max(repeats, n_bufs))
    finally:
        torch.set_num_threads(old)


def matmul_roof(n_tokens, top_k, d_out, d_in, threads, dtype=torch.float32, repeats=3):
    """Seconds of torch.matmul for the same per-expert products on already decoded
    weights (top_k products of (n_tokens, d_in) x (d_in, d_out))."""
    w = torch.randn(d_out, d_in).to(dtype)
    x = torch.randn(n_tokens, d_in).to(dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def run(_):
            for _k in range(top_k):
                x @ w.T
        run(0)
        return best_time(run, repeats=repeats)
    finally:
        torch.set_num_threads(old)
