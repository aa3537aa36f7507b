"""python -m mxfp4x [bench | info | check | quantize | roofline | verify | layer | ep-bench]

The main job and the tools (``python -m mxfp4x <command> --help`` for each):

* ``bench`` (the default) runs one gpt-oss-20b-like layer (gate/up: E=32, K=4, O=5760,
  I=2880; random MXFP4 weights made in-process), checks a slice of the result against the
  float64 reference, and prints time, GB/s of weights streamed and GFLOP/s for the CPU
  kernels and the torch backend, beside the floors of each case (bytes / read bandwidth
  and flops / FMA peak, from the roofs of ``roofline`` measured in the same run), a torch
  matmul roof, and issue 12's target for the case.
* ``info``: version, ISA in use, ISAs, OpenMP, threads.
* ``check``: the self-test after install, every ISA, dtype and backend against the
  float64 reference.
* ``quantize``: the float tensors of a .safetensors file to MXFP4.
* ``roofline``: this machine's roofs (memory read, FMA peak per ISA, torch.matmul).
* ``verify``: sha256 of every expert tensor of a checkpoint, the file's bytes against the
  bytes the loader hands to the kernels and against a manifest.
* ``layer``: a whole MoE layer in a real checkpoint layout, written, mapped, run, checked.
* ``ep-bench``: Kimi K3's experts split across the processes of torchrun.

Every argument is checked before any work starts (a bad one exits with status 2 and a
one-line message, as argparse does), and every file a command writes is replaced whole
(:func:`mxfp4x._io.atomic_write`): an error never leaves a user's file half-written.
"""
import argparse
import json
import os
import sys
import time

import torch

import mxfp4x
from mxfp4x import _bench, _threads
from mxfp4x._format import GROUP, GROUP_BYTES
from mxfp4x._io import atomic_write, check_writable
from mxfp4x._testing import assert_matches_reference
from mxfp4x._threads import MAX_THREADS


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
    threads = args.threads or [_threads.resolve(None)]
    tty = sys.stderr.isatty()
    from mxfp4x import _roofline
    isa = mxfp4x.backend_info()["isa"]
    roofs = _roofline.measure(threads=sorted(set(threads)))
    print("roofs: read " + ", ".join(f"{roofs['read_gbps'][th]:.1f}" for th in threads) +
          " GB/s; FMA " + ", ".join(f"{roofs['fma_gflops'][th][isa]:.0f}" for th in threads) +
          f" GFLOP/s ({isa}; threads {', '.join(map(str, threads))})")
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
            if tty:  # a progress bar on a terminal only: none in logs
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
            fl = _bench.floors(n_bytes, n_flops, roofs, th, isa)
            t_mm = _bench.matmul_roof(n_tokens, top_k, d_out, d_in, th, repeats=2)
            target, met = _bench.verdict(n_tokens, args.dtype, t_cpu, fl, t_mm, isa)
            rows.append(dict(tokens=n_tokens, threads=th, cpu_ms=t_cpu * 1e3,
                             torch_ms=t_torch * 1e3, gbps=n_bytes / t_cpu / 1e9,
                             gflops=n_flops / t_cpu / 1e9,
                             read_floor_ms=fl["read_floor_s"] * 1e3,
                             floor_ms=fl["floor_s"] * 1e3, matmul_ms=t_mm * 1e3,
                             vs_read=t_cpu / fl["read_floor_s"], vs_floor=t_cpu / fl["floor_s"],
                             vs_matmul=t_cpu / t_mm, target=target, met=met))
            r = rows[-1]
            if tty:
                print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
            print(f"T={n_tokens:<5d} threads={th}  cpu {r['cpu_ms']:9.2f} ms "
                  f"({r['gbps']:6.2f} GB/s, {r['gflops']:7.1f} GFLOP/s)  torch backend "
                  f"{r['torch_ms']:9.2f} ms  | floor {r['floor_ms']:8.2f} ms "
                  f"(x{r['vs_floor']:.2f}; read floor x{r['vs_read']:.2f})  decoded-matmul "
                  f"{r['matmul_ms']:8.2f} ms (x{r['vs_matmul']:.2f})  "
                  f"[{'-' if met is None else 'met' if met else 'missed'}: {target}]",
                  flush=True)
    print("check: a slice of every T matches the float64 reference within the float32 bound")
    if args.json:
        with atomic_write(args.json, "w") as f:
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
          f"isas {_cpu.runnable_isas()}, openmp {_threads.have_openmp()}")
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
    from mxfp4x._safetensors import save_file

    src = args.source  # opened, and its tensors chosen, by _check_quantize
    out = {}
    for name in src.keys():
        t = src.get(name)
        if name in args.chosen:
            packed, scales = mxfp4x.quantize(t, args.scale_rule)
            out[name + "_blocks"], out[name + "_scales"] = packed, scales
        else:
            out[name] = t
    # the kept tensors are views of the input's mapping: save_file replaces the output
    # whole, so writing over the input itself (output == input) is safe
    save_file(out, args.output, {"mxfp4x": mxfp4x.__version__, "scale_rule": args.scale_rule})
    n_q = len(args.chosen)
    print(f"quantized {n_q} tensors, kept {len(out) - 2 * n_q} as they were -> {args.output}")
    return 0


def _cmd_roofline(args):
    """The roofs of this machine, measured now."""
    from mxfp4x import _roofline

    roofs = _roofline.measure(args.threads, quick=args.quick)
    if args.json:
        print(json.dumps(roofs))
        return 0
    cpu = roofs["cpu"]
    print(f"{cpu['model']} ({cpu['machine']}, {cpu['cores']} cores; flags: "
          f"{' '.join(cpu['flags']) or '-'}); mxfp4x ISAs here: {roofs['isas']}")
    for th in roofs["threads"]:
        fma = ", ".join(f"{isa} {v:.0f}" for isa, v in roofs["fma_gflops"][th].items())
        mm = roofs["matmul_gflops"][th]
        print(f"threads={th}: memory read {roofs['read_gbps'][th]:.1f} GB/s; FMA peak "
              f"(GFLOP/s, float32) {fma}; torch.matmul 2048^2 float32 {mm['float32']:.0f}, "
              f"bfloat16 {mm['bfloat16']:.0f} GFLOP/s")
    return 0


def _cmd_verify(args):
    """sha256 of every expert tensor: the file's bytes vs the bytes the loader hands to the
    kernels (and vs a manifest)."""
    from mxfp4x._checkpoints import verify_experts

    t0 = time.perf_counter()
    try:
        report = verify_experts(args.opened, layers=args.layers, manifest=args.hashes)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        print(f"verify FAILED: {_message(exc)}", file=sys.stderr)
        return 1
    for name, what in report["mismatches"][:20]:
        print(f"MISMATCH {name}: {what}")
    if args.write_manifest:
        with atomic_write(args.write_manifest, "w") as f:
            json.dump(report["hashes"], f, indent=0, sort_keys=True)
    other = report["manifest_other"]
    print(f"{report['checked']} expert tensors of layers {report['layers']}"
          + (f" and {other} other tensors of the manifest" if other else "")
          + f", {report['bytes'] / 1e9:.2f} GB, read in {time.perf_counter() - t0:.1f} s: "
          + ("the bytes handed to the kernels are the file's bytes"
             + (" and match the manifest" if args.hashes is not None else "")
             if not report["mismatches"] else f"{len(report['mismatches'])} MISMATCHES"))
    return 1 if report["mismatches"] or not report["checked"] else 0


def _rss_mapped():
    """(resident, mapped file-backed) bytes of this process (Linux; zeros elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) * 1024
        mapped = 0
        with open("/proc/self/smaps") as f:
            path = ""
            for line in f:
                parts = line.split()
                if len(parts) >= 5 and "-" in parts[0] and ":" not in parts[0]:
                    path = parts[5] if len(parts) >= 6 else ""  # a new mapping
                elif parts and parts[0] == "Size:" and path.endswith(".safetensors"):
                    mapped += int(parts[1]) * 1024
        return rss, mapped
    except (OSError, KeyError, ValueError):
        return 0, 0


def _check_slice(n_tokens, got, ref, bound, what):
    """A slice of a layer's output against its float64 reference, relative to max|ref|."""
    import numpy as np

    err = float(np.abs(got.double().numpy() - ref).max() / np.abs(ref).max())
    if not err <= bound:
        print(f"check FAILED: relative error {err:.3g} (bound {bound:g})")
        return False
    print(f"check: T={n_tokens} rows 0..{got.shape[1] - 1} of {got.shape[0]} token(s) match "
          f"the float64 reference (relative error {err:.2g}, {what} bound {bound:g})")
    return True


def _cmd_layer(args):
    """One MoE layer in the real checkpoint layout, written, mapped, run and checked."""
    import shutil
    import tempfile

    import numpy as np

    from mxfp4x import _kimi_k3

    if args.model == "gpt-oss-20b":
        return _layer_gpt_oss(args)
    sizes = dict(_kimi_k3.K3_SIZES)
    per_expert = 3 * sizes["moe_intermediate_size"] * sizes["routed_expert_hidden_size"] \
        * 17 // 32  # bytes + scale bytes of w1, w3, w2
    n_experts = args.experts if args.experts is not None else sizes["num_experts"]
    root = args.dir or tempfile.gettempdir()
    free = shutil.disk_usage(root).free
    fits = max(sizes["num_experts_per_token"], int((free - (2 << 30)) * 0.8 // per_expert))
    if n_experts > fits:
        print(f"layer: {n_experts} experts need {n_experts * per_expert / 1e9:.1f} GB; "
              f"{free / 1e9:.1f} GB free in {root}: using {fits} experts (--experts)")
        n_experts = fits
    folder = tempfile.mkdtemp(prefix="mxfp4x-k3-", dir=root)
    try:
        t0 = time.perf_counter()
        config = _kimi_k3.k3_config(num_experts=n_experts, num_hidden_layers=2)
        _kimi_k3.write_k3_checkpoint(folder, config, [1], seed=0,
                                     shards=max(1, n_experts // 128), progress=True)
        on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        print(f"kimi-k3 layer 1: {n_experts} experts (top-{sizes['num_experts_per_token']}, "
              f"hidden {sizes['hidden_size']}, latent {sizes['routed_expert_hidden_size']}, "
              f"ff {sizes['moe_intermediate_size']}), {on_disk / 1e9:.2f} GB written in "
              f"{time.perf_counter() - t0:.1f} s to {folder}")
        rss0, _ = _rss_mapped()
        block = mxfp4x.nn.KimiK3MoE.from_checkpoint(folder, layer=1)
        rss1, mapped = _rss_mapped()
        print(f"mapped: {mapped / 1e9:.2f} GB of files; resident grew by "
              f"{(rss1 - rss0) / 2**20:.0f} MiB while loading")
        rng = np.random.default_rng(0)
        for n_tokens in args.tokens:
            x = torch.from_numpy(rng.standard_normal((n_tokens, sizes["hidden_size"]))
                                 ).to(torch.bfloat16)
            sel, w = block.router(x)
            n_bytes = len(torch.unique(sel)) * per_expert
            for th in args.threads or [_threads.resolve(None)]:
                old = torch.get_num_threads()
                torch.set_num_threads(th)
                block.experts.num_threads = th
                h = torch.nn.functional.linear(x, block.down_proj)
                try:
                    times, expert_times = [], []
                    for _ in range(args.repeats if n_tokens <= 64 else 1):
                        t1 = time.perf_counter()
                        y = block(x)
                        t2 = time.perf_counter()
                        block.experts(h, sel, w)  # the routed experts alone
                        times.append(t2 - t1)
                        expert_times.append(time.perf_counter() - t2)
                finally:
                    torch.set_num_threads(old)
                t, te = min(times), min(expert_times)
                rss, _ = _rss_mapped()
                print(f"T={n_tokens:<4d} threads={th}  layer {t * 1e3:9.1f} ms "
                      f"({n_tokens / t:7.1f} tokens/s); routed experts alone {te * 1e3:9.1f} ms "
                      f"({n_bytes / te / 1e9:5.2f} GB/s of {n_bytes / 1e9:.2f} GB, "
                      f"{len(torch.unique(sel))} experts)  resident {rss / 2**30:.2f} GiB",
                      flush=True)
            # a slice against the float64 reference of the block (the same routing)
            rows = slice(0, 64)
            t_check = min(n_tokens, 2)
            ref = _kimi_k3.kimi_k3_reference(block, x[:t_check], sel[:t_check], w[:t_check],
                                             rows=rows)
            # bfloat16 latents and dense parts: tests/test_kimi_k3.py's bound
            if not _check_slice(n_tokens, y[:t_check, rows], ref, 3e-2, "bfloat16"):
                return 1
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


def _cmd_ep_bench(args):
    """Kimi K3 routed experts split over the ranks of torchrun (or one process)."""
    import datetime
    import shutil
    import tempfile

    import numpy as np
    import torch.distributed as dist

    from mxfp4x import _checkpoints as ck
    from mxfp4x import _kimi_k3

    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    else:  # one process, same code path
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = args.threads or _threads.resolve(None)
    torch.set_num_threads(threads)
    sizes = args.sizes  # the checkpoint's (--checkpoint) or the model's
    n_exp = args.n_experts  # --experts, else the checkpoint's or the model's count
    lat, ff, top_k = (sizes["routed_expert_hidden_size"], sizes["moe_intermediate_size"],
                      sizes["num_experts_per_token"])
    per_expert = 3 * ff * lat * 17 // 32
    folder = [None]
    if rank == 0:
        folder[0] = args.checkpoint or tempfile.mkdtemp(prefix="mxfp4x-ep-", dir=args.dir)
        if not args.checkpoint:
            _kimi_k3.write_k3_checkpoint(folder[0], _kimi_k3.k3_config(
                num_experts=n_exp, num_hidden_layers=2), [1], seed=0,
                shards=max(1, n_exp // 64), progress=True)
    dist.broadcast_object_list(folder, src=0)
    dist.barrier()
    cuts = np.linspace(0, n_exp, world + 1).astype(int)
    e0, e1 = int(cuts[rank]), int(cuts[rank + 1])
    rss0, _ = _rss_mapped()
    ckpt = ck.open_checkpoint(folder[0])
    proj = ck.load_experts(ckpt, ck.KIMI_K3, 1, range(e0, e1),
                           ck.find_prefix(ckpt, ck.KIMI_K3, 1))
    experts = mxfp4x.nn.KimiK3Experts(proj["gate"], proj["up"], proj["down"],
                                      expert_ids=range(e0, e1), num_threads=threads,
                                      group=dist.group.WORLD if world > 1 else None)
    rows = []
    for n_tokens in args.tokens:
        g = torch.Generator().manual_seed(n_tokens)
        h = torch.randn(n_tokens, lat, generator=g).to(torch.bfloat16)
        sel = torch.rand(n_tokens, n_exp, generator=g).topk(top_k, dim=1).indices
        w = torch.rand(n_tokens, top_k, generator=g)
        mine = slice(*(int(v) for v in np.linspace(0, n_tokens, world + 1).astype(int)
                       [rank:rank + 2]))
        best = (float("inf"), 0, 0.0)
        for _ in range(args.repeats if n_tokens <= 64 else 1):
            dist.barrier()
            t0 = time.perf_counter()
            experts(h[mine], sel[mine], w[mine])
            dt = time.perf_counter() - t0
            routing = experts.last_routing
            sent = routing.bytes_sent if routing is not None else 0
            comm = routing.comm_seconds if routing is not None else 0.0
            best = min(best, (dt, sent, comm))
        rss, mapped = _rss_mapped()
        mine_row = [best[0], best[1], best[2], rss, mapped, e1 - e0]
        everyone = [None] * world
        dist.all_gather_object(everyone, mine_row)
        active = len(torch.unique(sel))
        row = dict(tokens=n_tokens, world=world, threads=threads, experts=n_exp,
                   time_s=max(r[0] for r in everyone),
                   sent_bytes=sum(r[1] for r in everyone),
                   comm_share=float(np.mean([r[2] / r[0] for r in everyone])),
                   resident=[r[3] for r in everyone], mapped=[r[4] for r in everyone],
                   expert_bytes=active * per_expert)
        rows.append(row)
        if rank == 0:
            print(f"T={n_tokens:<4d} {world} process(es) x {threads} thread(s): "
                  f"{row['time_s'] * 1e3:9.1f} ms/call, sent {row['sent_bytes'] / 1e6:8.2f} "
                  f"MB/call ({row['comm_share'] * 100:4.1f} % of the time in the "
                  f"all-to-alls), {active} experts ({row['expert_bytes'] / 1e9:.2f} GB), "
                  f"resident {[f'{r / 2**30:.2f}' for r in row['resident']]} GiB, mapped "
                  f"{[f'{m / 2**30:.2f}' for m in row['mapped']]} GiB per rank", flush=True)
    if rank == 0:
        print(f"E={n_exp} experts ({n_exp * per_expert / 1e9:.1f} GB), top-{top_k}; each rank "
              f"maps and holds only its {n_exp // world}-expert share "
              f"(resident grew by {(rss0 and (_rss_mapped()[0] - rss0)) / 2**20:.0f} MiB on "
              f"rank 0 in all)")
        if args.json:
            with atomic_write(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and not args.checkpoint and not args.keep:
        shutil.rmtree(folder[0], ignore_errors=True)
    return 0


def _layer_gpt_oss(args):
    """The gpt-oss-20b variant of ``layer``: one MoE layer (router and experts)."""
    import shutil
    import tempfile

    import numpy as np

    from mxfp4x import _gpt_oss

    folder = tempfile.mkdtemp(prefix="mxfp4x-gpt-oss-", dir=args.dir)
    try:
        t0 = time.perf_counter()
        cfg = _gpt_oss.write_gpt_oss_layer(folder, **({"num_local_experts": args.experts}
                                                      if args.experts is not None else {}))
        size = os.path.getsize(os.path.join(folder, "model.safetensors"))
        print(f"gpt-oss-20b layer 0: {cfg['num_local_experts']} experts (top-"
              f"{cfg['experts_per_token']}, hidden {cfg['hidden_size']}), {size / 1e9:.2f} GB "
              f"written in {time.perf_counter() - t0:.1f} s to {folder}")
        rss0, _ = _rss_mapped()
        from mxfp4x._safetensors import SafeTensorsCheckpoint
        ck = SafeTensorsCheckpoint(folder)
        block = mxfp4x.nn.GptOssExperts.from_checkpoint(ck, 0)
        rw = ck.get("model.layers.0.mlp.router.weight")
        rb = ck.get("model.layers.0.mlp.router.bias")
        rss1, mapped = _rss_mapped()
        print(f"mapped: {mapped / 1e9:.2f} GB of files; resident grew by "
              f"{(rss1 - rss0) / 2**20:.0f} MiB while loading")
        per_expert = (block.gate_up_blocks[0].numel() + block.gate_up_scales[0].numel()
                      + block.down_blocks[0].numel() + block.down_scales[0].numel())
        rng = np.random.default_rng(0)
        for n_tokens in args.tokens:
            x = torch.from_numpy(rng.standard_normal((n_tokens, cfg["hidden_size"]))).float()
            idx, w = _gpt_oss.route(x, rw, rb, cfg["experts_per_token"])
            n_bytes = len(torch.unique(idx)) * per_expert
            for th in args.threads or [_threads.resolve(None)]:
                old = torch.get_num_threads()
                torch.set_num_threads(th)
                block.num_threads = th
                try:
                    times = []
                    for _ in range(args.repeats if n_tokens <= 64 else 1):
                        t1 = time.perf_counter()
                        idx, w = _gpt_oss.route(x, rw, rb, cfg["experts_per_token"])
                        y = block(x, idx, w)
                        times.append(time.perf_counter() - t1)
                finally:
                    torch.set_num_threads(old)
                t = min(times)
                rss, _ = _rss_mapped()
                print(f"T={n_tokens:<4d} threads={th}  layer {t * 1e3:9.1f} ms "
                      f"({n_tokens / t:7.1f} tokens/s, {n_bytes / t / 1e9:5.2f} GB/s of "
                      f"{n_bytes / 1e9:.2f} GB of expert bytes)  resident {rss / 2**30:.2f} GiB",
                      flush=True)
            rows = slice(0, 64)
            k = min(n_tokens, 2)
            ref = _gpt_oss.gpt_oss_reference(block, x[:k], idx[:k], w[:k], rows=rows)
            # float32 accumulation: tests/test_nn.py's bound
            if not _check_slice(n_tokens, y[:k, rows], ref, 1e-4, "float32"):
                return 1
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


def _plot(rows, path):
    """GFLOP/s against T; ``path`` and its format were checked by ``_check_plot``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    # a file object has no name to infer the format from: pass it
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format=os.path.splitext(path)[1][1:].lower(), dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


# ---- arguments: every one is checked here, before any command starts its work ----------

def _int_type(lo, hi=None, what="an integer"):
    """An argparse ``type=``: an int in [lo, hi]; argparse reports a refusal as
    ``argument X: expected ..., got ...`` with exit status 2."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


positive_int = _int_type(1, what="a positive integer")
nonnegative_int = _int_type(0, what="an integer >= 0")
# torch accepts any count and then starts that many threads; the kernels use at most this
thread_count = _int_type(1, MAX_THREADS, what=f"a thread count in [1, {MAX_THREADS}]")


def _message(exc):
    # str(KeyError) is the repr of its argument: quotes around the whole message
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def _existing_file(path, what, error):
    if not os.path.exists(path):
        error(f"{what}: {path!r} does not exist")
    if os.path.isdir(path):
        error(f"{what}: {path!r} is a folder, expected a file")
    if not os.access(path, os.R_OK):
        error(f"{what}: {path!r} is not readable")


def _writable_folder(path, what, error):
    if not os.path.isdir(path):
        error(f"{what}: {path!r} is not an existing folder")
    if not os.access(path, os.W_OK | os.X_OK):
        error(f"{what}: cannot write in {path!r}")


def _writable(path, what, error):
    try:
        check_writable(path, what)
    except ValueError as exc:
        error(str(exc))


def _same_file(a, b):
    return os.path.realpath(a) == os.path.realpath(b)


def _physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows): not checked
        return None


def _check_memory(n_bytes, what, error):
    """Refuse a size that cannot fit (``n_bytes``: a lower bound of what the command
    holds at once) before the work, rather than fail in an allocation minutes later."""
    total = _physical_memory()
    if total and n_bytes > total:
        error(f"{what}: needs at least {n_bytes / 1e9:.1f} GB of memory, this machine has "
              f"{total / 1e9:.1f} GB")


def _check_plot(path, error):
    """The plot's path as matplotlib would write it (a name without an extension gets
    ".png"), its format known to matplotlib, its folder writable."""
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
    _writable(path, "argument --plot", error)
    return path


def _check_bench(args, error):
    n_experts, _, d_out, d_in = _bench.SHAPES[args.shape]
    experts = n_experts * d_out * (d_in // GROUP) * (GROUP_BYTES + 1)
    _check_memory(experts, "argument --shape", error)
    tokens = args.repeats * max(args.tokens) * (d_in + d_out) * getattr(torch, args.dtype).itemsize
    _check_memory(experts + tokens, "argument --tokens", error)
    if args.json:
        _writable(args.json, "argument --json", error)
    if args.plot:
        args.plot = _check_plot(args.plot, error)
        if args.json and _same_file(args.json, args.plot):
            error("argument --plot: the same file as --json")


def _quantizable(t):
    """What ``quantize`` turns into MXFP4: float weights (not E8M0 scales, which are bytes)
    of rank >= 2 whose rows are whole groups of 32."""
    return (t.is_floating_point() and t.element_size() >= 2 and t.dim() >= 2
            and t.shape[-1] % GROUP == 0)


def _check_quantize(args, error):
    from mxfp4x._safetensors import SafeTensorsFile

    _existing_file(args.input, "argument input", error)
    _writable(args.output, "argument output", error)
    try:
        args.source = SafeTensorsFile(args.input)
        # views of the mapping: no bytes are read, but every entry's dtype is checked
        tensors = {name: args.source.get(name) for name in args.source.keys()}
    except (OSError, TypeError, ValueError) as exc:
        error(f"argument input: {_message(exc)}")
    for part in args.only or ():
        if not any(part in name for name in tensors):
            error(f"argument --only: no tensor name of {args.input} contains {part!r}")
    args.chosen = {name for name, t in tensors.items() if _quantizable(t) and (
        any(s in name for s in args.only) if args.only
        else not name.endswith("bias"))}  # biases stay as they are unless asked for
    if not args.chosen:
        error(f"argument input: no tensor of {args.input} to quantize (float, rank >= 2, a "
              f"last dimension divisible by {GROUP}"
              + (", a name containing one of --only)" if args.only else ", not *bias)"))
    made = set(tensors) - args.chosen
    for name in sorted(args.chosen):
        for new in (name + "_blocks", name + "_scales"):
            if new in made:
                error(f"argument input: quantizing {name!r} would overwrite the tensor "
                      f"{new!r} the file also holds")
            made.add(new)


def _check_verify(args, error):
    from mxfp4x import _checkpoints as ck

    if not os.path.exists(args.checkpoint):
        error(f"argument checkpoint: {args.checkpoint!r} does not exist")
    try:
        config = ck.read_config(args.checkpoint)
        layout = ck.family_of(config)
        ck.num_experts(config)
        args.opened = ck.open_checkpoint(args.checkpoint)  # headers only
        available = ck.moe_layers(args.opened, layout)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        error(f"argument checkpoint: {_message(exc)}")
    if not available:
        error(f"argument checkpoint: {args.checkpoint} holds no {layout.name} expert tensors: "
              f"nothing to verify")
    for i, layer in enumerate(args.layers or ()):
        if layer in args.layers[:i]:
            error(f"argument --layers: layer {layer} given twice")
        if layer not in available:
            error(f"argument --layers: layer {layer} has no expert tensors in "
                  f"{args.checkpoint} (its expert layers: {available})")
    args.hashes = None
    if args.manifest:
        _existing_file(args.manifest, "argument --manifest", error)
        try:
            with open(args.manifest, "rb") as f:
                doc = json.loads(f.read())
        except OSError as exc:
            error(f"argument --manifest: {exc}")
        except ValueError as exc:
            error(f"argument --manifest: {args.manifest} is not valid JSON ({exc})")
        try:
            args.hashes = ck.check_manifest(doc, "argument --manifest")
        except ValueError as exc:
            error(str(exc))
    if args.write_manifest:
        _writable(args.write_manifest, "argument --write-manifest", error)
        for path in ck.checkpoint_files(args.opened):
            if _same_file(args.write_manifest, path):
                error(f"argument --write-manifest: {args.write_manifest!r} is a file of the "
                      f"checkpoint")


def _check_layer(args, error):
    if args.model == "gpt-oss-20b":
        from mxfp4x._gpt_oss import GPT_OSS_20B as sizes
        top_k, n_model = sizes["experts_per_token"], sizes["num_local_experts"]
    else:
        from mxfp4x._kimi_k3 import K3_SIZES as sizes
        top_k, n_model = sizes["num_experts_per_token"], sizes["num_experts"]
    if args.experts is not None and not top_k <= args.experts <= n_model:
        error(f"argument --experts: expected {top_k} to {n_model} experts ({args.model} routes "
              f"each token to {top_k} of its {n_model}), got {args.experts}")
    if args.dir is not None:
        _writable_folder(args.dir, "argument --dir", error)
    n_experts = args.experts or n_model
    # the float64 draw of the tokens and one router score per expert
    _check_memory(max(args.tokens) * (8 * sizes["hidden_size"] + 4 * n_experts),
                  "argument --tokens", error)


def _check_ep_bench(args, error):
    from mxfp4x import _checkpoints as ck
    from mxfp4x._kimi_k3 import K3_SIZES

    args.sizes = dict(K3_SIZES)
    if args.checkpoint is not None:
        if not os.path.exists(args.checkpoint):
            error(f"argument --checkpoint: {args.checkpoint!r} does not exist")
        try:
            config = ck.read_config(args.checkpoint)
            if ck.family_of(config) is not ck.KIMI_K3:
                raise ValueError(f"{args.checkpoint}: not a Kimi K3 checkpoint")
            ck.num_experts(config)
            # the tokens are made in the checkpoint's shapes, not the released model's
            for key in ("num_experts", "num_experts_per_token", "routed_expert_hidden_size",
                        "moe_intermediate_size", "hidden_size"):
                value = config.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"config.json: {key} is {value!r}, expected a positive "
                                     f"int")
                args.sizes[key] = value
            ckpt = ck.open_checkpoint(args.checkpoint)
            prefix = ck.find_prefix(ckpt, ck.KIMI_K3, 1)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            error(f"argument --checkpoint: {_message(exc)}")
    top_k, n_model = args.sizes["num_experts_per_token"], args.sizes["num_experts"]
    if args.experts is not None and not top_k <= args.experts <= n_model:
        error(f"argument --experts: expected {top_k} to {n_model} experts (each token goes "
              f"to {top_k} of them), got {args.experts}")
    args.n_experts = args.experts or n_model
    if args.checkpoint is not None:
        for name in ck.iter_expert_tensors(ckpt, ck.KIMI_K3, [1], args.n_experts, prefix):
            if name not in ckpt:
                error(f"argument --checkpoint: {args.checkpoint} lacks {name}")
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1  # torch.distributed reports a malformed WORLD_SIZE itself
    if args.n_experts < world:
        error(f"argument --experts: {args.n_experts} experts cannot be split over {world} "
              f"processes")
    if args.dir is not None:
        _writable_folder(args.dir, "argument --dir", error)
    # only rank 0 writes the figures (on its own machine: not checked on the others)
    if args.json and os.environ.get("RANK", "0") == "0":
        _writable(args.json, "argument --json", error)
    _check_memory(max(args.tokens) * 4 * (args.n_experts + 2 * args.sizes["hidden_size"]),
                  "argument --tokens", error)


def _check_nothing(args, error):
    pass  # argparse's types and choices checked every argument of the command


def _parser():
    p = argparse.ArgumentParser(prog="python -m mxfp4x", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    pi = sub.add_parser("info", help="version, ISA in use, ISAs, OpenMP, threads")
    pi.add_argument("--json", action="store_true")
    pb = sub.add_parser("bench", help="run a model-sized layer and time it (the default)")
    pb.add_argument("--shape", choices=sorted(_bench.SHAPES), default="gpt-oss-20b-gate-up")
    pb.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 128])
    pb.add_argument("--threads", type=thread_count, nargs="+", default=None)
    pb.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                    default="float32")
    pb.add_argument("--repeats", type=positive_int, default=5)
    pb.add_argument("--no-torch", action="store_true", help="skip the torch backend timing")
    pb.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    pb.add_argument("--plot", metavar="PNG", help="also plot GFLOP/s against T (matplotlib)")
    pc = sub.add_parser("check", help="self-test: every ISA, dtype and backend vs the "
                                      "float64 reference")
    pc.add_argument("--seed", type=nonnegative_int, default=0)
    pq = sub.add_parser("quantize", help="float tensors of a .safetensors file -> MXFP4 "
                                         "(<name>_blocks, <name>_scales)")
    pq.add_argument("input")
    pq.add_argument("output", help="may be the input itself: it is replaced when done")
    pq.add_argument("--scale-rule", choices=["floor", "ceil", "even"], default="floor")
    pq.add_argument("--only", nargs="+", metavar="SUBSTRING",
                    help="quantize only tensors whose names contain one of these (default: "
                         "every float tensor of rank >= 2 with a last dimension divisible "
                         "by 32, except *bias; groups run along the last dimension)")
    pv = sub.add_parser("verify", help="sha256 of every expert tensor of a checkpoint: the "
                                       "file's bytes vs the bytes the loader hands to the "
                                       "kernels")
    pv.add_argument("checkpoint")
    pv.add_argument("--layers", type=nonnegative_int, nargs="+", default=None,
                    help="default: every layer whose expert tensors the checkpoint holds")
    pv.add_argument("--manifest", metavar="JSON", help="also compare with these hashes")
    pv.add_argument("--write-manifest", metavar="JSON", help="write the hashes")
    pl = sub.add_parser("layer", help="a whole MoE layer in the real checkpoint layout: "
                                      "write, map, run, check")
    pl.add_argument("--model", choices=["kimi-k3", "gpt-oss-20b"], default="kimi-k3")
    pl.add_argument("--experts", type=positive_int, default=None,
                    help="fewer experts than the model's (to fit a small disk); top-k and "
                         "the matrix shapes stay")
    pl.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 512])
    pl.add_argument("--threads", type=thread_count, nargs="+", default=None)
    pl.add_argument("--repeats", type=positive_int, default=3)
    pl.add_argument("--dir", default=None, help="where to write the layer (default: TMPDIR)")
    pl.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    pr = sub.add_parser("roofline", help="the roofs of this machine: memory read bandwidth, "
                                         "FMA peak per ISA, torch.matmul")
    pr.add_argument("--threads", type=thread_count, nargs="+", default=None)
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    pe = sub.add_parser("ep-bench", help="Kimi K3 experts split across processes: run under "
                                         "torchrun --nproc-per-node N")
    pe.add_argument("--experts", type=positive_int, default=None,
                    help="fewer than 896 experts (top-16 and the shapes stay)")
    pe.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 32, 512])
    pe.add_argument("--threads", type=thread_count, default=None, help="threads per process")
    pe.add_argument("--repeats", type=positive_int, default=3)
    pe.add_argument("--checkpoint", default=None, help="an existing K3 checkpoint folder")
    pe.add_argument("--dir", default=None, help="where to write the layer (default: TMPDIR)")
    pe.add_argument("--keep", action="store_true")
    pe.add_argument("--json", metavar="PATH")
    return p, sub.choices


# name -> (the checks of its arguments, the command)
COMMANDS = {"bench": (_check_bench, _cmd_bench), "info": (_check_nothing, _cmd_info),
            "check": (_check_nothing, _cmd_check), "quantize": (_check_quantize, _cmd_quantize),
            "roofline": (_check_nothing, _cmd_roofline), "verify": (_check_verify, _cmd_verify),
            "layer": (_check_layer, _cmd_layer), "ep-bench": (_check_ep_bench, _cmd_ep_bench)}


def main(argv=None):
    p, parsers = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        if argv and not argv[0].startswith("-"):
            p.error(f"unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})")
        argv = ["bench"] + argv  # bench is the default subcommand
    args = p.parse_args(argv)
    check, command = COMMANDS[args.cmd]
    check(args, parsers[args.cmd].error)
    try:
        return command(args)
    except OSError as exc:  # a full disk, a file gone: what it is, not a traceback
        print(f"{parsers[args.cmd].prog}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
