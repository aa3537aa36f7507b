"""a whole MoE layer in the real checkpoint layout: write, map, run, check

A random layer of the model (its real sizes, fewer experts with --experts) is written in
the release's checkpoint layout, mapped, run on random tokens and timed (the whole layer,
and its routed experts alone), and a slice of its output is checked against the float64
reference. The written layer is removed unless --keep."""
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from mxfp4x._core import threads as _threads

from ._args import expert_count, folder_to_make, memory, positive_int, thread_count
from ._families import MODELS
from ._process import default_threads, repeats, rss_mapped

# what the float64 reference computes: it decodes every selected expert in numpy, so a
# few tokens and rows keep it to seconds at model size
CHECKED_TOKENS, CHECKED_ROWS = 2, 64
# the disk left to others when --experts does not fit: 2 GiB and a fifth of the rest
DISK_RESERVE, DISK_SHARE = 2 << 30, 0.8


def add_arguments(parser):
    parser.add_argument("--model", choices=list(MODELS), default=next(iter(MODELS)))
    parser.add_argument("--experts", type=positive_int, default=None,
                        help="fewer experts than the model's (to fit a small disk); top-k and "
                             "the matrix shapes stay")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 512])
    parser.add_argument("--threads", type=thread_count, nargs="+", default=None)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--dir", default=None,
                        help="where to write the layer, made if need be (default: TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoint")


def check(args, error):
    family = MODELS[args.model]
    expert_count(args.experts, family.top_k(), family.n_experts(), args.model, error)
    if args.dir is not None:
        folder_to_make(args.dir, "argument --dir", error)
    n_experts = args.experts or family.n_experts()
    # the float64 draw of the tokens and one router score per expert
    memory(max(args.tokens) * (8 * family.sizes["hidden_size"] + 4 * n_experts),
           "argument --tokens", error)


def _make_folders(path):
    """``os.makedirs(path)``, returning the folders it made, outermost first."""
    missing = []
    full = os.path.abspath(path)
    while not os.path.exists(full):
        missing.insert(0, full)
        full = os.path.dirname(full)
    os.makedirs(path, exist_ok=True)
    return missing


def _experts_that_fit(family, n_experts, root):
    per_expert = family.expert_bytes()
    free = shutil.disk_usage(root).free
    fits = max(family.top_k(), int((free - DISK_RESERVE) * DISK_SHARE // per_expert))
    if n_experts > fits:
        print(f"layer: {n_experts} experts need {n_experts * per_expert / 1e9:.1f} GB; "
              f"{free / 1e9:.1f} GB free in {root}: using {fits} experts (--experts)")
    return min(n_experts, fits)


def run(args):
    family = MODELS[args.model]
    made = _make_folders(args.dir) if args.dir is not None else []
    root = args.dir or tempfile.gettempdir()
    folder = None
    try:
        n_experts = _experts_that_fit(family, args.experts or family.n_experts(), root)
        folder = tempfile.mkdtemp(prefix=f"mxfp4x-{family.name}-", dir=root)
        return _run(args, family, folder, n_experts)
    finally:
        if not args.keep:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            for path in reversed(made):  # what --dir made, if left empty
                try:
                    os.rmdir(path)
                except OSError:
                    break


def _run(args, family, folder, n_experts):
    t0 = time.perf_counter()
    family.write(folder, n_experts)
    on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    shown = ", ".join(f"{label} {family.sizes[key]}" for label, key in family.shown)
    print(f"{family.name} layer {family.layer}: {n_experts} experts (top-{family.top_k()}, "
          f"{shown}), {on_disk / 1e9:.2f} GB written in {time.perf_counter() - t0:.1f} s to "
          f"{folder}")
    rss0, _ = rss_mapped()
    block = family.load(folder)
    rss1, mapped = rss_mapped()
    print(f"mapped: {mapped / 1e9:.2f} GB of files; resident grew by "
          f"{(rss1 - rss0) / 2**20:.0f} MiB while loading")
    rng = np.random.default_rng(0)
    for n_tokens in args.tokens:
        x = family.tokens(rng, n_tokens)
        sel, w = family.route(block, x)
        active = len(torch.unique(sel))
        n_bytes = active * family.expert_bytes()
        for th in args.threads or [default_threads()]:
            with _threads.torch_threads(th):
                family.set_threads(block, th)
                experts = family.experts_alone(block, x, sel, w)
                times, expert_times = [], []
                for _ in range(repeats(n_tokens, args.repeats)):
                    t1 = time.perf_counter()
                    y = family.forward(block, x)
                    t2 = time.perf_counter()
                    experts()
                    times.append(t2 - t1)
                    expert_times.append(time.perf_counter() - t2)
            t, te = min(times), min(expert_times)
            rss, _ = rss_mapped()
            print(f"T={n_tokens:<4d} threads={th}  layer {t * 1e3:9.1f} ms "
                  f"({n_tokens / t:7.1f} tokens/s); routed experts alone {te * 1e3:9.1f} ms "
                  f"({n_bytes / te / 1e9:5.2f} GB/s of {n_bytes / 1e9:.2f} GB, "
                  f"{active} experts)  resident {rss / 2**30:.2f} GiB", flush=True)
        if not _check(family, block, x, sel, w, y):
            return 1
    return 0


def _check(family, block, x, sel, w, y):
    """A slice of the layer's output against its float64 reference (the same routing),
    relative to max|reference|."""
    k, rows = min(len(x), CHECKED_TOKENS), slice(0, CHECKED_ROWS)
    ref = family.reference(block, x[:k], sel[:k], w[:k], rows)
    got = y[:k, rows]
    err = float(np.abs(got.double().numpy() - ref).max() / np.abs(ref).max())
    if not err <= family.bound:
        print(f"check FAILED: relative error {err:.3g} (bound {family.bound:g})")
        return False
    print(f"check: T={len(x)} rows 0..{got.shape[1] - 1} of {k} token(s) match the float64 "
          f"reference (relative error {err:.2g}, {family.bound_what} bound {family.bound:g})")
    return True
