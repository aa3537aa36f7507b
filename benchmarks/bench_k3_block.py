"""A whole Kimi K3 MoE block (``KimiK3MoE``: router, latent projections, routed experts,
norm, shared experts) at its real sizes, read from a checkpoint written in the release's
layout, at a few tokens: the decode regime, where the block only streams its weights.

The layer has 128 experts instead of 896 (top-16 and every matrix shape unchanged: a token
reads the same bytes; the file is 2.3 GB instead of 15.7), bfloat16 tokens as the released
model runs, 1 and 2 threads.  Its read floor is every byte a call reads once -- the
distinct selected experts (w1, w3, w2, their scales) and every dense weight (router and
bias, down and up projections, norm, shared experts) -- over the read bandwidth measured
in this pytest run (``roofs``); the target is 1.5 x that floor at one token.

The peer is the same block with its dense products in torch (``F.linear``, mxfp4x's dense
kernels switched off: the exact one at 1-4 tokens, the bf16 unit's at 8 where the CPU has
one), timed interleaved with it call by call.  ``extra_info``: ``time_s``
(median), ``gbps``, ``read_floor_s``, ``vs_read_floor``, ``torch_dense_s`` and
``vs_torch_dense``, ``bytes`` (split into ``expert_bytes`` and ``dense_bytes``).  The first
call's output is checked against the float64 reference of the block (same routing).
"""
import os
import statistics
import tempfile

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x._core import dense as _dense
from mxfp4x.cli._families import MODELS
from mxfp4x.testing import bench as _bench
from mxfp4x.testing import kimi_k3 as _kimi_k3

SMALL = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
N_EXPERTS = 128
TARGET = 1.5  # x the block's read floor at one token
_BLOCK: dict = {}


def block():
    """(block, its folder's TemporaryDirectory), written and loaded once per session."""
    if not _BLOCK:
        family = MODELS["kimi-k3"]
        tmp = tempfile.TemporaryDirectory(prefix="mxfp4x-k3-")
        if SMALL:
            config = _kimi_k3.k3_config(num_experts=8, num_experts_per_token=2,
                                        hidden_size=96, routed_expert_hidden_size=64,
                                        moe_intermediate_size=64, num_shared_experts=1,
                                        num_hidden_layers=family.layer + 1)
            _kimi_k3.write_k3_checkpoint(tmp.name, config, [family.layer], seed=0, shards=1)
        else:
            family.write(tmp.name, N_EXPERTS)
        _BLOCK.update(block=family.load(tmp.name), tmp=tmp)
    return _BLOCK["block"]


def dense_bytes(b):
    return sum(p.numel() * p.element_size() for name, p in b.named_parameters()
               if not name.startswith("experts."))


def expert_bytes(b, selected):
    """Packed bytes and scales of the distinct experts the call selects (w1, w3, w2)."""
    ex = b.experts
    total = 0
    for e in torch.unique(selected).tolist():
        total += sum(t.numel() * t.element_size() for t in ex.get_submodule(str(e)).buffers())
    return total


def tokens(b, n_tokens, call):
    rng = np.random.default_rng(100 + call)
    hidden = b.down_proj.shape[1]
    return torch.from_numpy(rng.standard_normal((n_tokens, hidden))).bfloat16()


def check(b, x, y):
    sel, w = b.router(x)
    rows = slice(0, min(64, y.shape[1]))
    ref = _kimi_k3.kimi_k3_reference(b, x, sel, w, rows=rows)
    err = np.abs(y[:, rows].double().numpy() - ref).max()
    assert err <= 3e-2 * np.abs(ref).max(), (err, np.abs(ref).max())  # bfloat16's bound


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n_tokens", [1, 4, 8])
def test_k3_block(benchmark, roofs, n_tokens, threads):
    b = block()
    b.experts.num_threads = threads
    n_calls = 6
    calls = [tokens(b, n_tokens, i) for i in range(n_calls)]
    check(b, calls[0][:2], b(calls[0][:2]))

    def torch_dense(x):  # the peer: the dense products in torch, mxfp4x's kernels off
        old = _dense.MAX_TOKENS, _dense.UNIT_MAX_TOKENS
        _dense.MAX_TOKENS = _dense.UNIT_MAX_TOKENS = 0
        try:
            b(x)
        finally:
            _dense.MAX_TOKENS, _dense.UNIT_MAX_TOKENS = old

    run, times = _bench.alternating({"mxfp4x": b, "torch_dense": torch_dense}, calls)

    benchmark.group = f"kimi-k3-block T={n_tokens} bfloat16"
    rounds = 1 if SMALL else 12
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
    sel, _ = b.router(calls[0])
    n_expert = expert_bytes(b, sel)
    n_dense = dense_bytes(b)
    info = benchmark.extra_info
    info.update(shape="kimi-k3-block", tokens=n_tokens, dtype="bfloat16", threads=threads,
                isa=mxfp4x.backend_info()["isa"], expert_bytes=n_expert, dense_bytes=n_dense,
                bytes=n_expert + n_dense)
    if benchmark.stats is None:  # --benchmark-disable: the smoke run stops here
        return
    t = statistics.median(times["mxfp4x"][1:])
    tt = statistics.median(times["torch_dense"][1:])
    floor = (n_expert + n_dense) / (roofs["read_gbps"][threads] * 1e9)
    info.update(time_s=t, gbps=(n_expert + n_dense) / t / 1e9, read_floor_s=floor,
                vs_read_floor=t / floor, torch_dense_s=tt, vs_torch_dense=t / tt,
                target=f"<= {TARGET} x read floor" if n_tokens == 1 else None,
                met=(t / floor <= TARGET) if n_tokens == 1 else None)
    print(f"\nkimi-k3 block T={n_tokens} {threads} threads: {t * 1e3:.1f} ms "
          f"({(n_expert + n_dense) / t / 1e9:.1f} GB/s of {(n_expert + n_dense) / 1e9:.2f} GB: "
          f"experts {n_expert / 1e9:.2f}, dense {n_dense / 1e9:.2f}), read floor "
          f"{floor * 1e3:.1f} ms, x{t / floor:.2f}; dense in torch: {tt * 1e3:.1f} ms "
          f"(x{tt / floor:.2f})")
