"""Kimi K3 experts split across processes: run under torchrun --nproc-per-node N

The routed experts of one Kimi K3 layer (written at random, or --checkpoint's), split
across the processes of torchrun (or one process without it): each maps and holds only
its share, tokens go to the experts' owners and back through all-to-alls. Prints the
time of a call, the bytes sent and each process's resident memory."""
import datetime
import json
import os
import shutil
import socket
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import mxfp4x
from mxfp4x._core.files import atomic_write
from mxfp4x._core.format import GROUP
from mxfp4x.checkpoints import families as ck

from ._args import (
    CHECKPOINT_ERRORS,
    checkpoint_inputs,
    expert_count,
    memory,
    message,
    outputs,
    positive_int,
    regular_inputs,
    thread_count,
    writable_folder,
)
from ._families import MODELS
from ._process import default_threads, repeats, rss_mapped

K3 = MODELS["kimi-k3"]
# the sizes the tokens are made in, from a --checkpoint's config.json
SIZE_KEYS = ("num_experts", "num_experts_per_token", "routed_expert_hidden_size",
             "moe_intermediate_size", "hidden_size")


def add_arguments(parser):
    parser.add_argument("--experts", type=positive_int, default=None,
                        help=f"fewer than the model's {K3.n_experts()} experts (top-"
                             f"{K3.top_k()} and the shapes stay)")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="threads per process")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--checkpoint", default=None, help="an existing K3 checkpoint folder")
    parser.add_argument("--dir", default=None, help="where to write the layer (default: TMPDIR)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the layer written (else removed however the run ends)")
    parser.add_argument("--json", metavar="PATH")


def _checkpoint_sizes(args, error):
    """The checkpoint's sizes (tokens are made in its shapes, not the released model's)
    and its name prefix."""
    checkpoint_inputs(args.checkpoint, "argument --checkpoint", error)
    try:
        config = ck.read_config(args.checkpoint)
        if ck.family_of(config) is not ck.KIMI_K3:
            raise ValueError(f"{args.checkpoint}: not a Kimi K3 checkpoint")
        # every key under the name read here, as the loader reads it (KimiLinearConfig's)
        config = ck.KIMI_K3.config(config, ck.config_path(args.checkpoint))
        ck.num_experts(config, ck.KIMI_K3)
        for key in SIZE_KEYS:
            value = config.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {key} is {value!r}, expected a positive int")
            args.sizes[key] = value
        for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if args.sizes[key] % GROUP:
                raise ValueError(f"config.json: {key} is {args.sizes[key]}, expected a "
                                 f"multiple of {GROUP} (a matrix's rows are whole groups)")
        ckpt = ck.open_checkpoint(args.checkpoint)
    except CHECKPOINT_ERRORS as exc:
        error(f"argument --checkpoint: {message(exc)}")
    regular_inputs(ck.checkpoint_files(ckpt), "argument --checkpoint", error)
    try:
        return ckpt, ck.find_prefix(ckpt, ck.KIMI_K3, K3.layer)
    except CHECKPOINT_ERRORS as exc:
        error(f"argument --checkpoint: {message(exc)}")


def _check_shapes(args, ckpt, prefix, error):
    """Every expert matrix the run maps has the shape config.json gives (the tokens are
    made in those sizes): (out, in/2) packed bytes and (out, in/32) scale bytes, gate and
    up (ff, latent), down (latent, ff).  Maps the files, reads no byte."""
    ff, latent = "moe_intermediate_size", "routed_expert_hidden_size"
    keys = {"gate": (ff, latent), "up": (ff, latent), "down": (latent, ff)}
    try:
        proj = ck.load_experts(ckpt, ck.KIMI_K3, K3.layer, range(args.n_experts), prefix)
    except CHECKPOINT_ERRORS as exc:
        error(f"argument --checkpoint: {message(exc)}")
    for role, (packed, scales) in proj.items():
        out_key, in_key = keys[role]
        d_out, d_in = args.sizes[out_key], args.sizes[in_key]
        for e, p, s in zip(range(args.n_experts), packed, scales, strict=True):
            for t, kind, want, rule in ((p, ck.KIMI_K3.packed, (d_out, d_in // 2), "in/2"),
                                        (s, ck.KIMI_K3.scale, (d_out, d_in // GROUP),
                                         f"in/{GROUP}")):
                if tuple(t.shape) != want:
                    name = ck.KIMI_K3.tensor(prefix, K3.layer, e, role, kind)
                    error(f"argument --checkpoint: {name} is {tuple(t.shape)}, expected "
                          f"{want}: config.json's {out_key} {d_out} and {in_key} {d_in} "
                          f"make each {role} matrix ({d_out}, {d_in}), its {kind} "
                          f"(out, {rule})")


def check(args, error):
    """Sets ``args.sizes`` (the checkpoint's or the model's) and ``args.n_experts``."""
    args.sizes = dict(K3.sizes)
    if args.checkpoint is not None:
        ckpt, prefix = _checkpoint_sizes(args, error)
    model = "the checkpoint" if args.checkpoint is not None else K3.name
    expert_count(args.experts, K3.top_k(args.sizes), K3.n_experts(args.sizes), model, error)
    args.n_experts = args.experts or K3.n_experts(args.sizes)
    if args.checkpoint is not None:
        for name in ck.iter_expert_tensors(ck.KIMI_K3, [K3.layer], args.n_experts,
                                           prefix):
            if name not in ckpt:
                error(f"argument --checkpoint: {args.checkpoint} lacks {name}")
        _check_shapes(args, ckpt, prefix, error)
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1  # torch.distributed reports a malformed WORLD_SIZE itself
    if args.n_experts < world:
        error(f"argument --experts: {args.n_experts} experts cannot be split over {world} "
              f"processes")
    if args.dir is not None:
        writable_folder(args.dir, "argument --dir", error)
    # only rank 0 writes the figures (on its own machine: not checked on the others)
    if os.environ.get("RANK", "0") == "0":
        reads = [] if args.checkpoint is None else [
            (path, f"a file of the checkpoint {args.checkpoint!r}")
            for path in ck.checkpoint_files(ckpt)]
        outputs([(args.json, "argument --json")], error, reads=reads,
                checkpoints=[args.checkpoint] if args.checkpoint is not None else [])
    # each token's float32 router scores over the experts and its hidden state in and out
    memory(max(args.tokens) * 4 * (args.n_experts + 2 * args.sizes["hidden_size"]),
           "argument --tokens" if args.checkpoint is None else
           "arguments --tokens and --checkpoint (its hidden_size and experts)", error)


def _init_process_group():
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    else:  # one process, same code path
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _share(n, rank, world):
    """[start, end) of rank's share of n things, as even as can be."""
    cuts = np.linspace(0, n, world + 1).astype(int)
    return int(cuts[rank]), int(cuts[rank + 1])


def run(args):
    rank, world = _init_process_group()
    made = [None]  # the layer rank 0 writes: removed however the run ends, unless --keep
    try:
        return _run(args, rank, world, made)
    finally:
        if made[0] is not None and not args.keep:
            shutil.rmtree(made[0], ignore_errors=True)


def _run(args, rank, world, made):
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    n_exp, top_k = args.n_experts, K3.top_k(args.sizes)
    per_expert = K3.expert_bytes(args.sizes)
    folder = [args.checkpoint]
    if rank == 0 and not args.checkpoint:
        folder[0] = made[0] = tempfile.mkdtemp(prefix="mxfp4x-ep-", dir=args.dir)
        K3.write(folder[0], n_exp)
    dist.broadcast_object_list(folder, src=0)
    dist.barrier()
    e0, e1 = _share(n_exp, rank, world)
    rss0, _ = rss_mapped()
    ckpt = ck.open_checkpoint(folder[0])
    proj = ck.load_experts(ckpt, ck.KIMI_K3, K3.layer, range(e0, e1),
                           ck.find_prefix(ckpt, ck.KIMI_K3, K3.layer))
    experts = mxfp4x.nn.KimiK3Experts(proj["gate"], proj["up"], proj["down"],
                                      expert_range=(e0, e1), num_threads=threads,
                                      group=dist.group.WORLD if world > 1 else None)
    rows = []
    for n_tokens in args.tokens:
        g = torch.Generator().manual_seed(n_tokens)
        h = torch.randn(n_tokens, args.sizes["routed_expert_hidden_size"],
                        generator=g).to(torch.bfloat16)
        sel = torch.rand(n_tokens, n_exp, generator=g).topk(top_k, dim=1).indices
        w = torch.rand(n_tokens, top_k, generator=g)
        mine = slice(*_share(n_tokens, rank, world))
        best = (float("inf"), 0, 0.0)
        for _ in range(repeats(n_tokens, args.repeats)):
            dist.barrier()
            t0 = time.perf_counter()
            experts(h[mine], sel[mine], w[mine])
            dt = time.perf_counter() - t0
            routing = experts.last_routing
            sent = routing.bytes_sent if routing is not None else 0
            comm = routing.comm_seconds if routing is not None else 0.0
            best = min(best, (dt, sent, comm))
        rss, mapped = rss_mapped()
        everyone = [None] * world
        dist.all_gather_object(everyone, [best[0], best[1], best[2], rss, mapped, e1 - e0])
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
              f"(resident grew by {(rss0 and (rss_mapped()[0] - rss0)) / 2**20:.0f} MiB on "
              f"rank 0 in all)")
        if args.json:
            with atomic_write(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0
