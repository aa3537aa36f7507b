"""python -m mxfp4x [bench | info | check | quantize]: the main job and tools.

``bench`` (the default) runs one gpt-oss-20b-like layer (gate/up: E=32, K=4,
O=5760, I=2880; random MXFP4 weights made in-process), checks a slice of the
result against the float64 reference, and prints time, GB/s of weights streamed
and GFLOP/s for the CPU kernels and the torch backend, beside the memory-read
floor and a torch matmul roof measured in the same run.
"""
import argparse
import json
import sys
import time

import torch

import mxfp4x
from mxfp4x import _bench
from mxfp4x._format import GROUP
from mxfp4x._testing import assert_matches_reference


def _cmd_info(args):
    info = mxfp4x.backend_info()
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:14s} {v}")
    return 0


def _cmd_bench(args):
    n_experts, top_k, d_out, d_in = _bench.SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    threads = args.threads or [max(1, torch.get_num_threads())]
    t0 = time.perf_counter()
    packed, scales = _bench.make_experts(n_experts, d_out, d_in)
    print(f"mxfp4x {mxfp4x.__version__}: {args.shape} E={n_experts} K={top_k} O={d_out} "
          f"I={d_in}, {dtype}, isa={mxfp4x.backend_info()['isa']}, packed "
          f"{(packed.numel() + scales.numel()) / 1e6:.0f} MB (made in "
          f"{time.perf_counter() - t0:.1f} s)")
    rows = []
    for n_tokens in args.tokens:
        calls = [_bench.make_tokens(n_tokens, top_k, n_experts, d_in, d_out, dtype, call=i)
                 for i in range(args.repeats)]
        # correctness first: a slice of the first call against the float64 reference
        x, sel, mix, shared = calls[0]
        y = mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared)
        check_rows = slice(0, min(d_out, 96))
        layer = dict(latent_tokens=x[:4], packed_weights=packed, scale_bytes=scales,
                     selected_experts=sel[:4], mixture_weights=mix[:4],
                     shared_output=shared[:4])
        assert_matches_reference(y[:4, check_rows], layer, rows=check_rows)
        n_bytes = _bench.streamed_bytes(packed, scales, sel)
        n_flops = _bench.flops(n_tokens, top_k, d_out, d_in)
        for th in threads:
            step = len(rows) + 1
            n_steps = len(args.tokens) * len(threads)
            bar = "#" * (20 * (step - 1) // n_steps)
            print(f"\r[{bar:20s}] {step}/{n_steps} measuring T={n_tokens} threads={th}...",
                  end="", file=sys.stderr, flush=True)
            def run(i, backend, calls=calls, th=th):
                c = calls[i % len(calls)]
                mxfp4x.mxfp4_experts(c[0], packed, scales, c[1], c[2], c[3], backend=backend,
                                     num_threads=th)
            old = torch.get_num_threads()
            torch.set_num_threads(th)
            try:
                t_cpu = _bench.best_time(lambda i: run(i, "cpu"), repeats=args.repeats)
                t_torch = (_bench.best_time(lambda i: run(i, "torch"), repeats=2)
                           if not args.no_torch else float("nan"))
            finally:
                torch.set_num_threads(old)
            t_read = _bench.read_floor(n_bytes, th)
            t_mm = _bench.matmul_roof(n_tokens, top_k, d_out, d_in, th, repeats=2)
            rows.append(dict(tokens=n_tokens, threads=th, cpu_ms=t_cpu * 1e3,
                             torch_ms=t_torch * 1e3, gbps=n_bytes / t_cpu / 1e9,
                             gflops=n_flops / t_cpu / 1e9, read_floor_ms=t_read * 1e3,
                             matmul_ms=t_mm * 1e3, vs_read=t_cpu / t_read,
                             vs_matmul=t_cpu / t_mm))
            r = rows[-1]
            print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
            print(f"T={n_tokens:<5d} threads={th}  cpu {r['cpu_ms']:9.2f} ms "
                  f"({r['gbps']:6.2f} GB/s, {r['gflops']:7.1f} GFLOP/s)  torch backend "
                  f"{r['torch_ms']:9.2f} ms  | read floor {r['read_floor_ms']:8.2f} ms "
                  f"(x{r['vs_read']:.2f})  decoded-matmul {r['matmul_ms']:8.2f} ms "
                  f"(x{r['vs_matmul']:.2f})", flush=True)
    print("check: a slice of every T matches the float64 reference within the float32 bound")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _cmd_check(args):
    """Self-test after install: every ISA and dtype, both backends, against the reference."""
    import numpy as np

    from mxfp4x import _cpu
    from mxfp4x._testing import random_layer

    failures = 0
    rng = np.random.default_rng(args.seed)
    print(f"mxfp4x {mxfp4x.__version__} self-test (seed {args.seed}); "
          f"isas {_cpu.runnable_isas()}, openmp {_cpu.have_openmp()}")
    for isa in _cpu.runnable_isas():
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for backend in ("cpu", "torch"):
                for shape in ((1, 4, 8, 37, 3), (33, 2, 5, 70, 5)):
                    layer = random_layer(rng, *shape, dtype=dtype, repeat_expert=True)
                    try:
                        y = mxfp4x.mxfp4_experts(**layer, backend=backend, isa=isa)
                        assert_matches_reference(y, layer)
                        status = "ok"
                    except Exception as exc:  # noqa: BLE001 - reported, then counted
                        failures += 1
                        status = f"FAILED: {type(exc).__name__}: " \
                                 f"{(str(exc).splitlines() or [''])[0]}"
                    print(f"  {isa:7s} {str(dtype)[6:]:9s} {backend:6s} T={shape[0]:<3d} "
                          f"{status}")
    print("all checks passed" if not failures else f"{failures} checks FAILED")
    return 1 if failures else 0


def _cmd_quantize(args):
    """Float tensors of a safetensors file -> MXFP4 (name_blocks, name_scales)."""
    from mxfp4x._safetensors import SafeTensorsFile, save_file

    src = SafeTensorsFile(args.input)
    out = {}
    n_q = 0
    for name in src.keys():
        t = src.get(name)
        wanted = any(s in name for s in args.only) if args.only else \
            not name.endswith("bias")  # biases stay as they are unless asked for
        if wanted and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] % GROUP == 0:
            packed, scales = mxfp4x.quantize(t, args.scale_rule)
            out[name + "_blocks"], out[name + "_scales"] = packed, scales
            n_q += 1
        else:
            out[name] = t
    save_file(out, args.output, {"mxfp4x": mxfp4x.__version__, "scale_rule": args.scale_rule})
    print(f"quantized {n_q} tensors, kept {len(out) - 2 * n_q} as they were -> {args.output}")
    return 0


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for th in sorted({r["threads"] for r in rows}):
        rs = [r for r in rows if r["threads"] == th]
        ax.plot([r["tokens"] for r in rs], [r["gflops"] for r in rs], "o-",
                label=f"mxfp4x, {th} thread(s)")
        ax.plot([r["tokens"] for r in rs], [r["gflops"] * r["vs_matmul"] for r in rs], "--",
                label=f"decoded torch.matmul, {th} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mxfp4x", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    pi = sub.add_parser("info", help="version, ISA in use, ISAs, OpenMP, threads")
    pi.add_argument("--json", action="store_true")
    pb = sub.add_parser("bench", help="run a model-sized layer and time it (the default)")
    pb.add_argument("--shape", choices=sorted(_bench.SHAPES), default="gpt-oss-20b-gate-up")
    pb.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    pb.add_argument("--threads", type=int, nargs="+", default=None)
    pb.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                    default="float32")
    pb.add_argument("--repeats", type=int, default=5)
    pb.add_argument("--no-torch", action="store_true", help="skip the torch backend timing")
    pb.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    pb.add_argument("--plot", metavar="PNG", help="also plot GFLOP/s against T (matplotlib)")
    pc = sub.add_parser("check", help="self-test: every ISA, dtype and backend vs the "
                                      "float64 reference")
    pc.add_argument("--seed", type=int, default=0)
    pq = sub.add_parser("quantize", help="float tensors of a .safetensors file -> MXFP4 "
                                         "(<name>_blocks, <name>_scales)")
    pq.add_argument("input")
    pq.add_argument("output")
    pq.add_argument("--scale-rule", choices=["floor", "ceil", "even"], default="floor")
    pq.add_argument("--only", nargs="+", metavar="SUBSTRING",
                    help="quantize only tensors whose names contain one of these (default: "
                         "every float tensor of rank >= 2 with a last dimension divisible "
                         "by 32, except *bias; groups run along the last dimension)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("info", "bench", "check", "quantize", "-h", "--help"):
        argv = ["bench"] + argv  # bench is the default subcommand
    args = p.parse_args(argv)
    commands = {"info": _cmd_info, "bench": _cmd_bench, "check": _cmd_check,
                "quantize": _cmd_quantize}
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
