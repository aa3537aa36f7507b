"""KTransformers' kt-kernel as a peer: the whole gpt-oss-20b expert MLP (E=32, top-4,
hidden 2880, intermediate 2880) on the same MXFP4 weights, T = 1 and T = 512, 2 threads.
Skipped when kt-kernel is not installed (``pip install --no-deps kt-kernel``).

The MLP is gpt-oss's without its biases, which kt-kernel's MXFP4 MoE does not take:
gate and up projections, ``a = (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)`` with
``g = min(gate, 7)``, the down projection, combined with the routing weights.  kt-kernel
applies exactly this activation when given ``swiglu_limit=7`` and ``swiglu_alpha=1.702``.
Both sides take bfloat16 tokens and return bfloat16, as kt-kernel does.

* kt-kernel: its native MXFP4 MoE (``AMXFP4_KGroup_MOE``, AVX-512 where the CPU has no
  AMX, or ``AVX2MXFP4_MOE``) on one worker pool of ``threads`` threads on NUMA node 0.  It
  takes gate, up and down as separate per-expert (O, I/2) byte matrices in our nibble
  order and the scales as bfloat16 values (the E8M0 byte shifted into bfloat16's exponent:
  exact); it copies them into its own layout when it loads them.
* mxfp4x: ``mxfp4_experts_slots`` on gate/up (one (E, 2I, G, 16) tensor, rows 2j gate and
  2j+1 up, as gpt-oss stores them), the activation in float32, then ``mxfp4_experts`` on
  down with the routing weights (what ``mxfp4x.models.gpt_oss.gpt_oss_experts`` does).

The two are timed interleaved in one run (call after call, the order swapped every round).
kt-kernel's workers are pinned to cores and keep spinning for tens of milliseconds after a
call, and its dispatcher busy-waits during one, so on a 2-core machine it competes with
itself: read its figures with that in mind.  So that neither side starts on cores the other
is still spinning on, every call is followed by a wait until the process is idle.
``extra_info`` holds each side's median time (``kt_s``, ``mxfp4x_s``), ``kt_vs_mxfp4x`` =
kt_s / mxfp4x_s, and each side's error against a float64 reference of the same MLP on the
first tokens (``kt_err``, ``mxfp4x_err``: max |result - reference| / max |reference|).
"""
import os
import resource
import statistics
import time

import pytest
import torch

kt_kernel = pytest.importorskip("kt_kernel")

import mxfp4x  # noqa: E402
from mxfp4x.models.gpt_oss import GPT_OSS_20B  # noqa: E402
from mxfp4x.testing import bench as _bench  # noqa: E402

SMALL = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
SHAPE = "gpt-oss-20b-mlp"
LIMIT, ALPHA = GPT_OSS_20B["swiglu_limit"], 1.702
MAX_TOKENS = 512
KT_NOTE = ("kt-kernel's workers pin to cores and its dispatcher busy-waits: on 2 cores it "
           "is disadvantaged")
_LAYER: dict = {}


def sizes():
    """(n_experts, top_k, hidden, intermediate)."""
    g = GPT_OSS_20B
    if SMALL:
        return 8, 4, 128, 96
    return (g["num_local_experts"], g["num_experts_per_tok"], g["hidden_size"],
            g["intermediate_size"])


def bf16_scales(scale_bytes):
    """E8M0 bytes -> the same powers of two as bfloat16 (byte 0, 2^-127, is a subnormal)."""
    s = scale_bytes.to(torch.int32)
    bits = torch.where(s == 0, 0x0040, s << 7)
    return bits.to(torch.int16).view(torch.bfloat16).contiguous()


def kt_moe(gate_up, gate_up_scales, down, down_scales, threads):
    """kt-kernel's MXFP4 MoE on our weights: (cpu_infer, moe, class name, tensors it read)."""
    ext = kt_kernel.kt_kernel_ext
    cls = next((getattr(ext.moe, n) for n in ("AMXFP4_KGroup_MOE", "AVX2MXFP4_MOE")
                if hasattr(ext.moe, n)), None)
    if cls is None:
        pytest.skip("kt-kernel was built without an MXFP4 MoE")
    n_experts, top_k, hidden, inter = sizes()
    pool = ext.WorkerPoolConfig()
    pool.subpool_count = 1
    pool.subpool_numa_map = [0]
    pool.subpool_thread_count = [threads]
    cpu_infer = ext.CPUInfer(pool)
    held = []

    def per_expert(packed, scales):
        """[[pointer per expert]] of (O, G*16) bytes and (O, G) bfloat16 scales."""
        w = [packed[e].reshape(packed.shape[1], -1).contiguous() for e in range(n_experts)]
        s = [bf16_scales(scales[e]) for e in range(n_experts)]
        held.extend(w + s)
        return [[t.data_ptr() for t in w]], [[t.data_ptr() for t in s]]

    on_gpu = torch.zeros(n_experts, dtype=torch.bool)
    held.append(on_gpu)
    cfg = ext.moe.MOEConfig(n_experts, top_k, hidden, inter, on_gpu.data_ptr())
    cfg.layer_idx = 0
    cfg.pool = cpu_infer.backend_
    cfg.max_len = MAX_TOKENS
    cfg.swiglu_limit = LIMIT
    cfg.swiglu_alpha = ALPHA
    cfg.gate_projs, cfg.gate_scales = per_expert(gate_up[:, 0::2], gate_up_scales[:, 0::2])
    cfg.up_projs, cfg.up_scales = per_expert(gate_up[:, 1::2], gate_up_scales[:, 1::2])
    cfg.down_projs, cfg.down_scales = per_expert(down, down_scales)
    cfg.quant_config.bits = 4
    cfg.quant_config.group_size = 32
    cfg.quant_config.zero_point = False
    moe = cls(cfg)
    identity = torch.arange(n_experts, dtype=torch.int64)
    cpu_infer.submit(moe.load_weights_task(identity.data_ptr()))
    cpu_infer.sync()
    return cpu_infer, moe, cls.__name__, held


def layer(threads):
    """The weights, both forms, made once per session."""
    if not _LAYER:
        n_experts, top_k, hidden, inter = sizes()
        gate_up, gate_up_scales = _bench.make_experts(n_experts, 2 * inter, hidden)
        down, down_scales = _bench.make_experts(n_experts, hidden, inter, seed=1)
        cpu_infer, moe, name, held = kt_moe(gate_up, gate_up_scales, down, down_scales,
                                            threads)
        _LAYER.update(gate_up=gate_up, gate_up_scales=gate_up_scales, down=down,
                      down_scales=down_scales, cpu_infer=cpu_infer, moe=moe, kt_class=name,
                      held=held, threads=threads)
    assert _LAYER["threads"] == threads, "one kt-kernel worker pool per session"
    return _LAYER


def activation(gate_up):
    """gpt-oss's clamped SwiGLU on interleaved gate/up (rows 2j gate, 2j+1 up)."""
    gate = gate_up[..., 0::2].clamp(max=LIMIT)
    up = gate_up[..., 1::2].clamp(min=-LIMIT, max=LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


def run_mxfp4x(f, x, sel, mix, zeros, threads):
    gate_up = mxfp4x.mxfp4_experts_slots(x, f["gate_up"], f["gate_up_scales"], sel,
                                         num_threads=threads)
    act = activation(gate_up.float())
    y = mxfp4x.mxfp4_experts(act, f["down"], f["down_scales"], sel, mix, zeros,
                             num_threads=threads)
    return y.to(x.dtype)


def run_kt(f, x, sel, mix, out, n_tokens):
    f["cpu_infer"].submit(f["moe"].forward_task(n_tokens.data_ptr(), sel.shape[1],
                                                sel.data_ptr(), mix.data_ptr(), x.data_ptr(),
                                                out.data_ptr(), False))
    f["cpu_infer"].sync()
    return out


def reference(f, x, sel, mix):
    """The MLP in float64 on the decoded experts (exact decode, float64 products)."""
    x, mix = x.double(), mix.double()
    y = torch.zeros(x.shape[0], f["down"].shape[1], dtype=torch.float64)
    for e in sel.unique().tolist():
        gate_up = mxfp4x.dequantize(f["gate_up"][e], f["gate_up_scales"][e], torch.float64)
        down = mxfp4x.dequantize(f["down"][e], f["down_scales"][e], torch.float64)
        t, k = (sel == e).nonzero(as_tuple=True)
        y.index_add_(0, t, mix[t, k, None] * (activation(x[t] @ gate_up.T) @ down.T))
    return y


def rel_err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def settle(max_s=0.5):
    """Wait until the process's threads stop spinning: a 5 ms slice with under 0.1 core
    busy (kt-kernel's workers spin for tens of ms after a call; OpenMP's for less)."""
    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    end = time.perf_counter() + max_s
    while time.perf_counter() < end:
        c0, t0 = cpu_s(), time.perf_counter()
        time.sleep(0.005)
        if cpu_s() - c0 < 0.1 * (time.perf_counter() - t0):
            return


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("n_tokens", [1, MAX_TOKENS])
def test_kt_vs_mxfp4x(benchmark, n_tokens, threads):
    f = layer(threads)
    n_experts, top_k, hidden, inter = sizes()
    n_calls = 4
    calls = []
    for i in range(n_calls):
        x, sel, mix, _ = _bench.make_tokens(n_tokens, top_k, n_experts, hidden, hidden, call=i)
        calls.append(dict(x=x.to(torch.bfloat16), sel=sel.to(torch.int64).contiguous(),
                          mix=mix.float().contiguous(),
                          zeros=torch.zeros(n_tokens, hidden),
                          out=torch.zeros(n_tokens, hidden, dtype=torch.bfloat16),
                          n=torch.tensor([n_tokens], dtype=torch.int32)))
    sides = {
        "kt": lambda c: run_kt(f, c["x"], c["sel"], c["mix"], c["out"], c["n"]),
        "mxfp4x": lambda c: run_mxfp4x(f, c["x"], c["sel"], c["mix"], c["zeros"], threads),
    }
    c = calls[0]
    check = slice(0, min(n_tokens, 4))  # the first tokens, every output column
    ref = reference(f, c["x"][check], c["sel"][check], c["mix"][check])
    errs = {name: rel_err(fn(c)[check], ref) for name, fn in sides.items()}
    for name, err in errs.items():  # a wrong nibble order, scale or activation: > 0.1
        assert err < 2.0 ** -5, f"{name}: error {err:.3g} of max |reference|"
    settle()

    # one call of each side on the same tokens, the order swapped every round
    run, times = _bench.alternating(sides, calls, after=settle)

    benchmark.group = f"{SHAPE} T={n_tokens} bfloat16 kt-kernel vs mxfp4x"
    rounds = 1 if SMALL else (30 if n_tokens <= 32 else 5)
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
    info = benchmark.extra_info
    info.update(shape=SHAPE, tokens=n_tokens, dtype="bfloat16", threads=threads,
                isa=mxfp4x.backend_info()["isa"], kt_class=f["kt_class"],
                kt_variant=kt_kernel.__cpu_variant__, kt_version=kt_kernel.__version__,
                kt_note=KT_NOTE, kt_err=errs["kt"], mxfp4x_err=errs["mxfp4x"],
                checked_tokens=check.stop,
                flops=_bench.flops(n_tokens, top_k, 2 * inter, hidden)
                + _bench.flops(n_tokens, top_k, hidden, inter))
    if benchmark.stats is None:  # --benchmark-disable: the smoke run stops here
        return
    timed = {name: t[1:] for name, t in times.items()}  # (the warm-up round dropped)
    for name, t in timed.items():
        info[f"{name}_s"] = statistics.median(t)
    info["kt_vs_mxfp4x"] = info["kt_s"] / info["mxfp4x_s"]
    print(f"\n{SHAPE} T={n_tokens} {threads} threads bfloat16, medians of "
          f"{len(timed['kt'])}: kt-kernel {f['kt_class']} {info['kt_s'] * 1e3:.2f} ms "
          f"(error {errs['kt']:.2e} of max|ref|; {KT_NOTE}), mxfp4x "
          f"{info['mxfp4x_s'] * 1e3:.2f} ms (error {errs['mxfp4x']:.2e}), "
          f"kt / mxfp4x {info['kt_vs_mxfp4x']:.3f}")
