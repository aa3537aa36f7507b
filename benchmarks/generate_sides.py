"""bench_generate.py's llama.cpp side (``measure_llama``, run in a process of its own) and
its plot."""
import importlib.util
import os
import sys
import time

import numpy as np

bt = sys.modules.get("bench_transformers")
if bt is None:  # imported by name in a fresh process (bench_transformers.in_fresh_process)
    import bench_transformers as bt

PREFILL, DECODE, UBATCH = bt.PREFILL, bt.DECODE, 512
say = bt.say


def _parallel(llm, batch_ids, steps, threads):
    """len(batch_ids) sequences decoded together by llama.cpp, as its parallel decoding
    (the ``llama-batched-bench`` and server pattern) runs them: a context of its own with
    a sequence slot each and one unified cache, the prompts in one batch, then ``steps``
    greedy steps of all sequences.  Returns the seconds of the prompts' batch and of the
    steps."""
    import llama_cpp

    n_seq, n_prompt = len(batch_ids), len(batch_ids[0])
    p = llama_cpp.llama_context_default_params()
    p.n_ctx = -(-(n_seq * (n_prompt + steps + 1)) // 256) * 256
    p.n_batch, p.n_ubatch = max(n_seq * n_prompt, n_seq), UBATCH
    p.n_seq_max, p.kv_unified = n_seq, True
    p.n_threads = p.n_threads_batch = threads
    p.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = llama_cpp.llama_init_from_model(llm.model, p)
    if not ctx:
        raise RuntimeError(f"llama.cpp: no context for {n_seq} sequences")
    batch = llama_cpp.llama_batch_init(p.n_batch, 0, 1)
    vocab = llm.n_vocab()

    def run(entries):  # (token, position, sequence, wants logits)
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, wants
        if llama_cpp.llama_decode(ctx, batch):
            raise RuntimeError("llama.cpp: llama_decode failed")
        outs = [i for i, e in enumerate(entries) if e[3]]
        return [int(np.argmax(np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)))) for i in outs]

    try:
        t0 = time.perf_counter()
        nxt = run([(tok, pos, s, pos == n_prompt - 1) for s, ids in enumerate(batch_ids)
                   for pos, tok in enumerate(ids)])
        t1 = time.perf_counter()
        for step in range(steps):
            nxt = run([(tok, n_prompt + step, s, True) for s, tok in enumerate(nxt)])
        return t1 - t0, time.perf_counter() - t1
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def _llama_sequences(llm, batch_ids, threads):
    """Seconds per step of SEQUENCE_STEPS greedy steps of len(batch_ids) sequences decoded
    together, after their prompts in one batch."""
    return _parallel(llm, batch_ids, bt.SEQUENCE_STEPS, threads)[1] / bt.SEQUENCE_STEPS


def measure_llama_serving(path, threads, batches, prompt, output):
    """bench_vllm's measurements of llama.cpp on the GGUF file ``path``: for each batch
    size b, b random prompts of ``prompt`` tokens decoded together (parallel decoding, as
    llama.cpp's server runs concurrent requests), first to their first tokens (the time
    to a batch's first tokens), then to ``output`` greedy tokens each, from a fresh cache
    each time: output tokens/s of the batch."""
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    out = {"side": "llama.cpp", "load_s": time.perf_counter() - t0,
           "version": llama_cpp.__version__}
    vocab = llm.n_vocab()
    rng = np.random.default_rng(0)
    _parallel(llm, [rng.integers(0, vocab, 16).tolist()], 0, threads)  # warm-up
    for b in batches:
        reqs = rng.integers(0, vocab, (b, prompt)).tolist()
        out[f"ttft_{b}_s"] = _parallel(llm, reqs, 0, threads)[0]
        spent = sum(_parallel(llm, reqs, output - 1, threads))
        out[f"tok_s_{b}"] = b * output / spent
    return out


def measure_llama(path, threads, prefill=PREFILL, decode=DECODE, context=0, logits_path=None,
                  sequences=()):
    """One process's figures of llama.cpp on the GGUF file ``path``, the same
    measurements as bench_transformers' ``measure`` (the same token ids, a fresh cache
    for each prefill, greedy decoding; several sequences in a context of their own)."""
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
    ids = bt.prompts(vocab, prefill, (prefill[0], context), sequences)

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
    for n_seq, batch_ids in ids["sequences"].items():
        step = _llama_sequences(llm, batch_ids, threads)
        out[f"sequences_{n_seq}_step_s"] = {"total": step}
        out[f"sequences_{n_seq}_tok_s"] = n_seq / step
    out["peak_bytes"] = bt._rss_peak()
    return out


def llama_missing():
    """Why llama.cpp's side cannot run here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed: pip install llama-cpp-python"
    return None



def plot(result, path):
    """Decode tokens/s against the context, and the tokens/s of several sequences decoded
    together against their number (one sequence: the decode after ``prefill[0]``), a line
    per side and thread count, into ``path`` (a .png or another format matplotlib
    writes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mxfp4x._core.files import atomic_write

    fig, (by_context, by_sequences) = plt.subplots(1, 2, figsize=(10, 4))
    contexts = result["contexts"]
    for r in result["rows"]:
        label = f"{r['mode']}, {r['threads']} thread{'s' if r['threads'] > 1 else ''}"
        style = "o-" if r["mode"].startswith("mxfp4x") else "s--"
        points = [(contexts["decode"], r["decode_tok_s"])]
        at = r.get(f"decode_at_{result['context']}_step_s") if result["context"] else None
        if at:
            points.append((contexts["context"], 1 / at["total"]))
        by_context.plot([x for x, _ in points], [y for _, y in points], style, label=label)
        points = [(1, r["decode_tok_s"])] + [
            (n, r[f"sequences_{n}_tok_s"]) for n in result.get("sequences", [])
            if f"sequences_{n}_tok_s" in r]
        by_sequences.plot([x for x, _ in points], [y for _, y in points], style, label=label)
    by_context.set_xscale("log", base=2)
    by_context.set_xlabel("tokens in the context")
    by_context.set_ylabel("decode tokens/s")
    by_context.set_title("one sequence")
    by_sequences.set_xscale("log", base=2)
    by_sequences.set_xlabel(f"sequences decoded together (prompts of "
                            f"{result.get('sequence_prompt', '?')} tokens)")
    by_sequences.set_ylabel("tokens/s, all sequences")
    by_sequences.set_title("several sequences")
    for ax in (by_context, by_sequences):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"gpt-oss, {result['config']['num_hidden_layers']} layers, "
                 f"{result['cpu'].get('model', '?')}", fontsize=9)
    fig.tight_layout()
    with atomic_write(path, "wb") as fh:
        fig.savefig(fh, format=os.path.splitext(path)[1][1:].lower() or "png", dpi=110)
    plt.close(fig)
    say(f"plot written to {path}")
