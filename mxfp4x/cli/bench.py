"""run a model-sized layer and time it

One MoE projection of --shape (default: gpt-oss-20b's gate/up), random MXFP4 weights made
in-process. A slice of each result is checked against the float64 reference, then the CPU
kernels and the torch backend are timed and shown beside the floors of each case, from
this machine's roofs measured in the same run: bytes / memory read bandwidth (measured
again just before and after each case, the better of the two: a shared machine's
bandwidth moves from minute to minute), flops / FMA peak, and torch.matmul on the decoded
weights (x: time / floor). The peer
"predecoded-experts" is the same op as torch runs it on experts decoded ahead of time
into the latents' dtype (as a model dequantized at load holds them: a matmul per
selected expert, index_add_ back), where those fit in half the free memory.

--device cuda times the GPU path instead (the Triton kernel where Triton is installed,
else the torch backend) and the torch backend, beside the GPU's own roofs (device memory
read bandwidth, torch.matmul's float32 and latent-dtype rates) and torch.matmul on
weights decoded on the GPU."""
import json
import os
import time

import torch

import mxfp4x
from mxfp4x._core import threads as _threads
from mxfp4x._core.files import atomic_write
from mxfp4x._core.format import matrix_bytes
from mxfp4x._core.progress import Progress
from mxfp4x._measure import bench as _bench
from mxfp4x._measure import roofline as _roofline
from mxfp4x._synthetic.layers import assert_matches_reference

from ._args import memory, outputs, positive_int, thread_count
from ._process import default_threads

# the rows of each result checked against the float64 reference: enough to cross several
# groups of the output, few enough that the reference takes no time beside the timing
CHECKED_TOKENS, CHECKED_ROWS = 4, 96
# each of the two buffers the read roofs are measured on beside every case (more than
# the last-level cache, as the roofline's)
PROBE_BYTES = 5 << 28


def add_arguments(parser):
    parser.add_argument("--shape", choices=sorted(_bench.SHAPES), default="gpt-oss-20b-gate-up")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 128])
    parser.add_argument("--threads", type=thread_count, nargs="+", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the GPU path and the torch backend on the GPU, against "
                             "the GPU's roofs")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                        default="float32")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--no-torch", action="store_true",
                        help="skip the torch backend and the predecoded-experts timings")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--plot", metavar="PNG",
                        help="also plot GFLOP/s against T (matplotlib)")


def _plot_path(path, error):
    """The plot's path as matplotlib would write it (a name without an extension gets
    ".png"), its format known to matplotlib (where it may be written: :func:`outputs`)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        error("argument --plot: needs matplotlib (pip install matplotlib)")
    if not os.path.splitext(path)[1]:
        path += ".png"
    fmt = os.path.splitext(path)[1][1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt not in formats:
        error(f"argument --plot: matplotlib cannot write {fmt!r} images (it writes "
              f"{', '.join(sorted(formats))})")
    return path


def _check_cuda(args, error, shape_bytes, call_bytes):
    if not torch.cuda.is_available():
        error("argument --device: cuda needs a GPU and a CUDA build of torch "
              "(torch.cuda.is_available() is False here)")
    if args.threads:
        error("argument --threads: sets CPU threads; leave it out with --device cuda")
    if args.no_torch:
        error("argument --no-torch: CPU runs only (with --device cuda the torch backend "
              "is the GPU path's baseline)")
    free, total = torch.cuda.mem_get_info()
    for needed, what in ((shape_bytes, "argument --shape"),
                         (shape_bytes + call_bytes, _calls_what(args))):
        if needed > free:
            error(f"{what}: needs at least {needed / 1e9:.1f} GB of GPU memory, "
                  f"{free / 1e9:.1f} GB of the GPU's {total / 1e9:.1f} GB are free")


def _calls_what(args):
    """The arguments that size the calls made ahead of the timing (``--repeats`` calls of
    up to ``max(--tokens)`` tokens): what a memory check of them names."""
    return (f"arguments --tokens and --repeats ({args.repeats} calls of up to "
            f"{max(args.tokens)} tokens, {args.dtype})")


def check(args, error):
    n_experts, top_k, d_out, d_in = _bench.SHAPES[args.shape]
    experts = n_experts * matrix_bytes(d_out, d_in)
    memory(experts, "argument --shape", error)
    # every call's tokens and outputs are made before the timing
    tokens = args.repeats * max(args.tokens) * (d_in + d_out) * getattr(torch, args.dtype).itemsize
    memory(experts + tokens, _calls_what(args), error)
    if args.device == "cuda":
        # the experts and the peer's top_k decoded float32 matrices, and the tokens
        _check_cuda(args, error, experts + top_k * d_out * d_in * 4, tokens)
    if args.plot:
        args.plot = _plot_path(args.plot, error)
    outputs([(args.json, "argument --json"), (args.plot, "argument --plot")], error)


def _check_result(call, packed, scales, d_out):
    """Correctness first: a slice of the call against the float64 reference."""
    x, sel, mix, shared = call
    y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared)
    rows, t = slice(0, min(d_out, CHECKED_ROWS)), slice(0, CHECKED_TOKENS)
    layer = dict(latent_tokens=x[t], packed_weights=packed, scale_bytes=scales,
                 selected_experts=sel[t], mixture_weights=mix[t], shared_output=shared[t])
    assert_matches_reference(y[t, rows], layer, rows=rows)


def _adjacent_roofs(roofs, th, before, after):
    """``roofs`` with the read roofs of ``th`` threads measured beside a case (the better
    of ``before`` and ``after``, ReadProbe.measure figures)."""
    out = dict(roofs)
    for key in ("read_gbps", "read_gbps_torch"):
        out[key] = {**roofs[key], th: max(before[key], after[key])}
    return out


def _measure(args, calls, packed, scales, th, case, roofs, isa, pre=None, probe=None):
    """One row of figures: T tokens on ``th`` threads, beside the case's floors and, with
    ``pre`` (a ``Predecoded``), torch on experts decoded ahead of time.  ``probe`` (a
    ReadProbe): the read roofs measured again just before and after the case, so its
    floors are those of that minute (a noisy host's bandwidth moves)."""
    n_tokens, top_k, d_out, d_in = case

    def run(i, backend):
        c = calls[i % len(calls)]
        mxfp4x.mxfp4_experts(c[0], packed, scales, c[1], c[2], c[3], backend=backend,
                             num_threads=th)
    with _threads.torch_threads(th):
        # one pass over the calls first: a process's first calls run slower (at one token
        # on 2 threads of an AMD EPYC Zen 5 the first ten took 1.1-1.6 ms, the next
        # 0.8-1.0), and a model runs in the steady state
        for i in range(len(calls)):
            run(i, "cpu")
        before = probe.measure(th) if probe is not None else None
        t_cpu = _roofline.best_time(lambda i: run(i, "cpu"), repeats=args.repeats)
        if probe is not None:
            roofs = _adjacent_roofs(roofs, th, before, probe.measure(th))
        t_torch = (_roofline.best_time(lambda i: run(i, "torch"), repeats=2)
                   if not args.no_torch else float("nan"))
    n_bytes = _bench.streamed_bytes(packed, scales, calls[0][1])
    n_flops = _bench.flops(n_tokens, top_k, d_out, d_in)
    fl = _bench.floors(n_bytes, n_flops, roofs, th, isa, args.dtype)
    # the peer: torch.matmul of the latents' dtype on weights decoded to it
    t_mm = _bench.matmul_roof(n_tokens, top_k, d_out, d_in, th, getattr(torch, args.dtype),
                              repeats=2)
    # the peer: what its experts need decoded, and against what, before they are decoded
    need = None if pre is None else pre.bytes_needed(torch.cat([c[1].reshape(-1)
                                                                for c in calls]))
    budget = None if pre is None else pre.budget()
    t_pre = _bench.predecoded_time(pre, calls, th) if pre is not None else None
    return dict(tokens=n_tokens, threads=th, cpu_ms=t_cpu * 1e3, torch_ms=t_torch * 1e3,
                gbps=n_bytes / t_cpu / 1e9, gflops=n_flops / t_cpu / 1e9,
                read_gbps=roofs["read_gbps"][th],
                read_gbps_torch=roofs["read_gbps_torch"][th],
                read_floor_ms=fl["read_floor_s"] * 1e3, floor_ms=fl["floor_s"] * 1e3,
                matmul_ms=t_mm * 1e3, vs_read=t_cpu / fl["read_floor_s"],
                vs_read_torch=t_cpu / fl.get("read_floor_torch_s", float("nan")),
                vs_floor=t_cpu / fl["floor_s"], vs_matmul=t_cpu / t_mm,
                predecoded_ms=None if t_pre is None else t_pre * 1e3,
                vs_predecoded=None if t_pre is None else t_cpu / t_pre,
                predecoded_gb=None if need is None else need / 1e9,
                predecoded_budget_gb=None if budget is None else budget / 1e9)


def _read_probe():
    """A ReadProbe for the cases' own read roofs, where its two buffers leave this process
    at least as much memory again (else None: every case takes the roofs measured at the
    start, and the output says so)."""
    need = 2 * PROBE_BYTES
    free = _bench.available_memory()
    if free is not None and free < 2 * need:
        print(f"read roofs: measured once at the start ({need / 1e9:.1f} GB for measuring "
              f"them beside each case would leave too little of the {free / 1e9:.1f} GB "
              "available)")
        return None
    return _roofline.ReadProbe(PROBE_BYTES)


def run(args):
    if args.device == "cuda":
        return _run_cuda(args)
    n_experts, top_k, d_out, d_in = _bench.SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    threads = args.threads or [default_threads()]
    isa = mxfp4x.backend_info()["isa"]
    roofs = _roofline.measure(threads=sorted(set(threads)))
    print("roofs: read " + ", ".join(f"{roofs['read_gbps'][th]:.1f}" for th in threads) +
          " GB/s (torch's memory " +
          ", ".join(f"{roofs['read_gbps_torch'][th]:.1f}" for th in threads) +
          "); FMA " + ", ".join(f"{roofs['fma_gflops'][th][isa]:.0f}" for th in threads) +
          "".join(f", bf16 unit {roofs['bf16_dot_gflops'][th][isa]:.0f}" for th in threads
                  if args.dtype == "bfloat16" and isa in roofs["bf16_dot_gflops"][th]) +
          f" GFLOP/s ({isa}; threads {', '.join(map(str, threads))})")
    t0 = time.perf_counter()
    packed, scales = _bench.make_experts(n_experts, d_out, d_in)
    print(f"mxfp4x {mxfp4x.__version__}: {args.shape} E={n_experts} K={top_k} O={d_out} "
          f"I={d_in}, {dtype}, isa={isa}, packed "
          f"{(packed.numel() + scales.numel()) / 1e6:.0f} MB (made in "
          f"{time.perf_counter() - t0:.1f} s)")
    probe = _read_probe()
    bar = Progress(len(args.tokens) * len(threads), "bench")
    pre = None if args.no_torch else _bench.Predecoded(packed, scales, dtype)
    rows = []
    for n_tokens in args.tokens:
        calls = [_bench.make_tokens(n_tokens, top_k, n_experts, d_in, d_out, dtype, call=i)
                 for i in range(args.repeats)]
        _check_result(calls[0], packed, scales, d_out)
        for th in threads:
            bar.update(len(rows), f"measuring T={n_tokens} threads={th}")
            r = _measure(args, calls, packed, scales, th, (n_tokens, top_k, d_out, d_in),
                         roofs, isa, pre, probe)
            rows.append(r)
            bar.clear()
            print(f"T={n_tokens:<5d} threads={th}  cpu {r['cpu_ms']:9.2f} ms "
                  f"({r['gbps']:6.2f} GB/s, {r['gflops']:7.1f} GFLOP/s)  torch backend "
                  f"{r['torch_ms']:9.2f} ms  | floor {r['floor_ms']:8.2f} ms "
                  f"(x{r['vs_floor']:.2f}; read floor x{r['vs_read']:.2f}, on torch's memory "
                  f"x{r['vs_read_torch']:.2f}; read {r['read_gbps']:.1f} GB/s)  decoded-matmul "
                  f"{r['matmul_ms']:8.2f} ms (x{r['vs_matmul']:.2f})" + _predecoded_text(r),
                  flush=True)
    return _finish(args, rows)


def _predecoded_text(r):
    if r["predecoded_gb"] is None:
        return ""
    if r["predecoded_ms"] is None:
        return (f"  predecoded-experts n/a (needs {r['predecoded_gb']:.1f} GB decoded, "
                f"half the free memory is {r['predecoded_budget_gb']:.1f})")
    return f"  predecoded-experts {r['predecoded_ms']:8.2f} ms (x{r['vs_predecoded']:.2f})"


def _finish(args, rows):
    print("check: a slice of every T matches the float64 reference within the float32 bound")
    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _run_cuda(args, device=None, roof_sizes=()):
    """The GPU path and the torch backend on the GPU, each case beside the GPU's floors and peer
    (``device``, ``roof_sizes``: another device and smaller roofs, for a check without
    a GPU)."""
    from mxfp4x._core import triton_impl as _triton
    from mxfp4x._measure import gpu

    n_experts, top_k, d_out, d_in = _bench.SHAPES[args.shape]
    dtype, device = getattr(torch, args.dtype), device or torch.device("cuda")
    roofs = gpu.measure(device, dtype, *roof_sizes)
    mm = roofs["matmul_gflops"]
    print(f"roofs: {roofs['device']}: read {roofs['read_gbps']:.0f} GB/s; torch.matmul "
          f"float32 {mm['float32'] / 1e3:.1f} TFLOP/s (TF32 off)" +
          (f", {args.dtype} {mm[args.dtype] / 1e3:.1f}" if args.dtype != "float32" else ""))
    packed, scales = (t.to(device) for t in _bench.make_experts(n_experts, d_out, d_in))
    x0 = torch.empty((1, d_in), dtype=dtype, device=device)
    path = "Triton kernel" if _triton.usable(x0, packed, scales) else "torch backend"
    print(f"mxfp4x {mxfp4x.__version__}: {args.shape} E={n_experts} K={top_k} O={d_out} "
          f"I={d_in}, {dtype}, {path} on {roofs['device']}, packed "
          f"{(packed.numel() + scales.numel()) / 1e6:.0f} MB")
    rows = []
    for n_tokens in args.tokens:
        calls = [tuple(t.to(device) for t in _bench.make_tokens(
            n_tokens, top_k, n_experts, d_in, d_out, dtype, call=i)) for i in range(args.repeats)]
        _check_result(calls[0], packed, scales, d_out)

        def call(i, backend, calls=calls):
            x, sel, mix, shared = calls[i % len(calls)]
            mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared, backend=backend)
        t = gpu.synchronized_time(lambda i: call(i, "auto"), device, args.repeats)
        # a CUDA graph holds the Triton kernels' calls; the torch backend syncs (its ids
        # check, its per-expert loop), which a capture cannot hold
        t_graph = gpu.graph_time(lambda: call(0, "auto"), device, args.repeats) \
            if path == "Triton kernel" else None
        t_torch = gpu.synchronized_time(lambda i: call(i, "torch"), device, 2)
        n_bytes = _bench.streamed_bytes(packed, scales, calls[0][1])
        n_flops = _bench.flops(n_tokens, top_k, d_out, d_in)
        read_s = n_bytes / (roofs["read_gbps"] * 1e9)
        # the Triton kernels multiply 16-bit latents on the tensor cores, float32 ones (and
        # the torch backend every dtype) in float32
        rate = mm[args.dtype] if path == "Triton kernel" and args.dtype != "float32" \
            else mm["float32"]
        floor_s = max(read_s, n_flops / (rate * 1e9))
        t_mm = gpu.matmul_peer(n_tokens, top_k, d_out, d_in, dtype, device)
        r = dict(tokens=n_tokens, threads=None, device=roofs["device"], path=path,
                 cuda_ms=t * 1e3, torch_ms=t_torch * 1e3, gbps=n_bytes / t / 1e9,
                 gflops=n_flops / t / 1e9, read_floor_ms=read_s * 1e3, floor_ms=floor_s * 1e3,
                 matmul_ms=t_mm * 1e3, vs_read=t / read_s, vs_floor=t / floor_s,
                 vs_matmul=t / t_mm, graph_ms=None if t_graph is None else t_graph * 1e3,
                 graph_vs_read=None if t_graph is None else t_graph / read_s)
        rows.append(r)
        graph = "" if t_graph is None else (f"  graph replay {r['graph_ms']:8.3f} ms (read "
                                            f"floor x{r['graph_vs_read']:.2f})")
        print(f"T={n_tokens:<5d} cuda  {r['cuda_ms']:9.3f} ms ({r['gbps']:7.1f} GB/s, "
              f"{r['gflops']:8.1f} GFLOP/s)  torch backend {r['torch_ms']:8.3f} ms  | floor "
              f"{r['floor_ms']:8.3f} ms (x{r['vs_floor']:.2f}; read floor x{r['vs_read']:.2f})"
              f"  decoded-matmul {r['matmul_ms']:8.3f} ms (x{r['vs_matmul']:.2f}){graph}",
              flush=True)
    return _finish(args, rows)


def _plot(rows, path):
    """GFLOP/s against T; ``path`` and its format were checked by ``_plot_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for th in sorted({r["threads"] for r in rows}, key=str):
        rs = [r for r in rows if r["threads"] == th]
        where = f"{th} thread(s)" if th else rs[0]["device"]
        ax.plot([r["tokens"] for r in rs], [r["gflops"] for r in rs], "o-",
                label=f"mxfp4x, {where}")
        ax.plot([r["tokens"] for r in rs], [r["gflops"] * r["vs_matmul"] for r in rs], "--",
                label=f"decoded torch.matmul, {where}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    # a file object has no name to infer the format from: pass it
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format=os.path.splitext(path)[1][1:].lower(), dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
