"""mxfp4_experts at model shapes: time, GB/s of weights streamed, GFLOP/s, and the
floors measured in the same run.

Each case reports in ``extra_info``:

* ``bytes`` B (packed bytes + scales of the distinct selected experts) and
  ``flops`` F = 2 T K O I;
* ``gbps`` = B / time and ``gflops`` = F / time;
* the floors, from the roofs measured once per session (``python -m mxfp4x
  roofline``): ``read_floor_s`` = B / read bandwidth, ``fma_floor_s`` = F / the FMA peak
  of the ISA in use, ``floor_s`` the larger; ``vs_read_floor``, ``vs_floor`` = time /
  floor and ``fma_share`` = fma_floor_s / time; ``read_floor_torch_s`` and
  ``vs_read_floor_torch``: the same against the read bandwidth of torch's memory (4 KiB
  pages where Linux gives huge pages only on request), where these weights sit;
* ``matmul_s``: ``torch.matmul`` of the same K products on already decoded
  weights of the latents' dtype, and ``vs_matmul`` = time / matmul_s (one matrix for
  all products: a compute roof);
* ``predecoded_s`` and ``vs_predecoded`` = time / predecoded_s: the same op as torch runs
  it on experts decoded ahead of time into the latents' dtype (a matmul per selected
  expert, ``index_add_`` back: ``_bench.Predecoded``), in the CPU rows of stacked
  experts, None where those experts would not fit in half the free memory;
* ``torch_backend_s`` is in the ``impl=torch`` rows (dequantize-then-matmul);
* ``target`` and ``met``: the case's performance target (``_bench.verdict``); the
  session ends with the table of every case and the cross-case targets (bfloat16 never
  slower than float32, 2 threads >= 1.8 x 1 thread at T = 512).

Every case checks its result once against the float64 reference (a slice of rows).
Successive rounds route to other experts, so weights come from memory, not cache.
"""
import os
import statistics
import time

import pytest
import torch

import mxfp4x
from mxfp4x.testing import bench as _bench
from mxfp4x.testing.layers import assert_matches_reference

# MXFP4X_BENCH_SMALL=1: tiny shapes, for a smoke run of these files in CI
# (`pytest benchmarks --benchmark-disable`); the figures then mean nothing.
SMALL = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
_EXPERTS = {}
_PREDECODED = {}


def experts(shape):
    """(packed, scales, n_experts, top_k, d_out, d_in), made once per session."""
    n_experts, top_k, d_out, d_in = _bench.SHAPES[shape]
    if SMALL:
        n_experts, d_out, d_in = min(n_experts, 8), 96, 128
        top_k = min(top_k, 4)
    if shape not in _EXPERTS:
        _EXPERTS.clear()  # one model-sized layer in memory at a time
        _EXPERTS[shape] = _bench.make_experts(n_experts, d_out, d_in)
    packed, scales = _EXPERTS[shape]
    return packed, scales, n_experts, top_k, d_out, d_in


def predecoded(shape, dtype):
    """The experts of ``shape`` decoded ahead of time into ``dtype``, kept for the pytest
    session while the shape stays (the cases of one T run every dtype in turn)."""
    if any(key[0] != shape for key in _PREDECODED):
        _PREDECODED.clear()
    if (shape, dtype) not in _PREDECODED:
        packed, scales = experts(shape)[:2]
        _PREDECODED[(shape, dtype)] = _bench.Predecoded(packed, scales, dtype)
    return _PREDECODED[(shape, dtype)]

SHAPES = ["gpt-oss-20b-gate-up", "gpt-oss-20b-down", "kimi-k3-w1", "kimi-k3-w2"]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def _case(benchmark, roofs, shape, n_tokens, dtype, threads, impl, form="stacked"):
    packed, scales, n_experts, top_k, d_out, d_in = experts(shape)
    if form == "list":  # one allocation per expert, as from a per-expert checkpoint
        packed = [packed[e].clone() for e in range(n_experts)]
        scales = [scales[e].clone() for e in range(n_experts)]
    n_calls = 4
    calls = [_bench.make_tokens(n_tokens, top_k, n_experts, d_in, d_out, dtype, call=i)
             for i in range(n_calls)]
    x, sel, mix, shared = calls[0]
    y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, backend=impl,
                             num_threads=threads)
    rows = slice(0, min(d_out, 64))
    layer = dict(latent_tokens=x[:3], packed_weights=experts(shape)[0],
                 scale_bytes=experts(shape)[1],
                 selected_experts=sel[:3], mixture_weights=mix[:3], shared_output=shared[:3])
    assert_matches_reference(y[:3, rows], layer, rows=rows)

    state = {"i": 0}

    def run():
        c = calls[state["i"] % n_calls]
        state["i"] += 1
        return mxfp4x.mxfp4_experts(c[0], packed, scales, c[1], c[2], c[3], backend=impl,
                                    num_threads=threads)

    rounds = 1 if SMALL else (8 if n_tokens <= 32 else 3)
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
    n_bytes = _bench.streamed_bytes(experts(shape)[0], experts(shape)[1], sel)
    n_flops = _bench.flops(n_tokens, top_k, d_out, d_in)
    info = benchmark.extra_info
    info.update(shape=shape, tokens=n_tokens, dtype=str(dtype).replace("torch.", ""),
                threads=threads, impl=impl, form=form, isa=mxfp4x.backend_info()["isa"],
                bytes=n_bytes, flops=n_flops)
    if benchmark.stats is None:  # --benchmark-disable: the smoke run stops here
        return
    t = benchmark.stats.stats.min
    isa = info["isa"]
    fl = _bench.floors(n_bytes, n_flops, roofs, threads, isa, info["dtype"])
    mm = _bench.matmul_roof(n_tokens, top_k, d_out, d_in, threads, dtype=dtype, repeats=2)
    target, met = _bench.verdict(n_tokens, info["dtype"], t, fl, mm, isa)
    pre = (_bench.predecoded_time(predecoded(shape, dtype), calls, threads)
           if impl == "cpu" and form == "stacked" else None)
    info.update(time_s=t, gbps=n_bytes / t / 1e9, gflops=n_flops / t / 1e9, **fl,
                vs_read_floor=t / fl["read_floor_s"], vs_floor=t / fl["floor_s"],
                vs_read_floor_torch=t / fl.get("read_floor_torch_s", float("nan")),
                fma_share=fl["fma_floor_s"] / t, matmul_s=mm, vs_matmul=t / mm,
                predecoded_s=pre, vs_predecoded=None if pre is None else t / pre,
                target=target, met=met)
    if impl == "cpu" and form == "stacked":
        benchmark_rows.append(dict(info))


benchmark_rows: list = []  # read by conftest.py's summary table


# float32 latents on 1 and 2 threads; bfloat16 latents (converted once per call, never
# slower than float32) on 2
_CPU_CASES = [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 2)]


@pytest.mark.parametrize("dtype,threads", _CPU_CASES, indirect=["threads"],
                         ids=[f"{str(d)[6:]}-{t}" for d, t in _CPU_CASES])
@pytest.mark.parametrize("n_tokens", TOKENS)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu(benchmark, roofs, shape, n_tokens, dtype, threads):
    benchmark.group = f"{shape} T={n_tokens} {str(dtype)[6:]}"
    _case(benchmark, roofs, shape, n_tokens, dtype, threads, "cpu")


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("n_tokens", [1, 512])
def test_torch_backend_baseline(benchmark, roofs, n_tokens, threads):
    """The dequantize-then-matmul path (our torch backend) on the same layer."""
    shape = "gpt-oss-20b-gate-up"
    benchmark.group = f"{shape} T={n_tokens} float32"
    _case(benchmark, roofs, shape, n_tokens, torch.float32, threads, "torch")


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("n_tokens", [1, 512])
def test_list_form(benchmark, roofs, n_tokens, threads):
    """Experts as E separate tensors (Kimi K3's checkpoint layout): compare with the
    stacked case of the same group (the target: within 5 %)."""
    shape = "gpt-oss-20b-gate-up"
    benchmark.group = f"{shape} T={n_tokens} float32"
    _case(benchmark, roofs, shape, n_tokens, torch.float32, threads, "cpu", form="list")


def _checked(calls, packed, scales, threads):
    """The first call's result, its first tokens checked against the float64 reference."""
    rows = slice(0, min(packed.shape[1], 64))
    x, sel, mix, shared = calls[0]
    layer = dict(latent_tokens=x[:3], packed_weights=packed, scale_bytes=scales,
                 selected_experts=sel[:3], mixture_weights=mix[:3], shared_output=shared[:3])
    y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, num_threads=threads)
    assert_matches_reference(y[:3, rows], layer, rows=rows)
    return y


def _beside(benchmark, info, packed, scales, calls, baseline, threads):
    """Times the calls (one per round, in turn) with a baseline call on the same experts in
    each round's untimed setup, so the two alternate; records ``info`` and the ISA in the
    benchmark's extra_info; returns the medians (time, baseline), or None where the
    benchmark was not timed."""
    benchmark.extra_info.update(info, threads=threads, isa=mxfp4x.backend_info()["isa"])
    state = {"i": 0}
    baseline_times: list = []

    def baseline_call():  # pedantic's setup, untimed
        b = baseline[state["i"] % len(baseline)]
        t0 = time.perf_counter()
        mxfp4x.mxfp4_experts(b[0], packed, scales, *b[1:], num_threads=threads)
        baseline_times.append(time.perf_counter() - t0)

    def run():
        c = calls[state["i"] % len(calls)]
        state["i"] += 1
        return mxfp4x.mxfp4_experts(c[0], packed, scales, *c[1:], num_threads=threads)

    benchmark.pedantic(run, setup=baseline_call, rounds=1 if SMALL else 12, iterations=1,
                       warmup_rounds=1)
    if benchmark.stats is None:
        return None
    return (statistics.median(benchmark.stats.stats.data),
            statistics.median(baseline_times[1:] or baseline_times))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n_tokens", [1, 64])
def test_bf16_small_latents(benchmark, n_tokens, threads):
    """bfloat16 tokens each holding a few latents under 2^-60 in magnitude (what a SwiGLU
    leaves where a gate is far negative) on gpt-oss-20b's down projection.  A bf16
    dot-product unit would flush their products, so such a token leaves the unit for the
    unit's arithmetic in float32 FMAs.  ``extra_info``: ``time_s`` beside ``unit_s``, the
    same calls with those latents zeroed (every token on the unit), timed interleaved with
    them; the target: ``vs_unit`` <= 2.2 (an FMA takes one product per lane where the
    unit's instruction takes two, at the same issue rate on an AMD Zen 4: 2x is the floor
    where the products dominate)."""
    shape = "gpt-oss-20b-down"
    benchmark.group = f"{shape} T={n_tokens} bfloat16, small latents"
    packed, scales, n_experts, top_k, d_out, d_in = experts(shape)
    calls, plain = [], []
    for i in range(4):
        x, sel, mix, shared = _bench.make_tokens(n_tokens, top_k, n_experts, d_in, d_out,
                                                 torch.bfloat16, call=i)
        small = x.clone()
        small[:, 5::613] = 1e-20  # under 2^-60, nonzero: a few per token
        calls.append((small, sel, mix, shared))
        x = x.clone()
        x[:, 5::613] = 0
        plain.append((x, sel, mix, shared))
    _checked(calls, packed, scales, threads)
    timed = _beside(benchmark, dict(shape=shape, tokens=n_tokens, dtype="bfloat16"), packed,
                    scales, calls, plain, threads)
    if timed is None:
        return
    t, unit = timed
    benchmark.extra_info.update(time_s=t, unit_s=unit, vs_unit=t / unit, target="<= 2.2 x unit",
                                met=t / unit <= 2.2)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("n_tokens", [1, 64])
def test_float64_latents(benchmark, n_tokens, threads):
    """float64 latents (numpy's default dtype) on gpt-oss-20b gate/up: float64 products and
    sums, the same bits on every ISA.  ``extra_info``: ``time_s`` beside ``float32_s``, the
    same tokens as float32, timed interleaved with them; the target: ``vs_float32`` <= 5
    (a float64 lane holds half a float32 one, its multiply and add are not fused, and its
    decoded panel is twice the bytes: 4x is what the arithmetic alone gives)."""
    shape = "gpt-oss-20b-gate-up"
    benchmark.group = f"{shape} T={n_tokens} float64"
    packed, scales, n_experts, top_k, d_out, d_in = experts(shape)
    calls = [_bench.make_tokens(n_tokens, top_k, n_experts, d_in, d_out, torch.float64,
                                call=i) for i in range(4)]
    singles = [tuple(v.float() if v.is_floating_point() else v for v in c) for c in calls]
    assert _checked(calls, packed, scales, threads).dtype == torch.float64
    timed = _beside(benchmark, dict(shape=shape, tokens=n_tokens, dtype="float64"), packed,
                    scales, calls, singles, threads)
    if timed is None:
        return
    t, single = timed
    benchmark.extra_info.update(time_s=t, float32_s=single, vs_float32=t / single,
                                target="<= 5 x float32", met=t / single <= 5)
