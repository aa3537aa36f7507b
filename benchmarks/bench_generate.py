"""gpt-oss generating end to end on a CPU: mxfp4x's transformers door beside llama.cpp,
on the same random weights.

    python benchmarks/bench_generate.py [--layers N] [--threads 1 2] [--repeats 2]
        [--prefill 128 512 [2048]] [--decode 32] [--context 4096] [--json out.json]

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
tokens), each side's figures the median of its ``--repeats`` processes; for mxfp4x, a
decoding step's time split (the experts, the attention, the rest: router, norms,
embedding, head) against its read floor: the bytes that part of the step reads (the
selected experts' MXFP4 blocks and their biases; the attention's weights and its cache;
the router, the norms, one embedding row and the head; as mxfp4x holds them) over the
read bandwidth measured in the same run (``mxfp4x.testing.roofline.read_bandwidth``,
before and after the measurements, the better).  Both sides' last-token logits of the
first forward are compared (cosine, top-1): the same model, not just the same sizes.

Under pytest (``pytest benchmarks``) one case runs it on a tiny model with one thread and
one repeat with ``MXFP4X_BENCH_SMALL=1`` (CI's smoke run), on 4 layers of the real width
otherwise.
"""
import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
PREFILL, DECODE, UBATCH = bt.PREFILL, bt.DECODE, 512
SMALL_RUN = dict(prefill=(16, 32), decode=4)
SIDES = ("mxfp4x", "llama.cpp")


def default_folder(layers):
    """Where the random model of ``layers`` layers is kept (all 24: bench_transformers'
    checkpoint, written once for both)."""
    name = "mxfp4x-gpt-oss-20b-random" + ("" if layers == bt.TOTAL_LAYERS else
                                          f"-{layers}-layers")
    return os.path.join(os.path.expanduser("~"), ".cache", name)


# ---------------------------------------------------------------------------------------
# the GGUF file


def _gguf_entries(ckpt, cfg):
    """(GGUF name, numpy shape, numpy dtype, GGML type or None, make) of every tensor, in
    the order written; ``make()`` gives the data (views of the checkpoint's mapping where
    the bytes are kept as they are).  Names and types as llama.cpp's converter gives them
    (gguf's tensor map for gpt-oss; gate and up split from gate_up's interleaved rows;
    1-D tensors, norms, biases and the router float32, the other weights bf16)."""
    import gguf
    import torch

    from mxfp4x.models.gpt_oss import tensor_names
    from mxfp4x.testing.layers import gguf_blocks_of

    n_layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, n_layers)
    experts = {layer: tensor_names("", layer) for layer in range(n_layers)}
    skip = {n for t in experts.values() for n in t.values()}
    out = []

    def dense(name):
        new = names.get_name(name + ".weight" if name.endswith("sinks") else name,
                             try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"{name}: no GGUF name for it in gguf's tensor map of gpt-oss")
        shape = ckpt.shape(name)
        if len(shape) <= 1 or new.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight")):
            out.append((new, shape, np.float32, None,
                        lambda: ckpt.get(name).float().numpy()))
        else:  # the bf16 bytes as they are
            out.append((new, shape[:-1] + (2 * shape[-1],), np.uint8,
                        gguf.GGMLQuantizationType.BF16,
                        lambda: ckpt.get(name).view(torch.uint8).numpy()))

    def blocks(name_b, name_s, rows, new):
        e, o, g, _ = ckpt.shape(name_b)
        o = len(range(o)[rows])

        def make():
            b, s = ckpt.get(name_b)[:, rows], ckpt.get(name_s)[:, rows]
            data = np.empty((e, o, g * 17), np.uint8)
            for i in range(e):  # an expert at a time: the memory of one
                data[i] = gguf_blocks_of(b[i].numpy(), s[i].numpy()).reshape(o, g * 17)
            return data
        out.append((new, (e, o, g * 17), np.uint8, gguf.GGMLQuantizationType.MXFP4, make))

    def bias(name, rows, new):
        shape = ckpt.shape(name)
        out.append((new, (shape[0], len(range(shape[1])[rows])), np.float32, None,
                    lambda: ckpt.get(name)[:, rows].float().numpy()))

    order = sorted(n for n in ckpt.keys() if n not in skip)
    for name in order:
        if ".layers." not in name and "lm_head" not in name and "model.norm" not in name:
            dense(name)  # the embedding first
    for layer in range(n_layers):
        for name in order:
            if f".layers.{layer}." in name:
                dense(name)
        t = experts[layer]
        for role, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
            blocks(t["gate_up_blocks"], t["gate_up_scales"], rows,
                   f"blk.{layer}.ffn_{role}_exps.weight")
            bias(t["gate_up_bias"], rows, f"blk.{layer}.ffn_{role}_exps.bias")
        blocks(t["down_blocks"], t["down_scales"], slice(None), f"blk.{layer}.ffn_down_exps.weight")
        bias(t["down_bias"], slice(None), f"blk.{layer}.ffn_down_exps.bias")
    for name in order:
        if "lm_head" in name or "model.norm" in name:
            dense(name)
    return out


def _tokenizer_metadata(w, folder, cfg):
    """The checkpoint's tokenizer as llama.cpp reads a gpt-oss one ("gpt2" BPE, gpt-oss's
    pre-tokenizer "gpt-4o"): every token by id, special ones CONTROL, the special ids."""
    import gguf

    with open(os.path.join(folder, "tokenizer.json")) as fh:
        tok = json.load(fh)
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [int(gguf.TokenType.UNUSED)] * cfg["vocab_size"]
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
    for t in tok.get("added_tokens", []):
        tokens[t["id"]] = t["content"]
        types[t["id"]] = int(gguf.TokenType.CONTROL if t.get("special") else
                             gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # llama.cpp refuses a BPE vocabulary without merges, and gguf's writer leaves an empty
    # list out: the random tokenizer has none, so one (of two byte symbols) stands in
    merges = tok["model"].get("merges") or ["\u0120 \u0120"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])


# the hyperparameters llama.cpp reads of a gpt-oss file (its load_hparams and
# llama_model_openai_moe's), as the converter writes them: gguf writer method, config key
_METADATA = (("add_block_count", "num_hidden_layers"),
             ("add_context_length", "max_position_embeddings"),
             ("add_embedding_length", "hidden_size"),
             ("add_feed_forward_length", "intermediate_size"),
             ("add_expert_feed_forward_length", "intermediate_size"),
             ("add_head_count", "num_attention_heads"),
             ("add_head_count_kv", "num_key_value_heads"),
             ("add_key_length", "head_dim"), ("add_value_length", "head_dim"),
             ("add_layer_norm_rms_eps", "rms_norm_eps"),
             ("add_expert_count", "num_local_experts"),
             ("add_expert_used_count", "num_experts_per_tok"),
             ("add_sliding_window", "sliding_window"))


def write_gguf(folder, path):
    """The GGUF file llama.cpp's converter (``convert_hf_to_gguf.py``, class GptOssModel)
    makes of the gpt-oss checkpoint in ``folder``, written with the ``gguf`` package
    (llama.cpp's own writer) one tensor at a time, to a temporary file renamed to
    ``path`` when complete."""
    import gguf

    from mxfp4x.checkpoints import SafeTensorsCheckpoint

    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    ckpt = SafeTensorsCheckpoint(folder)
    entries = _gguf_entries(ckpt, cfg)
    w = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    w.add_name("gpt-oss random weights (mxfp4x benchmark)")
    for method, key in _METADATA:
        getattr(w, method)(cfg[key])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if key in rope:
                add(rope[key])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta")))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer_metadata(w, folder, cfg)
    for name, shape, dtype, raw, _ in entries:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    part = path + ".part"
    try:
        w.write_header_to_file(Path(part))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, _, _, _, make in entries:
            w.write_tensor_data(make())
        w.close()
        os.replace(part, path)
    finally:
        w.close()
        if os.path.exists(part):
            os.remove(part)


def check_same_experts(folder, path, tokens=4, seed=0):
    """The first and last layer's experts read by mxfp4x from both files, on the same
    tokens and routing, agree (the arrangements differ, so within float32 rounding, not
    bit for bit): returns the largest difference relative to the largest output."""
    import torch

    from mxfp4x.nn import GptOssExperts

    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for layer in sorted({0, cfg["num_hidden_layers"] - 1}):
        a = GptOssExperts.from_checkpoint(folder, layer)
        b = GptOssExperts.from_checkpoint(path, layer)
        x = torch.randn(tokens, cfg["hidden_size"], generator=gen)
        idx = torch.stack([torch.randperm(cfg["num_local_experts"], generator=gen)[
            :cfg["num_experts_per_tok"]] for _ in range(tokens)])
        p = torch.softmax(torch.randn(idx.shape, generator=gen), -1)
        ya, yb = a(x, idx, p), b(x, idx, p)
        worst = max(worst, float((ya - yb).abs().max() / ya.abs().max()))
    if not worst <= 1e-4:
        raise AssertionError(f"{path}: its experts differ from {folder}'s by {worst:.3g} "
                             f"of the largest output")
    return worst


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
# llama.cpp's side (in its own process)


def measure_llama(path, threads, prefill=PREFILL, decode=DECODE, context=0, logits_path=None):
    """One process's figures of llama.cpp on the GGUF file ``path``, the same
    measurements as bench_transformers' ``measure`` (the same token ids, a fresh cache
    for each prefill, greedy decoding)."""
    import llama_cpp

    prefill = tuple(prefill)
    longest = max(prefill + (context,))
    n_ctx = -(-(longest + max(decode, 16) + 1) // 256) * 256
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=max(longest, UBATCH),
                          n_ubatch=UBATCH, n_threads=threads, n_threads_batch=threads,
                          flash_attn=True, verbose=True)
    load_s = time.perf_counter() - t0
    load_peak = bt._rss_peak()
    vocab = llm.n_vocab()
    ids = bt.prompts(vocab, prefill, (prefill[0], context))

    def logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                     shape=(vocab,))

    def forward(tokens):
        llm.reset()  # a new sequence: the cache from position 0
        llm.eval(tokens)

    out = {"mode": "llama.cpp", "layers": int(llm.metadata["gpt-oss.block_count"]),
           "dtype": "gguf", "load_s": load_s, "load_peak_bytes": load_peak,
           "threads": threads, "attention": "flash", "version": llama_cpp.__version__}
    t0 = time.perf_counter()
    forward(ids["first"])
    out["first_forward_s"] = time.perf_counter() - t0
    if logits_path:
        np.save(logits_path, logits().copy())
    for n in prefill:
        t0 = time.perf_counter()
        forward(ids["prefill"][n])
        out[f"prefill_{n}_tok_s"] = n / (time.perf_counter() - t0)
    for n, steps, key in ((prefill[0], decode, "decode_step_s"),
                          (context, 16, f"decode_at_{context}_step_s")):
        if n:
            forward(ids["decode"][n])
            t0 = time.perf_counter()
            for _ in range(steps):
                llm.eval([int(np.argmax(logits()))])
            out[key] = {"total": (time.perf_counter() - t0) / steps}
    out["decode_tok_s"] = 1 / out["decode_step_s"]["total"]
    out["peak_bytes"] = bt._rss_peak()
    return out


def llama_missing():
    """Why llama.cpp's side cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed: pip install llama-cpp-python"
    return None


# ---------------------------------------------------------------------------------------
# the read floor of a decoding step


def step_bytes(cfg, context):
    """Bytes one decoding step reads with ``context`` tokens in the cache, by the part of
    the step whose time they bound (bench_transformers' clock: the experts modules, the
    attention modules, the rest), as mxfp4x holds them: the top-k experts' MXFP4 blocks
    and scales (17 bytes per 32 weights) and their bf16 biases; q, k, v, o and their
    biases, the sinks, and the cache's keys and values (bf16; a sliding layer's window
    at most); the router, the norms, one embedding row, the final norm and the head."""
    h, f, e, k = (cfg[key] for key in ("hidden_size", "intermediate_size",
                                        "num_local_experts", "num_experts_per_tok"))
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kinds = cfg["layer_types"][:cfg["num_hidden_layers"]]
    bf16 = 2
    experts = len(kinds) * k * ((2 * f * h + h * f) * 17 // 32 + (2 * f + h) * bf16)
    qkv = (nq + 2 * nkv) * hd
    weights = (h * qkv + nq * hd * h + qkv + h + nq) * bf16
    cached = sum(min(context, cfg["sliding_window"]) if kind == "sliding_attention"
                 else context for kind in kinds)
    attention = len(kinds) * weights + cached * 2 * nkv * hd * bf16
    rest = (len(kinds) * (e * h + e + 2 * h) + h + h + cfg["vocab_size"] * h) * bf16
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


def table(result):
    """The measured table, as text."""
    rows, prefill = result["rows"], result["prefill"]
    context = result["context"]
    head = (f"{'side':<11}{'thr':>4}{'load s':>8}{'1st s':>7}{'peak GiB':>9}"
            + "".join(f"{'prefill ' + str(n):>13}" for n in prefill)
            + f"{'decode@' + str(prefill[0]):>12}{'x floor':>8}"
            + (f"{'decode@' + str(context):>13}{'x floor':>8}" if context else ""))
    lines = [head, " " * 39 + f"{'tok/s':>13}" * len(prefill) + f"{'tok/s':>12}"
             + (f"{'':>8}{'tok/s':>13}" if context else "")]
    for r in rows:
        floors = result["floors"][str(r["threads"])]
        line = (f"{r['mode']:<11}{r['threads']:>4}{r['load_s']:>8.1f}"
                f"{r['first_forward_s']:>7.1f}{r['peak_bytes'] / 2**30:>9.2f}"
                + "".join(f"{r[f'prefill_{n}_tok_s']:>13.1f}" for n in prefill)
                + f"{r['decode_tok_s']:>12.2f}"
                f"{r['decode_step_s']['total'] / floors['decode']['total']:>8.2f}")
        at = r.get(f"decode_at_{context}_step_s") if context else None
        if at:
            line += f"{1 / at['total']:>13.2f}{at['total'] / floors['context']['total']:>8.2f}"
        lines.append(line)
    lines.append("")
    lines.append("mxfp4x's decoding step, ms (x its read floor): experts / attention / rest "
                 "= total")
    for r in rows:
        if r["mode"] != "mxfp4x":
            continue
        floors = result["floors"][str(r["threads"])]
        for which, key in (("decode", "decode_step_s"),
                           ("context", f"decode_at_{context}_step_s")):
            step = r.get(key)
            if not step:
                continue
            parts = [f"{1e3 * step[p]:.1f} ({step[p] / floors[which][p]:.2f}x)"
                     for p in ("experts", "attention", "rest", "total")]
            at = result["contexts"][which]
            lines.append(f"  {r['threads']} thr, context {at}: " + " / ".join(parts[:3])
                         + " = " + parts[3])
    nbytes = result["step_bytes"]["decode"]
    read = ", ".join(f"{th} thr {g:.1f} GB/s" for th, g in result["read_gbps"].items())
    lines.append(f"read floor: {read}; a step at context {result['contexts']['decode']} "
                 f"reads experts {nbytes['experts'] / 1e6:.1f} MB, attention "
                 f"{nbytes['attention'] / 1e6:.1f} MB, rest {nbytes['rest'] / 1e6:.1f} MB")
    for th, agree in result["agreement"].items():
        lines.append(f"same model, {th} thr: last-token logits of the first forward, cosine "
                     f"{agree['cosine']:.5f}, top-1 {'same' if agree['top1_same'] else 'differs'}")
    if result["llama_skipped"]:
        lines.append(f"llama.cpp: skipped ({result['llama_skipped']})")
    return "\n".join(lines)


def run(folder, layers=None, threads=(1, 2), repeats=2, prefill=PREFILL, decode=DECODE,
        context=0, small=False):
    """Write the model if ``folder`` has none, measure both sides, print the table and
    return the result (every process's figures in ``runs``, each side's medians in
    ``rows``)."""
    from mxfp4x.testing.roofline import cpu_model

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
                for side in SIDES:
                    if side == "llama.cpp" and skipped:
                        continue
                    kw = dict(prefill=prefill, decode=decode, context=context)
                    if rep == 0:
                        kw["logits_path"] = logits[side] = os.path.join(tmp, f"{side}-{th}.npy")
                    say(f"measuring {side}, {th} thread(s), process {rep + 1} of {repeats}")
                    try:
                        if side == "mxfp4x":
                            r = bt.in_fresh_process("bench_transformers", "measure", folder,
                                                    "mxfp4x", cfg["num_hidden_layers"],
                                                    threads=th, **kw)
                        else:
                            r = bt.in_fresh_process("bench_generate", "measure_llama", path,
                                                    th, **kw)
                    except RuntimeError as exc:
                        if side == "mxfp4x":
                            raise
                        skipped = f"it could not run {path}: {_why(str(exc))}"
                        say(f"llama.cpp: skipped ({skipped})")
                        continue
                    runs.append(r)
                if len(logits) == 2 and all(os.path.exists(p) for p in logits.values()):
                    agreement[th] = _agreement(logits["mxfp4x"], logits["llama.cpp"])
    after = read_roofs(threads, small)
    roofs = {th: max(roofs[th], after[th]) for th in threads}
    contexts = {"decode": prefill[0] + decode // 2, "context": context + 8}
    nbytes = {which: step_bytes(cfg, at) for which, at in contexts.items()}
    floors = {str(th): {which: {p: b / (roofs[th] * 1e9) for p, b in nb.items()}
                        for which, nb in nbytes.items()} for th in threads}
    rows = [_median([r for r in runs if r["mode"] == side and r["threads"] == th])
            for th in threads for side in SIDES
            if any(r["mode"] == side and r["threads"] == th for r in runs)]
    result = {"cpu": cpu_model(), "config": {k: cfg[k] for k in (
                  "num_hidden_layers", "hidden_size", "intermediate_size", "num_local_experts",
                  "num_experts_per_tok", "vocab_size")},
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "prefill": prefill, "decode": decode, "context": context,
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
    p.add_argument("--json", default=None, help="also write the result to this file")
    args = p.parse_args(argv)
    small = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
    folder = args.folder or default_folder(args.layers or bt.TOTAL_LAYERS)
    if small and not args.folder:
        folder = tempfile.mkdtemp(prefix="mxfp4x-gpt-oss-small-")
    result = run(folder, args.layers, args.threads, args.repeats, args.prefill,
                 args.decode, args.context, small=small)
    if args.json:
        from mxfp4x._core.files import atomic_write
        with atomic_write(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
