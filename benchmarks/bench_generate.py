"""gpt-oss generating end to end on a CPU: mxfp4x's transformers door beside llama.cpp,
on the same random weights.

    python benchmarks/bench_generate.py [--layers N] [--threads 1 2] [--repeats 2]
        [--prefill 128 512 [2048]] [--decode 32] [--context 4096] [--sequences 8 32]
        [--json out.json] [--plot out.png]

writes (once) one random gpt-oss model (gpt-oss-20b's configuration; ``--layers N``: N
layers of the real width) as a checkpoint in the released safetensors layout and as the
GGUF file llama.cpp's converter makes of it (``gpt-oss.gguf`` in the same folder: the
same expert codes and scales as ``block_mxfp4`` tensors ``blk.N.ffn_{gate,up,down}_exps
.weight``, gate and up split, the dense weights bf16, norms, biases and the router
float32, a tokenizer of the checkpoint's tokens), checks that the two files hold the same
experts (mxfp4x's readers of both, the same tokens through them), then, each
measurement in a fresh process, alternated (ours, llama.cpp's, ours, llama.cpp's) for
each thread count:

* ``mxfp4x``: ``mxfp4x.integrations.transformers.from_pretrained`` (bench_transformers'
  ``measure``);
* ``llama.cpp``: the GGUF file through ``llama-cpp-python`` (``pip install
  llama-cpp-python``, which compiles llama.cpp for this CPU; skipped, with the reason
  printed, when it is not installed or cannot load the file), flash attention on (what
  llama.cpp's ``auto`` picks on a CPU), batches of 512 tokens;

and prints one table: load time (the loading call, then a first forward of
``prefill[0]`` tokens, which reads what either side mapped lazily), peak RSS, prefill
tokens/s at each ``--prefill`` length, decode tokens/s over ``--decode`` greedy steps
after a ``prefill[0]``-token prompt (and, with ``--context N``, over 16 steps after N
tokens), the tokens/s of ``--sequences`` s sequences decoded together (8 greedy steps
after s prompts of 64 tokens in one batch: transformers' batch on mxfp4x's side,
llama.cpp's parallel decoding with a sequence slot each and one unified cache on the
other), each side's figures the median of its ``--repeats`` processes; for mxfp4x, a
decoding step's time split (the experts with their router, the attention, the rest:
norms, embedding, head) against its read floor: the bytes that part of the step reads
(the router and the selected experts' MXFP4 blocks and their biases; the attention's
weights and its cache; the norms, one embedding row and the head; as mxfp4x holds them)
over the
read bandwidth (``mxfp4x.testing.roofline.read_bandwidth``) measured just before and
just after each side's process, the better, since a shared host's bandwidth moves by up
to 2x from one minute to the next (the table's ``read`` column, each side's median, and
each ``x floor`` against it).  Both sides' last-token logits of the
first forward are compared (cosine, top-1): the same model, not just the same sizes.
``--plot`` draws decode tokens/s against the context and against the sequences.

Under pytest (``pytest benchmarks``) one case runs it on a tiny model with one thread and
one repeat with ``MXFP4X_BENCH_SMALL=1`` (CI's smoke run), on 4 layers of the real width
otherwise.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _sibling(name):
    """A file of benchmarks/ as a module: benchmarks/ is no package (a script has it on
    sys.path, pytest imports its files by path)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, name + ".py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bt = _sibling("bench_transformers")
say = bt.say

GGUF_NAME = "gpt-oss.gguf"
PREFILL, DECODE = bt.PREFILL, bt.DECODE
SMALL_RUN = dict(prefill=(16, 32), decode=4, sequences=(3,))
SEQUENCES = (8, 32)


def default_folder(layers):
    """Where the random model of ``layers`` layers is kept (all 24: bench_transformers'
    checkpoint, written once for both)."""
    name = "mxfp4x-gpt-oss-20b-random" + ("" if layers == bt.TOTAL_LAYERS else
                                          f"-{layers}-layers")
    return os.path.join(os.path.expanduser("~"), ".cache", name)


gt = _sibling("gguf_twin")
write_gguf, check_same_experts = gt.write_gguf, gt.check_same_experts
side = _sibling("generate_sides")
llama_missing, plot = side.llama_missing, side.plot


def prepare(folder, layers=None, small=False):
    """The random model in ``folder`` (written if absent: ``layers`` layers, default
    gpt-oss-20b's 24; tiny with ``small``) and its GGUF twin; returns (config, GGUF
    path).  A folder of another layer count than ``layers`` is an error."""
    from mxfp4x.testing.gpt_oss import write_gpt_oss_model

    if not os.path.exists(os.path.join(folder, "config.json")):
        sizes = dict(bt.SMALL) if small else {}
        if layers:
            sizes["num_hidden_layers"] = layers
        say(f"writing a random gpt-oss checkpoint to {folder}")
        write_gpt_oss_model(folder, progress=lambda d, n: say(f"  file {d}/{n} written"),
                            **sizes)
    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    if layers and cfg["num_hidden_layers"] != layers:
        raise ValueError(f"{folder} holds {cfg['num_hidden_layers']} layers, not {layers}: "
                         f"name another --folder (llama.cpp runs a file's every layer)")
    path = os.path.join(folder, GGUF_NAME)
    if not os.path.exists(path):
        say(f"writing its GGUF twin {path}")
        t0 = time.perf_counter()
        write_gguf(folder, path)
        say(f"  written in {time.perf_counter() - t0:.0f} s")
    worst = check_same_experts(folder, path)
    say(f"the same experts in both files: largest difference {worst:.1e} of the output")
    return cfg, path


# ---------------------------------------------------------------------------------------
# the read floor of a decoding step


def step_bytes(cfg, context):
    """Bytes one decoding step reads with ``context`` tokens in the cache, by the part of
    the step whose time they bound (bench_transformers' clock: the MLP modules, the
    attention modules, the rest), as mxfp4x holds them: the router and the top-k experts'
    MXFP4 blocks and scales (17 bytes per 32 weights) and their bf16 biases; q, k, v, o
    and their biases, the sinks, and the cache's keys and values (bf16; a sliding layer's
    window at most); the norms, one embedding row, the final norm and the head."""
    h, f, e, k = (cfg[key] for key in ("hidden_size", "intermediate_size",
                                        "num_local_experts", "num_experts_per_tok"))
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kinds = cfg["layer_types"][:cfg["num_hidden_layers"]]
    bf16 = 2
    experts = len(kinds) * (k * ((2 * f * h + h * f) * 17 // 32 + (2 * f + h) * bf16)
                            + (e * h + e) * bf16)
    qkv = (nq + 2 * nkv) * hd
    weights = (h * qkv + nq * hd * h + qkv + h + nq) * bf16
    cached = sum(min(context, cfg["sliding_window"]) if kind == "sliding_attention"
                 else context for kind in kinds)
    attention = len(kinds) * weights + cached * 2 * nkv * hd * bf16
    rest = (len(kinds) * 2 * h + h + h + cfg["vocab_size"] * h) * bf16
    return {"experts": experts, "attention": attention, "rest": rest,
            "total": experts + attention + rest}


def read_roofs(threads, small):
    """GB/s read by each thread count (over a buffer larger than the caches)."""
    from mxfp4x.testing.roofline import read_bandwidth

    n_bytes = (1 << 24) if small else (5 << 28)
    return {th: read_bandwidth(th, n_bytes) / 1e9 for th in threads}


# ---------------------------------------------------------------------------------------
# the runs and the table


def _why(failure):
    """The line of a failed process's output that says why: llama.cpp's own error where
    it logged one, else the last."""
    lines = [line.strip() for line in failure.splitlines() if line.strip()]
    said = [line for line in lines if "error loading model:" in line]
    return (said or lines or ["no output"])[-1]


def _median(runs):
    """The figures of several processes of one side: each measured number's median."""
    row = dict(runs[0])
    for key, value in runs[0].items():
        if key in ("threads", "layers"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = statistics.median(r[key] for r in runs)
        elif isinstance(value, dict):
            row[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
    row["processes"] = len(runs)
    return row


def _agreement(a, b):
    """Cosine and top-1 agreement of two logit vectors (.npy files)."""
    x, y = np.load(a).astype(np.float64), np.load(b).astype(np.float64)
    cos = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
    return {"cosine": cos, "top1_same": bool(np.argmax(x) == np.argmax(y))}


def _row_gbps(result, r):
    """The read bandwidth of row r: measured around that row's own processes (the median
    of theirs), else around the whole run."""
    return r.get("read_gbps") or result["read_gbps"][r["threads"]]


def _row_floors(result, r):
    """Each part's read floor for row r: its bytes over :func:`_row_gbps`."""
    gbps = _row_gbps(result, r)
    return {which: {p: b / (gbps * 1e9) for p, b in nb.items()}
            for which, nb in result["step_bytes"].items()}


def table(result):
    """The measured table, as text."""
    rows, prefill = result["rows"], result["prefill"]
    context, sequences = result["context"], result.get("sequences", [])
    head = (f"{'side':<11}{'thr':>4}{'read':>6}{'load s':>8}{'1st s':>7}{'peak GiB':>9}"
            + "".join(f"{'prefill ' + str(n):>13}" for n in prefill)
            + f"{'decode@' + str(prefill[0]):>12}{'x floor':>8}"
            + (f"{'decode@' + str(context):>13}{'x floor':>8}" if context else "")
            + "".join(f"{str(n) + ' seqs':>10}" for n in sequences))
    lines = [head, " " * 15 + f"{'GB/s':>6}" + " " * 24 + f"{'tok/s':>13}" * len(prefill)
             + f"{'tok/s':>12}"
             + (f"{'':>8}{'tok/s':>13}{'':>8}" if context else "")
             + f"{'tok/s':>10}" * len(sequences)]
    for r in rows:
        floors = _row_floors(result, r)
        line = (f"{r['mode']:<11}{r['threads']:>4}{_row_gbps(result, r):>6.1f}{r['load_s']:>8.1f}"
                f"{r['first_forward_s']:>7.1f}{r['peak_bytes'] / 2**30:>9.2f}"
                + "".join(f"{r[f'prefill_{n}_tok_s']:>13.1f}" for n in prefill)
                + f"{r['decode_tok_s']:>12.2f}"
                f"{r['decode_step_s']['total'] / floors['decode']['total']:>8.2f}")
        at = r.get(f"decode_at_{context}_step_s") if context else None
        if at:
            line += f"{1 / at['total']:>13.2f}{at['total'] / floors['context']['total']:>8.2f}"
        elif context:
            line += " " * 21
        line += "".join(f"{r[f'sequences_{n}_tok_s']:>10.1f}" if f"sequences_{n}_tok_s" in r
                        else f"{'-':>10}" for n in sequences)
        lines.append(line)
    lines.append("")
    lines.append("mxfp4x's decoding step, ms (x its read floor): experts (with the router) / "
                 "attention / rest = a step under the split's hooks")
    for r in rows:
        if not r["mode"].startswith("mxfp4x"):
            continue
        floors = _row_floors(result, r)
        for which, key in (("decode", "decode_step_s"),
                           ("context", f"decode_at_{context}_step_s")):
            step = r.get(key)
            if not step:
                continue
            parts = [f"{1e3 * step[p]:.1f} ({step[p] / floors[which][f]:.2f}x)"
                     for p, f in (("experts", "experts"), ("attention", "attention"),
                                  ("rest", "rest"), ("clocked", "total"),
                                  ("total", "total")) if p in step]
            at = result["contexts"][which]
            lines.append(f"  {r['mode']}, {r['threads']} thr, context {at}: "
                         + " / ".join(parts[:3]) + " = " + parts[3]
                         + (f" (without the clock {parts[4]})" if len(parts) > 4 else ""))
    nbytes = result["step_bytes"]["decode"]
    read = ", ".join(f"{th} thr {g:.1f} GB/s" for th, g in result["read_gbps"].items())
    lines.append(f"read bandwidth: around each process (the read column; x floor is against "
                 f"it), around the run {read}; a step at context {result['contexts']['decode']} "
                 f"reads experts {nbytes['experts'] / 1e6:.1f} MB, attention "
                 f"{nbytes['attention'] / 1e6:.1f} MB, rest {nbytes['rest'] / 1e6:.1f} MB")
    for th, agree in result["agreement"].items():
        lines.append(f"same model, {th} thr: last-token logits of the first forward, cosine "
                     f"{agree['cosine']:.5f}, top-1 {'same' if agree['top1_same'] else 'differs'}")
    if result["llama_skipped"]:
        lines.append(f"llama.cpp: skipped ({result['llama_skipped']})")
    return "\n".join(lines)


def run(folder, layers=None, threads=(1, 2), repeats=2, prefill=PREFILL, decode=DECODE,
        context=0, small=False, sequences=SEQUENCES, isas=()):
    """Write the model if ``folder`` has none, measure both sides, print the table and
    return the result (every process's figures in ``runs``, each side's medians in
    ``rows``).  ``isas``: more mxfp4x sides, each with that ISA for every call of its
    process (``mxfp4x:amx``: ``MXFP4X_ISA=amx``)."""
    from mxfp4x.testing.roofline import cpu_model

    sides = ("mxfp4x",) + tuple(f"mxfp4x:{isa}" for isa in isas) + ("llama.cpp",)
    cfg, path = prepare(folder, layers, small)
    threads = [th for th in threads if th <= (os.cpu_count() or 1)] or [1]
    prefill = list(prefill)
    roofs = read_roofs(threads, small)
    skipped = llama_missing()
    if skipped:
        say(f"llama.cpp: skipped ({skipped})")
    runs, agreement = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for th in threads:
            for rep in range(repeats):
                logits = {}
                for side in sides:
                    if side == "llama.cpp" and skipped:
                        continue
                    kw = dict(prefill=prefill, decode=decode, context=context,
                              sequences=list(sequences))
                    if rep == 0:
                        kw["logits_path"] = logits[side] = os.path.join(tmp, f"{side}-{th}.npy")
                    say(f"measuring {side}, {th} thread(s), process {rep + 1} of {repeats}")
                    before = read_roofs([th], small)[th]
                    try:
                        if side.startswith("mxfp4x"):
                            if side != "mxfp4x":
                                kw["isa"] = side.split(":")[1]
                            r = bt.in_fresh_process("bench_transformers", "measure", folder,
                                                    "mxfp4x", cfg["num_hidden_layers"],
                                                    threads=th, **kw)
                            r["mode"] = side
                        else:
                            r = bt.in_fresh_process("generate_sides", "measure_llama", path,
                                                    th, **kw)
                    except RuntimeError as exc:
                        if side != "llama.cpp":
                            raise
                        skipped = f"it could not run {path}: {_why(str(exc))}"
                        say(f"llama.cpp: skipped ({skipped})")
                        continue
                    # the bandwidth of that minute: a shared host's moves by up to 2x
                    r["read_gbps"] = max(before, read_roofs([th], small)[th])
                    runs.append(r)
                if ("llama.cpp" in logits
                        and all(os.path.exists(logits[k]) for k in ("mxfp4x", "llama.cpp"))):
                    agreement[th] = _agreement(logits["mxfp4x"], logits["llama.cpp"])
    after = read_roofs(threads, small)
    roofs = {th: max(roofs[th], after[th]) for th in threads}
    contexts = {"decode": prefill[0] + decode // 2, "context": context + 8}
    nbytes = {which: step_bytes(cfg, at) for which, at in contexts.items()}
    floors = {str(th): {which: {p: b / (roofs[th] * 1e9) for p, b in nb.items()}
                        for which, nb in nbytes.items()} for th in threads}
    rows = [_median([r for r in runs if r["mode"] == side and r["threads"] == th])
            for th in threads for side in sides
            if any(r["mode"] == side and r["threads"] == th for r in runs)]
    result = {"cpu": cpu_model(), "config": {k: cfg[k] for k in (
                  "num_hidden_layers", "hidden_size", "intermediate_size", "num_local_experts",
                  "num_experts_per_tok", "vocab_size")},
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "prefill": prefill, "decode": decode, "context": context,
              "sequences": list(sequences), "sequence_prompt": bt.SEQUENCE_PROMPT,
              "contexts": contexts, "read_gbps": roofs, "step_bytes": nbytes,
              "floors": floors, "agreement": agreement, "llama_skipped": skipped,
              "rows": rows, "runs": runs}
    say(f"\nCPU: {result['cpu'].get('model', '?')}; gpt-oss, {cfg['num_hidden_layers']} "
        f"layers of width {cfg['hidden_size']}, {cfg['num_local_experts']} experts, "
        f"bfloat16; medians of {repeats} processes a side")
    say(table(result))
    return result


def test_generate_end_to_end(benchmark, tmp_path):
    small = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
    if small:
        folder, kw = str(tmp_path / "gpt-oss"), dict(small=True, threads=(1,), repeats=1,
                                                     **SMALL_RUN)
    else:
        folder, kw = default_folder(4), dict(layers=4)
    result = benchmark.pedantic(run, args=(folder,), kwargs=kw, rounds=1)
    ours = [r for r in result["rows"] if r["mode"] == "mxfp4x"]
    assert ours and all(r["decode_tok_s"] > 0 for r in ours)
    assert min(ours[0]["decode_step_s"].values()) >= 0
    assert all(r[f"sequences_{n}_tok_s"] > 0 for r in ours for n in kw.get("sequences",
                                                                          SEQUENCES))
    if llama_missing() is None and not result["llama_skipped"]:
        assert any(r["mode"] == "llama.cpp" for r in result["rows"])
        # the same model on both sides: 1 - cosine 2e-5 on the tiny model (llama.cpp rounds
        # the experts' inputs to 8 bits), 2e-2 with the experts' nibbles in gpt-oss's order
        assert all(a["cosine"] > 0.999 for a in result["agreement"].values()), \
            result["agreement"]
    benchmark.extra_info.update({k: result[k] for k in ("rows", "agreement", "read_gbps",
                                                        "llama_skipped")})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None,
                   help="layers of the model, of the real width (default: all 24; the tiny "
                        "model's 2 with MXFP4X_BENCH_SMALL=1)")
    p.add_argument("--folder", default=None,
                   help="where the model is (written there if absent; default "
                        "~/.cache/mxfp4x-gpt-oss-20b-random[-N-layers])")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=2,
                   help="processes of each side for each thread count, alternated")
    p.add_argument("--prefill", type=int, nargs="+", default=list(PREFILL),
                   help="prompt lengths timed (default 128 512; add 2048 for a long one)")
    p.add_argument("--decode", type=int, default=DECODE,
                   help="greedy decoding steps after a prompt of the first prefill length")
    p.add_argument("--context", type=int, default=0,
                   help="also time 16 decoding steps after a prompt of this many tokens "
                        "(e.g. 4096)")
    p.add_argument("--sequences", type=int, nargs="*", default=list(SEQUENCES),
                   help=f"also decode this many sequences together, each after a prompt of "
                        f"{bt.SEQUENCE_PROMPT} tokens (default 8 32; none: --sequences)")
    p.add_argument("--isa", nargs="*", default=[],
                   help="more mxfp4x sides, each with this ISA (MXFP4X_ISA) for every call "
                        "of its processes (e.g. amx)")
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.add_argument("--plot", default=None,
                   help="also plot tokens/s against the context and against the sequences "
                        "to this file (.png, .svg, ...; needs matplotlib)")
    args = p.parse_args(argv)
    if args.plot:
        import importlib.util as iu
        if iu.find_spec("matplotlib") is None:
            p.error("argument --plot: needs matplotlib (pip install matplotlib)")
    small = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
    folder = args.folder or default_folder(args.layers or bt.TOTAL_LAYERS)
    if small and not args.folder:
        folder = tempfile.mkdtemp(prefix="mxfp4x-gpt-oss-small-")
    result = run(folder, args.layers, args.threads, args.repeats, args.prefill,
                 args.decode, args.context, small=small, sequences=args.sequences,
                 isas=args.isa)
    if args.json:
        from mxfp4x._core.files import atomic_write
        with atomic_write(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
