"""gpt-oss-20b in Hugging Face transformers on a CPU, experts kept MXFP4 on mxfp4x, beside
transformers' own path (which dequantizes the experts at load).

    python benchmarks/bench_transformers.py [--folder DIR] [--context N] [--json out.json]

writes (once) a checkpoint of gpt-oss-20b's configuration with random weights in the
released layout (13 GB, streamed to disk one tensor at a time), then, each measurement in
a fresh process:

* mxfp4x, all 24 layers: load time (``from_pretrained``, then a first forward of 128
  tokens, which reads what transformers mapped lazily), peak RSS, prefill tokens/s at
  128 and 512 tokens, decode tokens/s over 32 tokens, and where a decode step's time
  goes (the experts with their router, the attention, the rest: norms, embeddings, the
  head);
* transformers' own load and mxfp4x at the largest layer count whose dequantized experts
  fit this machine's memory, and transformers' figures scaled per layer to 24 layers
  (labelled "scaled": its experts and attention times per layer times 24, plus its rest);
* with ``--context N``, in each of those processes, 16 decoding steps after a prompt of N
  tokens (attention grows with the context; gpt-oss runs ``mxfp4x_grouped`` attention
  under mxfp4x and transformers' eager one on its own path).

Under pytest (``pytest benchmarks``) one case runs the same measurements on a tiny model
with ``MXFP4X_BENCH_SMALL=1`` (CI's smoke run), the full run otherwise.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

TOTAL_LAYERS = 24
PREFILL = (128, 512)
DECODE = 32
# several sequences decoding together (a server's case): each one's prompt, then the steps
SEQUENCE_PROMPT, SEQUENCE_STEPS = 64, 8
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_local_experts=4,
             vocab_size=288, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             sliding_window=8)


def say(*parts):
    print(*parts, flush=True)


def _rss_peak():
    """VmHWM, this process image's peak (ru_maxrss carries over the forking parent's)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh
                        if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Clock:
    """Wall time spent inside modules of two kinds (forward hooks, attached while the clock
    is entered as a context), per forward: the experts (each layer's MLP module: its
    router and its experts; hooks on the modules inside it would send the door's decoding
    steps back to their pieces) and the attention (each layer's attention module).  A
    hook on those modules also sends the door's decoder layers (``DecodeLayer``) back to
    transformers' forward, so the step's total is timed without the clock."""

    def __init__(self, model):
        self.spent = {"experts": 0.0, "attention": 0.0}
        self._start = {}
        self._timed = [(name, module, "experts" if name.endswith(".mlp") else "attention")
                       for name, module in model.named_modules()
                       if name.endswith(".mlp") or name.endswith("self_attn")]
        self._handles = []

    def __enter__(self):
        for name, module, kind in self._timed:
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave(name, kind)))
        self.spent = dict.fromkeys(self.spent, 0.0)
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, name):
        def hook(module, args):
            self._start[name] = time.perf_counter()
        return hook

    def _leave(self, name, kind):
        def hook(module, args, out):
            self.spent[kind] += time.perf_counter() - self._start.pop(name)
        return hook


def _greedy(logits):
    """The next token of each sequence, as ``generate`` picks it greedily: the last
    position's logits in float32 (bfloat16 ones cast first, as ``generate`` does), their
    largest."""
    return logits[:, -1].float().argmax(-1, keepdim=True)


def _decode(model, clock, cache, token, steps, split=True):
    """``steps`` greedy decoding steps from ``cache``: seconds per step (``total``); with
    ``split``, ``steps`` more under the clock (``clocked`` seconds per step) and their
    split: the experts, the attention and the rest of a clocked step."""

    def run(cache, token):
        t0 = time.perf_counter()
        for _ in range(steps):
            step = model(token, past_key_values=cache, use_cache=True)
            cache, token = step.past_key_values, _greedy(step.logits)
        return (time.perf_counter() - t0) / steps, cache, token

    total, cache, token = run(cache, token)
    if not split:
        return {"total": total}
    with clock:
        clocked = run(cache, token)[0]
    per_step = {k: v / steps for k, v in clock.spent.items()}
    per_step["rest"] = clocked - sum(per_step.values())
    return {"total": total, "clocked": clocked, **per_step}


def prompts(vocab, prefill, contexts, sequences=()):
    """The token ids of one process's measurements, the same for every side and process
    (numpy's generator, seed 0): ``first`` (the first forward, ``prefill[0]`` tokens),
    ``prefill`` (n -> n ids), ``decode`` (context -> the prompt its decoding steps
    follow; contexts of 0 are left out) and ``sequences`` (s -> s prompts of
    SEQUENCE_PROMPT tokens, decoded together)."""
    import numpy as np

    rng = np.random.default_rng(0)

    def draw(n):
        return rng.integers(0, vocab, n).tolist()
    return {"first": draw(prefill[0]), "prefill": {n: draw(n) for n in prefill},
            "decode": {n: draw(n) for n in contexts if n},
            "sequences": {s: [draw(SEQUENCE_PROMPT) for _ in range(s)] for s in sequences}}


def measure(folder, mode, layers, dtype="bfloat16", prefill=PREFILL, decode=DECODE,
            context=0, threads=None, logits_path=None, sequences=(), isa=None):
    """One process's figures: load ``folder`` with ``layers`` layers through ``mode``
    (``mxfp4x`` or ``transformers``) and time prefills and a greedy decode; with
    ``context``, also 16 decoding steps after a prompt of that many tokens; for each s of
    ``sequences``, SEQUENCE_STEPS steps of s sequences decoded together after their
    prompts (one batch).  ``threads``: torch's (and so mxfp4x's) threads;
    ``logits_path``: where the first forward's last-token logits are saved (float32
    ``.npy``), to compare sides; ``isa``: mxfp4x's ISA for the process (``MXFP4X_ISA``,
    set before mxfp4x is imported)."""
    if isa:
        os.environ["MXFP4X_ISA"] = isa
    import numpy as np
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = layers
    config.layer_types = config.layer_types[:layers]
    kwargs = dict(config=config, dtype=getattr(torch, dtype))
    t0 = time.perf_counter()
    if mode == "mxfp4x":
        import mxfp4x.integrations.transformers as mxt
        model = mxt.from_pretrained(folder, **kwargs)
    else:
        if (getattr(config, "quantization_config", None) or {}).get("quant_method") == "mxfp4":
            # dequantized, as on a CPU, even where Triton is installed (transformers would
            # then fetch kernels from the Hub)
            kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    load_s = time.perf_counter() - t0
    load_peak = _rss_peak()
    model.eval()
    # the cache generate makes for the model: the door's grows in place (GrowingCache),
    # transformers' is its DynamicCache
    new_cache = mxt.GrowingCache if mode == "mxfp4x" else transformers.DynamicCache
    clock = _Clock(model)
    ids = prompts(model.config.vocab_size, prefill, (prefill[0], context), sequences)
    out = {"mode": mode, "layers": layers, "dtype": dtype, "load_s": load_s,
           "load_peak_bytes": load_peak, "threads": torch.get_num_threads()}
    with torch.no_grad():
        # the first forward reads the weights transformers mapped lazily: part of loading
        # (as many tokens as the first prefill, so that every expert has been read)
        t0 = time.perf_counter()
        first = model(torch.tensor([ids["first"]]), logits_to_keep=1)
        out["first_forward_s"] = time.perf_counter() - t0
        if logits_path:
            np.save(logits_path, first.logits[0, -1].float().numpy())
        for n in prefill:
            t0 = time.perf_counter()
            model(torch.tensor([ids["prefill"][n]]), use_cache=True, logits_to_keep=1)
            out[f"prefill_{n}_tok_s"] = n / (time.perf_counter() - t0)
        for n, steps, key in ((prefill[0], decode, "decode_step_s"),
                              (context, 16, f"decode_at_{context}_step_s")):
            if n:
                step = model(torch.tensor([ids["decode"][n]]), use_cache=True,
                             cache=new_cache(config=model.config), logits_to_keep=1)
                out[key] = _decode(model, clock, step.past_key_values,
                                   _greedy(step.logits), steps)
        for n_seq, batch in ids["sequences"].items():  # one batch, every prompt as long
            step = model(torch.tensor(batch), use_cache=True,
                         cache=new_cache(config=model.config), logits_to_keep=1)
            out[f"sequences_{n_seq}_step_s"] = _decode(
                model, clock, step.past_key_values,
                _greedy(step.logits), SEQUENCE_STEPS, split=False)
            out[f"sequences_{n_seq}_tok_s"] = n_seq / out[f"sequences_{n_seq}_step_s"]["total"]
    out["decode_tok_s"] = 1 / out["decode_step_s"]["total"]
    out["attention"] = model.config._attn_implementation
    out["peak_bytes"] = _rss_peak()
    return out


def in_fresh_process(module, function, *args, **kw):
    """``function(*args, **kw)`` of ``module`` (a file of benchmarks/) in a fresh Python
    process (its own peak RSS, nothing left mapped by an earlier measurement): arguments
    and result go as JSON, the result as the last line the process prints."""
    code = ("import importlib, json, sys; sys.path.insert(0, sys.argv[1]); "
            "f = getattr(importlib.import_module(sys.argv[2]), sys.argv[3]); "
            "print(json.dumps(f(*json.loads(sys.argv[4]), **json.loads(sys.argv[5]))))")
    run = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(
        __file__)), module, function, json.dumps(args), json.dumps(kw)], capture_output=True,
        text=True)
    if run.returncode:
        raise RuntimeError(f"{module}.{function}{tuple(args)} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _in_process(folder, mode, layers, **kw):
    """``measure`` in a fresh process (its own peak RSS)."""
    return in_fresh_process("bench_transformers", "measure", folder, mode, layers, **kw)


def _available_bytes():
    with open("/proc/meminfo") as fh:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
    return info["MemAvailable"]


def baseline_layers(config, dtype_bytes=2):
    """The most layers whose dequantized experts (and a load-time copy of one layer)
    fit in 60% of the memory available now, at least 1."""
    e, h, f = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    per_layer = e * 3 * h * f * dtype_bytes
    dense = 2 * config["vocab_size"] * h * dtype_bytes
    return max(1, min(TOTAL_LAYERS, int((0.6 * _available_bytes() - dense) // per_layer) - 1))


def scaled(result, layers):
    """transformers' figures at ``result['layers']`` scaled per layer to ``layers``: the
    experts' and attention's times per layer times ``layers``, plus the rest as measured."""
    k = layers / result["layers"]
    step = result["decode_step_s"]
    new = {"experts": step["experts"] * k, "attention": step["attention"] * k,
           "rest": step["rest"]}
    new["total"] = sum(new.values())
    return {"mode": "transformers (scaled)", "layers": layers,
            "decode_tok_s": 1 / new["total"], "decode_step_s": new}


def table(rows):
    lines = [f"{'path':<24}{'layers':>7}{'load s':>8}{'1st s':>7}{'peak GiB':>9}"
             f"{'prefill 128':>12}{'prefill 512':>12}{'decode':>8}   decode step ms: "
             f"experts / attention / rest",
             f"{'':<24}{'':>7}{'':>8}{'':>7}{'':>9}{'tok/s':>12}{'tok/s':>12}{'tok/s':>8}"]
    for r in rows:
        s = r["decode_step_s"]

        def num(key, fmt, r=r):
            return format(r[key], fmt) if key in r else "-"
        peak = format(r["peak_bytes"] / 2**30, ".2f") if "peak_bytes" in r else "-"
        lines.append(f"{r['mode']:<24}{r['layers']:>7}{num('load_s', '.1f'):>8}"
                     f"{num('first_forward_s', '.1f'):>7}{peak:>9}"
                     f"{num('prefill_128_tok_s', '.1f'):>12}{num('prefill_512_tok_s', '.1f'):>12}"
                     f"{r['decode_tok_s']:>8.2f}   {1e3 * s['experts']:.1f} / "
                     f"{1e3 * s['attention']:.1f} / {1e3 * s['rest']:.1f}")
    return "\n".join(lines)


def run(folder, layers=TOTAL_LAYERS, base=None, small=False, context=0):
    """Write the checkpoint if ``folder`` has none, measure, return the rows (``context``:
    see :func:`measure`)."""
    from mxfp4x.testing.gpt_oss import write_gpt_oss_model
    from mxfp4x.testing.roofline import cpu_model

    sizes = SMALL if small else {}
    if not os.path.exists(os.path.join(folder, "config.json")):
        say(f"writing a random gpt-oss checkpoint to {folder}")
        write_gpt_oss_model(folder, progress=lambda d, n: say(f"  file {d}/{n} written"),
                            **sizes)
    with open(os.path.join(folder, "config.json")) as fh:
        config = json.load(fh)
    layers = min(layers, config["num_hidden_layers"])
    base = base or (layers if small else baseline_layers(config))
    measure_kw = dict(prefill=(16, 32), decode=4) if small else {}
    if context:
        measure_kw["context"] = context
    rows = []
    for mode, n in (("mxfp4x", layers), ("mxfp4x", base), ("transformers", base)):
        if rows and n == layers and mode == "mxfp4x":
            continue
        say(f"measuring {mode} with {n} layers")
        rows.append(_in_process(folder, mode, n, **measure_kw))
        say(table(rows[-1:]).splitlines()[-1])
    if base < layers:
        rows.append(scaled(rows[-1], layers))
    say(f"\nCPU: {cpu_model().get('model', '?')}; {rows[0]['threads']} threads; "
        f"{rows[0]['dtype']} model")
    say(table(rows))
    for r in rows:
        at = r.get(f"decode_at_{context}_step_s") if context else None
        if at:
            say(f"{r['mode']}, {r['layers']} layers ({r['attention']} attention): decode after "
                f"{context} tokens {1 / at['total']:.2f} tok/s, step ms: experts / attention / "
                f"rest {1e3 * at['experts']:.1f} / {1e3 * at['attention']:.1f} / "
                f"{1e3 * at['rest']:.1f}")
    return rows


def test_transformers_end_to_end(benchmark, tmp_path):
    small = os.environ.get("MXFP4X_BENCH_SMALL") == "1"
    folder = str(tmp_path / "gpt-oss") if small else os.environ.get(
        "MXFP4X_GPT_OSS_FOLDER", os.path.join(os.path.expanduser("~"), ".cache",
                                             "mxfp4x-gpt-oss-20b-random"))
    rows = benchmark.pedantic(run, args=(folder,), kwargs=dict(small=small), rounds=1)
    ours = rows[0]
    assert ours["mode"] == "mxfp4x" and ours["decode_tok_s"] > 0
    assert min(ours["decode_step_s"].values()) >= 0
    benchmark.extra_info.update({"rows": rows})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                    "mxfp4x-gpt-oss-20b-random"),
                   help="where the random checkpoint is (written there if absent)")
    p.add_argument("--layers", type=int, default=TOTAL_LAYERS,
                   help="layers of the mxfp4x run (default: all 24)")
    p.add_argument("--baseline-layers", type=int, default=None,
                   help="layers of transformers' own run (default: the most that fit)")
    p.add_argument("--context", type=int, default=0,
                   help="also time 16 decoding steps after a prompt of this many tokens")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = run(args.folder, args.layers, args.baseline_layers, context=args.context)
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from mxfp4x._core.files import atomic_write
        with atomic_write(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
