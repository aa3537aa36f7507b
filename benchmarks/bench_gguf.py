"""GGUF-backed experts beside safetensors-backed ones: the same gpt-oss-20b gate/up
matrices (E=32, K=4, O=5760, I=2880) as llama.cpp's 17-byte block_mxfp4 blocks read in
place (``scale_bytes=None``) and in gpt-oss's arrangement (16 packed bytes and a separate
scale byte per group), T = 1 and T = 512, 2 threads.

The two forms are timed interleaved in one run (call after call, the order swapped every
round), so a noisy machine slows both alike; ``extra_info`` holds the median time and GB/s
of each form (``gguf_s``, ``gguf_gbps``, ``safetensors_s``, ``safetensors_gbps``; bytes:
the 17 bytes per group of the distinct selected experts, the same for both forms) and
``gguf_vs_safetensors`` = gguf_s / safetensors_s (target: within 5 %).  Both results are
checked once against the float64 reference.  Successive rounds route to other experts, so
weights come from memory, not cache.
"""
import os
import statistics

import pytest
import torch

import mxfp4x
from mxfp4x.testing import bench as _bench
from mxfp4x.testing.layers import assert_matches_reference, gguf_blocks_of

SMALL = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
SHAPE = "gpt-oss-20b-gate-up"
_FORMS: dict = {}


def forms():
    """(packed, scales, blocks, n_experts, top_k, d_out, d_in), made once per session."""
    if not _FORMS:
        n_experts, top_k, d_out, d_in = _bench.SHAPES[SHAPE]
        if SMALL:
            n_experts, d_out, d_in = 8, 96, 128
        packed, scales = _bench.make_experts(n_experts, d_out, d_in)
        blocks = torch.from_numpy(gguf_blocks_of(packed.numpy(), scales.numpy()))
        _FORMS.update(packed=packed, scales=scales, blocks=blocks,
                      sizes=(n_experts, top_k, d_out, d_in))
    return _FORMS


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("n_tokens", [1, 512])
def test_gguf_vs_safetensors(benchmark, n_tokens, threads):
    f = forms()
    n_experts, top_k, d_out, d_in = f["sizes"]
    weights = {"gguf": (f["blocks"], None), "safetensors": (f["packed"], f["scales"])}
    n_calls = 4
    calls = [_bench.make_tokens(n_tokens, top_k, n_experts, d_in, d_out, call=i)
             for i in range(n_calls)]
    x, sel, mix, shared = calls[0]
    rows = slice(0, min(d_out, 64))
    layer = dict(latent_tokens=x[:3], packed_weights=f["packed"], scale_bytes=f["scales"],
                 selected_experts=sel[:3], mixture_weights=mix[:3], shared_output=shared[:3])
    for packed, scales in weights.values():
        y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, num_threads=threads)
        assert_matches_reference(y[:3, rows], layer, rows=rows)

    # one call of each form on the same tokens, the order swapped every round
    run, times = _bench.alternating(
        {name: (lambda c, w=w: mxfp4x.mxfp4_experts(c[0], w[0], w[1], c[1], c[2], c[3],
                                                    num_threads=threads))
         for name, w in weights.items()}, calls)

    benchmark.group = f"{SHAPE} T={n_tokens} float32 gguf vs safetensors"
    rounds = 1 if SMALL else (40 if n_tokens <= 32 else 10)
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
    n_bytes = len(torch.unique(sel)) * d_out * (d_in // 32) * 17
    info = benchmark.extra_info
    info.update(shape=SHAPE, tokens=n_tokens, dtype="float32", threads=threads,
                isa=mxfp4x.backend_info()["isa"], bytes=n_bytes,
                flops=_bench.flops(n_tokens, top_k, d_out, d_in))
    if benchmark.stats is None:  # --benchmark-disable: the smoke run stops here
        return
    timed = {name: t[1:] for name, t in times.items()}  # (the warm-up round dropped)
    for name, t in timed.items():
        med = statistics.median(t)
        info[f"{name}_s"] = med
        info[f"{name}_gbps"] = n_bytes / med / 1e9
    info["gguf_vs_safetensors"] = info["gguf_s"] / info["safetensors_s"]
    print(f"\n{SHAPE} T={n_tokens} {threads} threads, medians of {len(timed['gguf'])}: "
          f"gguf {info['gguf_s'] * 1e3:.2f} ms ({info['gguf_gbps']:.2f} GB/s), "
          f"safetensors {info['safetensors_s'] * 1e3:.2f} ms "
          f"({info['safetensors_gbps']:.2f} GB/s), ratio {info['gguf_vs_safetensors']:.3f}")
