"""mxfp4x.integrations.transformers: a tiny random gpt-oss MXFP4 checkpoint in the released
layout, loaded with its experts kept MXFP4, against transformers' own dequantized model."""
import copy
import json
import os
import pickle
import re
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
pytest.importorskip("accelerate", reason="transformers' own mxfp4 loader (the baseline) "
                                         "wants accelerate")

from safetensors import safe_open  # noqa: E402  (transformers' dependency)
from safetensors.torch import save_file  # noqa: E402
from training_steps import (  # noqa: E402  (tests/)
    assert_same_input_grads,
    assert_same_training_grads,
)
from transformers.cache_utils import (  # noqa: E402
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

import mxfp4x.integrations.transformers as mxt  # noqa: E402
from mxfp4x._core import memory  # noqa: E402
from mxfp4x.integrations.transformers import _cache  # noqa: E402
from mxfp4x.testing.gpt_oss import released_quantization_config  # noqa: E402

EXPERT_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                  "down_proj_blocks", "down_proj_scales", "down_proj_bias")
SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_local_experts=4,
             num_experts_per_tok=2, vocab_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
             sliding_window=8)


def _write_checkpoint(folder, seed=0):
    """config.json (transformers' GptOssConfig, quant_method mxfp4 as released) and one
    model.safetensors: random dense non-expert weights, and per layer the experts as the
    released checkpoints store them, blocks (E, out, in/32, 16) and scales (E, out, in/32)
    uint8, biases bf16."""
    config = transformers.GptOssConfig(**SIZES)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = transformers.GptOssForCausalLM(config)
    rng = np.random.default_rng(seed)
    e, h, f = config.num_local_experts, config.hidden_size, config.intermediate_size
    tensors = {k: v.detach().to(torch.bfloat16).contiguous()
               for k, v in dense.state_dict().items() if ".mlp.experts." not in k}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        for proj, (o, i) in (("gate_up_proj", (2 * f, h)), ("down_proj", (h, f))):
            tensors[p + proj + "_blocks"] = torch.from_numpy(
                rng.integers(0, 256, (e, o, i // 32, 16), np.uint8))
            tensors[p + proj + "_scales"] = torch.from_numpy(
                rng.integers(120, 126, (e, o, i // 32), np.uint8))
            tensors[p + proj + "_bias"] = torch.from_numpy(
                rng.standard_normal((e, o)) * 0.1).to(torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["quantization_config"] = released_quantization_config()
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _write_checkpoint(str(tmp_path_factory.mktemp("gpt_oss_mxfp4")))


def _dense(path):
    """transformers' own load, experts dequantized (fp32), as it does on a CPU; asked for
    explicitly, since with Triton installed it would fetch MXFP4 kernels from the Hub."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32,
            quantization_config=transformers.Mxfp4Config(dequantize=True))


def _ours(path, **kwargs):
    kwargs.setdefault("dtype", torch.float32)
    return mxt.from_pretrained(path, **kwargs)


def test_loads_with_mxfp4_experts(checkpoint):
    model = _ours(checkpoint)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, mxt.GptOssMxfp4Experts)
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        assert torch.equal(experts.gate_up_proj_blocks,
                           f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks"))


@pytest.fixture(scope="module")
def models(checkpoint):
    return _ours(checkpoint), _dense(checkpoint)


def _tokens(n=12, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SIZES["vocab_size"], (batch, n), generator=g)


def _assert_same_logits(model, reference):
    """``model``'s logits on ``_tokens()`` within 1e-5 of max|logit| of ``reference``'s;
    returns both."""
    ids = _tokens()
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
    return got, want


def test_logits_match_transformers_dequantized(models):
    ours, dense = models
    assert not isinstance(dense.model.layers[0].mlp.experts, mxt.GptOssMxfp4Experts)
    got, want = _assert_same_logits(ours, dense)
    assert got.dtype == want.dtype == torch.float32


@pytest.mark.skipif(not memory.huge_pages_asked(), reason="Linux only")
@pytest.mark.parametrize("tied", [False, True])
def test_the_checkpoint_is_read_in_huge_folios_but_the_input_embeddings(checkpoint,
                                                                        tmp_path, monkeypatch,
                                                                        tied):
    """Before transformers' loader reads a weight, the door reads the checkpoint files in
    (memory.read_in_huge_folios: 2 MiB folios), all but the input embeddings' bytes, which
    it skips unless the head shares them; the model loads as before."""
    from mxfp4x.integrations.transformers import _quantizer

    calls = []

    def spy(paths, skip=()):
        calls.append((list(paths), list(skip)))
        return 0

    monkeypatch.setattr(memory, "read_in_huge_folios", spy)
    folder = _folder_with(checkpoint, tmp_path / "m",
                          edit_config=lambda c: c.update(tie_word_embeddings=tied))
    path = os.path.join(folder, "model.safetensors")
    model = _ours(folder)
    assert [paths for paths, _ in calls] == [[path]]
    with safe_open(path, "pt") as f:
        n_embed = f.get_slice("model.embed_tokens.weight").get_shape()
    if tied:
        assert calls[0][1] == []
    else:
        from mxfp4x.checkpoints.safetensors import SafeTensorsFile
        with SafeTensorsFile(path) as f:
            assert calls[0][1] == [(path, *f.byte_range("model.embed_tokens.weight"))]
    assert tuple(model.get_input_embeddings().weight.shape) == tuple(n_embed)
    assert _quantizer._read_in_huge_folios(model, None) == 0  # a state_dict: nothing read


def test_experts_the_checkpoint_keeps_dense_stay_dense(checkpoint, tmp_path):
    """An MXFP4 checkpoint whose modules_to_not_convert names a layer's experts (stored
    dense): that layer keeps transformers' module and its weights, as transformers' own
    loader does (it became an MXFP4 module whose bytes were never loaded: NaN logits);
    and the config a caller passes is left as it was."""
    import copy

    from safetensors.torch import load_file

    import mxfp4x

    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    p = "model.layers.1.mlp.experts."
    for proj in ("gate_up_proj", "down_proj"):  # transformers stores these (E, in, out)
        w = mxfp4x.dequantize(tensors.pop(p + proj + "_blocks"), tensors.pop(p + proj + "_scales"))
        tensors[p + proj] = w.transpose(1, 2).contiguous().to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(checkpoint, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"]["modules_to_not_convert"].append("model.layers.1.mlp.experts")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    before = copy.deepcopy(config.to_dict())
    ours, dense = _ours(str(tmp_path), config=config), _dense(str(tmp_path))
    assert config.to_dict() == before
    assert isinstance(ours.model.layers[0].mlp.experts, mxt.GptOssMxfp4Experts)
    assert not isinstance(ours.model.layers[1].mlp.experts, mxt.GptOssMxfp4Experts)
    _assert_same_logits(ours, dense)


def _folder_with(checkpoint, folder, edit_tensors=None, edit_config=None):
    """A copy of the checkpoint with its tensors (a dict) and its config.json (a dict)
    passed through the edits (each changes its dict in place)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    if edit_tensors is not None:
        edit_tensors(tensors)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(str(folder), "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(checkpoint, "config.json")) as fh:
        cfg = json.load(fh)
    if edit_config is not None:
        edit_config(cfg)
    with open(os.path.join(str(folder), "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return str(folder)


def _dequantized_weights(checkpoint, layer, dtype):
    """gate_up_proj and down_proj of a layer's experts as transformers holds them, (E, in,
    out), decoded from the file's bytes."""
    import mxfp4x

    p = f"model.layers.{layer}.mlp.experts."
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        return {proj: mxfp4x.dequantize(f.get_tensor(p + proj + "_blocks"),
                                        f.get_tensor(p + proj + "_scales")
                                        ).transpose(1, 2).to(dtype)
                for proj in ("gate_up_proj", "down_proj")}


@pytest.mark.parametrize("pattern, layers", [("model.layers.0.mlp.experts", [0]),
                                             ("experts", [0, 1])])
def test_modules_to_not_convert_dequantizes_the_mxfp4_experts_it_names(checkpoint, models,
                                                                       pattern, layers,
                                                                       tmp_path):
    """modules_to_not_convert naming experts the file stores in MXFP4: they become
    transformers' dense module holding the file's experts dequantized exactly (they were
    left at transformers' random initialisation, the logits wrong, the one trace a load
    report); the others stay MXFP4.  Saved, the checkpoint holds those experts dense and
    its config lists them, and loads back to the same logits."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    _, dense = models
    ours = _ours(checkpoint, quantization_config=mxt.Mxfp4xConfig(
        modules_to_not_convert=[pattern]))
    for layer in range(SIZES["num_hidden_layers"]):
        experts = ours.model.layers[layer].mlp.experts
        if layer not in layers:
            assert isinstance(experts, mxt.GptOssMxfp4Experts)
            continue
        assert type(experts) is GptOssExperts
        for proj, want in _dequantized_weights(checkpoint, layer, torch.float32).items():
            got = getattr(experts, proj)
            assert got.dtype == torch.float32 and torch.equal(got, want), (layer, proj)
        with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
            bias = f.get_tensor(f"model.layers.{layer}.mlp.experts.down_proj_bias")
        assert torch.equal(experts.down_proj_bias, bias.float())
    got, _ = _assert_same_logits(ours, dense)
    ours.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as fh:
        assert pattern in json.load(fh)["quantization_config"]["modules_to_not_convert"]
    again = mxt.from_pretrained(str(tmp_path), dtype=torch.float32)
    for layer in layers:
        assert type(again.model.layers[layer].mlp.experts) is GptOssExperts
    with torch.no_grad():
        assert torch.equal(again(_tokens()).logits, got)


def test_dequantized_experts_take_the_model_dtype(checkpoint):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    ours = _ours(checkpoint, dtype=torch.bfloat16, quantization_config=mxt.Mxfp4xConfig(
        modules_to_not_convert=["model.layers.1.mlp.experts"]))
    experts = ours.model.layers[1].mlp.experts
    assert type(experts) is GptOssExperts
    for proj, want in _dequantized_weights(checkpoint, 1, torch.bfloat16).items():
        got = getattr(experts, proj)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), proj  # exact in bf16
    with torch.no_grad():
        assert torch.isfinite(ours(_tokens()).logits).all()


def test_experts_stored_dense_but_not_listed_load_as_stored(checkpoint, models, tmp_path):
    """A layer's experts stored dense while the config's modules_to_not_convert does not
    list them (an MXFP4 module there would run on bytes never loaded): transformers'
    module takes them, and the config written back lists it."""
    import mxfp4x

    def dense_layer_1(tensors):
        p = "model.layers.1.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            w = mxfp4x.dequantize(tensors.pop(p + proj + "_blocks"),
                                  tensors.pop(p + proj + "_scales"))
            tensors[p + proj] = w.transpose(1, 2).contiguous().to(torch.bfloat16)

    folder = _folder_with(checkpoint, tmp_path / "ckpt", dense_layer_1)
    ours, (_, dense) = _ours(folder), models
    assert isinstance(ours.model.layers[0].mlp.experts, mxt.GptOssMxfp4Experts)
    assert not isinstance(ours.model.layers[1].mlp.experts, mxt.GptOssMxfp4Experts)
    _assert_same_logits(ours, dense)
    assert "model.layers.1.mlp.experts" in ours.config.quantization_config.modules_to_not_convert


@pytest.mark.parametrize("missing", [
    tuple("model.layers.1.mlp.experts." + t for t in EXPERT_TENSORS),  # the whole layer
    ("model.layers.0.mlp.experts.down_proj_scales",),
    ("model.layers.1.mlp.experts.gate_up_proj_bias",)], ids=["layer", "scales", "bias"])
@pytest.mark.parametrize("listed", [False, True])
def test_experts_the_file_does_not_hold_are_an_error(checkpoint, tmp_path, missing, listed):
    """Expert tensors the file lacks (a layer's, a scale, a bias) would be left at
    transformers' initialisation: a ValueError naming the module and the tensors, whether
    or not modules_to_not_convert names the module."""
    def drop(tensors):
        for name in missing:
            del tensors[name]

    def lists(cfg):
        if listed:
            cfg["quantization_config"]["modules_to_not_convert"].append(
                missing[0].rsplit(".", 1)[0])

    folder = _folder_with(checkpoint, tmp_path / "ckpt", drop, lists)
    module = missing[0].rsplit(".", 1)[0]
    with pytest.raises(ValueError, match=re.escape(module) + ".*" + re.escape(
            missing[0].rsplit(".", 1)[1])):
        _ours(folder)


@pytest.mark.parametrize("door", ["from_pretrained", "AutoModelForCausalLM"])
def test_a_checkpoint_without_quantization_config_loads_as_mxfp4(checkpoint, models, door,
                                                                 tmp_path):
    """An MXFP4 gpt-oss checkpoint whose config.json lacks quantization_config (its
    expert tensors ``*_blocks`` / ``*_scales`` say the format): read as MXFP4, the same
    model (it failed deep in transformers, "normal_kernel_cpu" not implemented for
    'Byte'); saved, its config says quant_method "mxfp4"."""
    folder = _folder_with(checkpoint, tmp_path / "ckpt",
                          edit_config=lambda cfg: cfg.pop("quantization_config"))
    if door == "from_pretrained":
        model = _ours(folder)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, quantization_config=mxt.Mxfp4xConfig())
    ours, _ = models
    for layer in range(SIZES["num_hidden_layers"]):
        got, want = model.model.layers[layer].mlp.experts, ours.model.layers[layer].mlp.experts
        assert isinstance(got, mxt.GptOssMxfp4Experts)
        for name in BYTE_TENSORS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (layer, name)
    ids = _tokens()
    with torch.no_grad():
        logits = model(ids).logits
    if door == "from_pretrained":  # the same attention as ours
        with torch.no_grad():
            assert torch.equal(logits, ours(ids).logits)
    model.save_pretrained(tmp_path / "saved")
    with open(tmp_path / "saved" / "config.json") as fh:
        assert json.load(fh)["quantization_config"]["quant_method"] == "mxfp4"


def test_greedy_generate_matches(models):
    ours, dense = models
    ids = _tokens(n=5, batch=1, seed=2)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), dense.generate(ids, **kw))


def _generate(model, ids, n, **kw):
    """greedy generate's output, its cache as ``.cache`` (transformers' name for it since
    it renamed ``past_key_values``)."""
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, **kw)
    if getattr(out, "cache", None) is None:
        out.cache = out.past_key_values
    return out


def test_generate_takes_the_growing_cache_and_the_same_tokens(checkpoint, monkeypatch):
    monkeypatch.setattr(_cache, "_MIN_ROOM", 3)  # many growths and moves in 40 tokens
    ours = mxt.from_pretrained(checkpoint, dtype=torch.float32)
    plain = mxt.from_pretrained(checkpoint, dtype=torch.float32,
                                quantization_config=mxt.Mxfp4xConfig(growing_cache=False))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (2, 11), generator=g)
    got, want = _generate(ours, ids, 40), _generate(plain, ids, 40)
    assert {type(x) for x in got.cache.layers} == {mxt.GrowingLayer,
                                                  mxt.GrowingSlidingWindowLayer}
    assert {type(x) for x in want.cache.layers} == {DynamicLayer, DynamicSlidingWindowLayer}
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.cache.layers, want.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # beam search reorders the growing layers' buffers: the same sequences
    beams = dict(num_beams=3, num_return_sequences=2, early_stopping=False)
    assert torch.equal(_generate(ours, ids, 12, **beams).sequences,
                       _generate(plain, ids, 12, **beams).sequences)
    # a cache the caller passes, or another implementation, is left as it is
    mine = DynamicCache(config=ours.config)
    assert _generate(ours, ids, 3, cache=mine).cache is mine
    assert type(mine.layers[0]) in (DynamicLayer, DynamicSlidingWindowLayer)
    assert isinstance(_generate(ours, ids, 3, cache_implementation="static").cache,
                      transformers.StaticCache)
    # a copy and a pickle of the model prepare their own
    for other in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        out = _generate(other, ids, 40)
        assert torch.equal(out.sequences, want.sequences)
        assert type(out.cache.layers[1]) in (mxt.GrowingLayer, mxt.GrowingSlidingWindowLayer)
        assert other._prepare_cache_for_generation.model is other


def test_gpt_oss_takes_grouped_attention_unless_asked(models, checkpoint):
    ours, dense = models
    assert ours.config._attn_implementation == mxt.ATTENTION
    assert dense.config._attn_implementation == "eager"  # transformers' own, for gpt-oss
    eager = _ours(checkpoint, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    asked = transformers.AutoConfig.from_pretrained(checkpoint, attn_implementation="eager")
    assert _ours(checkpoint, config=asked).config._attn_implementation == "eager"
    _assert_same_logits(ours, eager)


class _Heads(torch.nn.Module):
    """What eager attention reads of its module: the grouping, the sinks, training."""

    def __init__(self, heads, kv_heads, sinks):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.sinks = sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tq, tk", [(1, 1), (1, 37), (5, 5), (6, 40), (2, 1030), (80, 96)])
@pytest.mark.parametrize("sinks", [True, False])
def test_grouped_attention_is_eager_attention(dtype, tq, tk, sinks):
    """Against transformers' own eager forms (gpt-oss's with sinks, Llama's without) on
    random heads, 12 query heads over 3 key/value heads, a batch of two with an additive
    mask (causal, plus padding on the second): a head that read the wrong key/value head,
    or a mask or sink out of place, moves every affected row by the size of the scores."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as oss
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama

    g = torch.Generator().manual_seed(tq * 100 + tk)
    b, hq, hkv, d = 2, 12, 3, 16
    q = torch.randn(b, hq, tq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, tk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, tk, d, generator=g).to(dtype)
    allowed = torch.ones(b, 1, tq, tk, dtype=torch.bool).tril(tk - tq)
    allowed[1, ..., : tk // 3] = False  # the second sequence's padding
    allowed[..., -1] = True  # every row keeps a key
    mask = torch.zeros(b, 1, tq, tk, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    module = _Heads(hq, hkv, torch.randn(hq, generator=g).to(dtype) if sinks else None).eval()
    extra = {"s_aux": module.sinks} if sinks else {}
    got, got_w = mxt.grouped_attention(module, q, k, v, mask, 0.25, **extra)
    want, want_w = (oss if sinks else llama)(module, q, k, v, mask, 0.25)
    assert got.shape == want.shape == (b, tq, hq, d) and got.dtype == want.dtype == dtype
    # a prompt takes flash attention, a decoding step mxfp4x's compiled attention: both
    # their softmax in float32 (eager's bfloat16 rounds it), no weights
    tol = (1e-5 if tq >= 64 else 1e-6) if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert got_w is None
    # where no kernel takes the call (a gradient to record), eager's operations, weights
    qg = q.clone().requires_grad_()
    got, got_w = mxt.grouped_attention(module, qg, k, v, mask, 0.25, **extra)
    torch.testing.assert_close(got.detach(), want, atol=tol, rtol=tol)
    assert got_w.shape == want_w.shape and got_w.dtype == want_w.dtype
    torch.testing.assert_close(got_w.detach(), want_w, atol=tol, rtol=tol)


def test_grouped_attention_refuses_heads_that_do_not_group():
    q, kv = torch.zeros(1, 5, 1, 4), torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="5 heads.*2 key/value heads"):
        mxt.grouped_attention(_Heads(4, 2, None), q, kv, kv, None, 0.5)


def test_no_dense_expert_tensor(models):
    ours, _ = models
    e, f = SIZES["num_local_experts"], SIZES["intermediate_size"]
    smallest_matrix = SIZES["hidden_size"] * f  # one expert's down (or half its gate/up)
    for name, module in ours.named_modules():
        if not name.endswith(".mlp.experts"):
            continue
        for tname, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point():
                assert t.numel() < smallest_matrix, (name, tname, tuple(t.shape))
            else:
                assert t.dtype == torch.uint8, (name, tname, t.dtype)
    assert e * 2 * f < smallest_matrix  # the biases are below the bound


def test_save_pretrained_round_trips_the_expert_bytes(models, checkpoint, tmp_path):
    ours, _ = models
    ours.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as fh:
        assert json.load(fh)["quantization_config"]["quant_method"] == "mxfp4"
    original = safe_open(os.path.join(checkpoint, "model.safetensors"), "pt")
    saved = {}
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors"):
            f = safe_open(str(tmp_path / name), "pt")
            saved.update({k: f for k in f.keys()})
    for layer in range(SIZES["num_hidden_layers"]):
        for t in EXPERT_TENSORS:
            key = f"model.layers.{layer}.mlp.experts.{t}"
            a, b = original.get_tensor(key), saved[key].get_tensor(key)
            if t.endswith("_bias"):  # loaded (and saved) in the model's dtype, exactly
                assert torch.equal(a.to(b.dtype), b), key
            else:
                assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape, key
                assert a.numpy().tobytes() == b.numpy().tobytes(), key
    again = mxt.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = _tokens(seed=3)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours(ids).logits)


def test_bf16_saves_the_released_bytes(checkpoint, tmp_path):
    model = _ours(checkpoint, dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(_tokens()).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    model.save_pretrained(tmp_path)
    original = safe_open(os.path.join(checkpoint, "model.safetensors"), "pt")
    saved = safe_open(str(tmp_path / "model.safetensors"), "pt")
    for t in EXPERT_TENSORS:
        key = f"model.layers.1.mlp.experts.{t}"
        a, b = original.get_tensor(key), saved.get_tensor(key)
        assert a.dtype == b.dtype and a.view(torch.uint8).numpy().tobytes() == \
            b.view(torch.uint8).numpy().tobytes(), key


def test_gradient_of_the_input_embeddings_matches(models):
    ours, dense = models
    assert_same_input_grads(ours, dense, _tokens(seed=4))


def test_gradient_checkpointing_gives_the_same_gradients(checkpoint):
    """Training steps with gradient_checkpointing_enable() (non-reentrant checkpointing,
    whose unpacking the experts' backward must do once) through GptOssMxfp4Experts: the
    gradients of the same steps without, bit for bit; the experts' biases among them."""
    model = _ours(checkpoint)
    assert isinstance(model.model.layers[0].mlp.experts, mxt.GptOssMxfp4Experts)
    assert_same_training_grads(model, [_tokens(seed=7), _tokens(seed=8)],
                               trained=("layers.0.self_attn.", "mlp.experts.down_proj_bias"))


@pytest.mark.parametrize("backend", [
    "eager",  # Dynamo traces the whole forward, the experts' custom ops included
    pytest.param("inductor", marks=pytest.mark.slow),  # ~25 s on 2 cores: C++ codegen
])
def test_torch_compile_forward(models, backend):
    ours, _ = models
    ids = _tokens(seed=5)
    with torch.no_grad():
        want = ours(ids).logits
        got = torch.compile(ours, backend=backend, fullgraph=True)(ids).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _retyped(checkpoint, folder, retype):
    """The checkpoint with each expert tensor passed through ``retype(name, tensor)``."""
    import shutil

    from safetensors.torch import load_file

    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    os.makedirs(folder, exist_ok=True)
    save_file({k: retype(k, v).contiguous() for k, v in tensors.items()},
              os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(checkpoint, "config.json"), folder)
    return str(folder)


E8M0 = getattr(torch, "float8_e8m0fnu", None)
BYTE_TENSORS = tuple(t for t in EXPERT_TENSORS if not t.endswith("_bias"))


@pytest.mark.skipif(E8M0 is None, reason="no float8_e8m0fnu in this torch")
def test_expert_bytes_typed_e8m0_or_int8_load_by_view(models, checkpoint, tmp_path):
    """Scales stored F8_E8M0 and blocks I8 (the same bytes, as other files of the format
    type them): transformers' loader cast the scales by value into the uint8 buffers
    (byte s -> 2^(s-127) truncated: 0 below 127, wrong logits, silently), and int8 blocks
    failed at the first forward.  They arrive by view: the same buffers and logits."""
    def retype(name, t):
        if name.endswith("_scales"):
            return t.view(E8M0)
        return t.view(torch.int8) if name.endswith("_blocks") else t
    folder = _retyped(checkpoint, tmp_path / "typed", retype)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.down_proj_scales").dtype == E8M0
    ours, _ = models
    typed = _ours(folder)
    for layer in range(SIZES["num_hidden_layers"]):
        got, want = typed.model.layers[layer].mlp.experts, ours.model.layers[layer].mlp.experts
        for name in BYTE_TENSORS:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == torch.uint8 and torch.equal(a, b), (layer, name)
    ids = _tokens(seed=6)
    with torch.no_grad():
        assert torch.equal(typed(ids).logits, ours(ids).logits)
    # scales stored as float numbers are not bytes: refused, naming the buffer
    floats = _retyped(checkpoint, tmp_path / "floats",
                      lambda n, t: t.float() if n.endswith("_scales") else t)
    with pytest.raises(TypeError, match=r"model\.layers\.0\.mlp\.experts\."
                                        r"(gate_up|down)_proj_scales: expected bytes"):
        _ours(floats)


@pytest.mark.skipif(E8M0 is None, reason="no float8_e8m0fnu in this torch")
def test_load_state_dict_reads_typed_bytes_by_view(models):
    import copy

    ours, _ = models
    experts = ours.model.layers[0].mlp.experts
    state = experts.state_dict()
    typed = {k: v.view(E8M0) if k.endswith("_scales") else
             v.view(torch.int8) if k.endswith("_blocks") else v for k, v in state.items()}
    for assign in (False, True):
        other = copy.deepcopy(experts)
        with torch.no_grad():
            for name in BYTE_TENSORS:
                getattr(other, name).zero_()
        other.load_state_dict(typed, assign=assign)
        for name in BYTE_TENSORS:
            assert getattr(other, name).dtype == torch.uint8
            assert torch.equal(getattr(other, name), state[name]), (assign, name)


def test_refuses_a_checkpoint_quantized_otherwise(tmp_path):
    config = transformers.GptOssConfig(**SIZES)
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        mxt.from_pretrained(str(tmp_path))


def test_importing_mxfp4x_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import sys, mxfp4x, mxfp4x.integrations; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow  # ~1 min: transformers' own load dequantizes 6 GB on the CPU
def test_peak_memory_at_real_width(tmp_path):
    """gpt-oss-20b's widths (hidden 2880, intermediate 2880, 32 experts) in 2 layers with a
    small vocabulary: load + one forward stays under the packed experts + 1.5 GB; what
    transformers' own load needs is printed beside it."""
    from memory_probe import measure, report

    from mxfp4x.testing.gpt_oss import write_gpt_oss_model

    write_gpt_oss_model(str(tmp_path), num_hidden_layers=2, vocab_size=1024)
    found = {"mxfp4x": measure(tmp_path, "mxfp4x", "bfloat16"),
             "transformers": measure(tmp_path, "transformers", "bfloat16")}
    report(found)
    ours, theirs = found["mxfp4x"], found["transformers"]
    packed = 2 * 32 * (2 * 2880 + 2880) * 90 * 17
    assert ours["experts"] >= packed
    assert ours["peak"] - ours["before"] < packed + 1.5 * 2**30
    assert theirs["peak"] > ours["peak"] + 2 * packed  # dequantized: 4x the bytes or more


@pytest.mark.parametrize("float32_intermediate", [False, True])
def test_bf16_model_feeds_the_down_projection_in_its_dtype(checkpoint, monkeypatch,
                                                           float32_intermediate):
    """As transformers' gpt-oss computes it, a bf16 model's SwiGLU output enters the down
    projection as bf16 (rounded once from float32); the option keeps it float32."""
    import mxfp4x.models.gpt_oss.experts as gpt_oss_experts_module
    from mxfp4x.models.gpt_oss import gpt_oss_experts

    model = _ours(checkpoint, dtype=torch.bfloat16, quantization_config=mxt.Mxfp4xConfig(
        float32_intermediate=float32_intermediate))
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, SIZES["hidden_size"], generator=g).to(torch.bfloat16)
    idx = torch.randint(0, SIZES["num_local_experts"], (5, 2), generator=g)
    p = torch.rand(5, 2, generator=g).to(torch.bfloat16)
    seen = []
    down = gpt_oss_experts_module.mxfp4_experts
    monkeypatch.setattr(gpt_oss_experts_module, "mxfp4_experts",
                        lambda x, *a, **k: seen.append(x.dtype) or down(x, *a, **k))
    with torch.no_grad():
        got = experts(h, idx, p)
    assert seen == [torch.float32 if float32_intermediate else torch.bfloat16]
    args = (h, idx, p, (experts.gate_up_proj_blocks, experts.gate_up_proj_scales),
            experts.gate_up_proj_bias, (experts.down_proj_blocks, experts.down_proj_scales),
            experts.down_proj_bias)
    kw = dict(limit=experts.limit, alpha=experts.alpha)
    with torch.no_grad():
        rounded = gpt_oss_experts(*args, **kw, act_dtype=torch.bfloat16)
        kept = gpt_oss_experts(*args, **kw)
    assert not torch.equal(rounded, kept)  # the two orders differ on these inputs
    assert torch.equal(got, kept if float32_intermediate else rounded)


@pytest.mark.skipif(not (os.path.exists("/proc/self/smaps") and memory.huge_pages_asked()),
                    reason="Linux only")
@pytest.mark.parametrize("tied", [False, True])
def test_large_weights_ask_for_huge_pages_but_the_input_embeddings(tied):
    """After loading, the door asks for huge pages on the model's large weights (the
    decoding step streams them), not on input embeddings the head does not share."""
    from mxfp4x.integrations.transformers._quantizer import _ask_huge_pages

    def flags(address):
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("VmFlags:"):
                    return line.split()[1:]

    def fresh():  # 3 x 2 MiB of bf16 in a mapping of its own, nothing asked of it
        import mmap
        buf = mmap.mmap(-1, 3 * memory.HUGE_PAGE, flags=mmap.MAP_PRIVATE)
        return torch.nn.Parameter(torch.frombuffer(buf, dtype=torch.bfloat16).view(-1, 1024))

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(3072, 1024, _weight=fresh())
            self.proj = torch.nn.Linear(1024, 3072, bias=False)
            self.head = torch.nn.Linear(1024, 3072, bias=False)
            self.proj.weight, self.head.weight = fresh(), fresh()
            if tied:
                self.head.weight = self.embed.weight
            self.register_buffer("small", torch.zeros(100, dtype=torch.uint8))

        def get_input_embeddings(self):
            return self.embed

        def get_output_embeddings(self):
            return self.head

    toy = Toy()
    assert _ask_huge_pages(toy) == 2  # the projection and the head
    middle = memory.HUGE_PAGE * 3 // 2
    assert "hg" in flags(toy.proj.weight.data_ptr() + middle)
    assert "hg" in flags(toy.head.weight.data_ptr() + middle)
    assert ("hg" in flags(toy.embed.weight.data_ptr() + middle)) == tied
