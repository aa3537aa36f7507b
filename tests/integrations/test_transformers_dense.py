"""Dense-expert MoE checkpoints (Qwen3-MoE, Mixtral, gpt-oss in bf16) quantized to MXFP4 as
transformers loads them: small random models of the public shapes, against transformers'
own forward on the same dequantized weights (must agree within 1e-5 of max|logit|) and on
the dense weights (the quality cost of MXFP4, reported and bounded)."""
import os
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
pytest.importorskip("accelerate", reason="transformers' loader wants accelerate")

from memory_probe import measure, report  # noqa: E402  (tests/)
from safetensors import safe_open  # noqa: E402  (transformers' dependency)
from training_steps import (  # noqa: E402  (tests/)
    assert_same_input_grads,
    assert_same_training_grads,
)
from transformers.models.gpt_oss.modeling_gpt_oss import (  # noqa: E402
    GptOssRMSNorm,
    GptOssTopKRouter,
)

import mxfp4x  # noqa: E402
import mxfp4x.integrations.transformers as mxt  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
FAMILIES = {
    # per-expert tensors in the file, merged by transformers' loader (gate;up concatenated)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=96, moe_intermediate_size=64, num_experts=5,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, intermediate_size=96, num_local_experts=5, num_experts_per_tok=2),
    # transposed (E, in, out) tensors, gate/up interleaved, biases, a clamped activation
    "gpt_oss_bf16": lambda: transformers.GptOssConfig(
        **SMALL, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """A random model of the family saved in bf16, as such checkpoints are released."""
    config = FAMILIES[request.param]()
    torch.manual_seed(sum(map(ord, request.param)))
    model = _quiet(transformers.AutoModelForCausalLM.from_config, config)  # N(0, 0.02)
    folder = tmp_path_factory.mktemp(request.param)
    _quiet(model.to(torch.bfloat16).save_pretrained, folder)
    return request.param, str(folder)


def _experts(model):
    return [m for n, m in model.named_modules() if n.endswith("mlp.experts")]


def _dequantized_dense(path, ours, dtype=torch.float32):
    """transformers' own model of the checkpoint with every expert weight replaced by the
    dequantization of the bytes ours holds."""
    dense = _quiet(transformers.AutoModelForCausalLM.from_pretrained, path, dtype=dtype)
    with torch.no_grad():
        for mine, theirs in zip(_experts(ours), _experts(dense), strict=True):
            for w in mine._mxfp4x_weights:
                q = mxfp4x.dequantize(getattr(mine, w), getattr(mine, w + "_scales"))
                getattr(theirs, w).copy_(q.transpose(1, 2) if theirs.is_transposed else q)
    return dense


@pytest.fixture(scope="module")
def loaded(checkpoint):
    family, path = checkpoint
    ours = _quiet(mxt.from_pretrained, path, dtype=torch.float32)
    dense = _quiet(transformers.AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32)
    return family, path, ours, dense, _dequantized_dense(path, ours)


def _tokens(n=12, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (batch, n), generator=g)


def test_experts_are_mxfp4_buffers(loaded):
    family, path, ours, _, _ = loaded
    experts = _experts(ours)
    assert len(experts) == SMALL["num_hidden_layers"]
    for module in experts:
        assert set(module._mxfp4x_weights) == {"gate_up_proj", "down_proj"}
        smallest = SMALL["hidden_size"] * 32
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            assert t.device.type == "cpu", name
            if t.is_floating_point():
                assert t.numel() < smallest, (family, name, tuple(t.shape))  # biases only
            else:
                assert t.dtype == torch.uint8, (family, name)
        assert module.config._experts_implementation == "mxfp4x"
    if family == "qwen3_moe":  # the file held per-expert tensors: the loader's merge ran
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            assert any(".experts.3.gate_proj.weight" in k for k in f.keys())


@pytest.mark.skipif(getattr(torch, "float8_e8m0fnu", None) is None,
                    reason="no float8_e8m0fnu in this torch")
def test_load_state_dict_reads_typed_bytes_by_view(loaded):
    """A state dict whose scale bytes are typed float8_e8m0fnu (and the packed bytes
    int8): loaded by view, not cast by value (byte s -> 2^(s-127))."""
    import copy

    module = _experts(loaded[2])[0]
    names = [n for w in module._mxfp4x_weights for n in (w, w + "_scales")]
    state = module.state_dict()
    typed = {k: v.view(torch.float8_e8m0fnu) if k.endswith("_scales") else
             v.view(torch.int8) if k in names else v for k, v in state.items()}
    other = copy.deepcopy(module)
    with torch.no_grad():
        for name in names:
            getattr(other, name).zero_()
    other.load_state_dict(typed)
    for name in names:
        assert getattr(other, name).dtype == torch.uint8
        assert torch.equal(getattr(other, name), state[name]), name


def test_logits_match_the_dequantized_model_and_report_the_cost(loaded):
    family, _, ours, dense, deq = loaded
    ids = _tokens()
    with torch.no_grad():
        got, exact, want = ours(ids).logits, deq(ids).logits, dense(ids).logits
    scale = want.abs().max().item()
    assert (got - exact).abs().max().item() <= 1e-5 * scale
    cost = (got - want).abs().max().item() / scale
    rounding = (exact - want).abs().max().item() / scale
    print(f"\n{family}: max|logit error| vs the dense model {cost:.3e} of max|logit|; the "
          f"dequantized weights in transformers' forward: {rounding:.3e}")
    assert 0 < cost <= rounding + 1e-5  # MXFP4 rounding explains the whole cost


def test_greedy_generate_matches_the_dequantized_model(loaded):
    _, _, ours, _, deq = loaded
    ids = _tokens(n=5, batch=1, seed=2)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), deq.generate(ids, **kw))


def test_gradient_of_the_input_embeddings_matches(loaded):
    _, _, ours, _, deq = loaded
    assert_same_input_grads(ours, deq, _tokens(seed=4))


def test_gradient_checkpointing_gives_the_same_gradients(checkpoint):
    """Training steps with gradient_checkpointing_enable() (non-reentrant), through
    mxfp4x_experts_forward: the gradients of the same steps without, bit for bit."""
    _, path = checkpoint
    model = _quiet(mxt.from_pretrained, path, dtype=torch.float32)
    assert all(m.config._experts_implementation == "mxfp4x" for m in _experts(model))
    assert_same_training_grads(model, [_tokens(seed=7), _tokens(seed=8)])


def test_bf16_model_runs_and_plain_transformers_takes_the_config(checkpoint):
    _, path = checkpoint
    model = _quiet(transformers.AutoModelForCausalLM.from_pretrained, path,
                   dtype=torch.bfloat16, quantization_config=mxt.Mxfp4xConfig(num_threads=1))
    assert all(m.gate_up_proj.dtype == torch.uint8 for m in _experts(model))
    with torch.no_grad():
        out = model(_tokens()).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_bf16_linear_layers_run_on_the_dense_kernel(checkpoint):
    """bf16 nn.Linear layers (attention, head) become DenseLinear: at a few tokens
    without autograd mxfp4x's dense kernel, within bf16's rounding of torch's; off with
    dense_kernels=False."""
    family, path = checkpoint
    fast = _quiet(mxt.from_pretrained, path, dtype=torch.bfloat16, num_threads=1)
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is mxt.DenseLinear for m in linears)
    routers = [m for m in fast.modules() if isinstance(m, GptOssTopKRouter)]
    norms = [m for m in fast.modules() if isinstance(m, GptOssRMSNorm)]
    assert bool(routers) == bool(norms) == family.startswith("gpt_oss")
    assert all(type(m) is mxt.DenseRouter for m in routers)
    assert all(type(m) is mxt.CompiledRMSNorm for m in norms)
    plain = _quiet(mxt.from_pretrained, path, dtype=torch.bfloat16,
                   quantization_config=mxt.Mxfp4xConfig(num_threads=1, dense_kernels=False))
    assert not any(type(m) in (mxt.DenseLinear, mxt.DenseRouter, mxt.CompiledRMSNorm)
                   for m in plain.modules())
    assert fast.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():
        tokens = _tokens()[:, :3]
        a, b = fast(tokens).logits.float(), plain(tokens).logits.float()
    # each bf16 rounding of the layers (activations, outputs) is within 2^-8 relative
    assert (a - b).abs().max() <= 0.05 * b.abs().max(), (a - b).abs().max()


def test_dense_linear_module(rng):
    """DenseLinear against F.linear: the kernel's path within the bound (bias included),
    the bf16 unit's at 5 to 16 tokens within it, torch's exactly under autograd or past 16
    tokens; copies and pickles as nn.Linear."""
    import copy
    import pickle

    import numpy as np

    from mxfp4x._core.reference import error_bound
    lin = torch.nn.Linear(72, 40).to(torch.bfloat16)
    assert mxt.use_dense_kernels(torch.nn.Sequential(lin)) == 1
    assert type(lin) is mxt.DenseLinear
    x = torch.from_numpy(rng.standard_normal((3, 72))).bfloat16()
    with torch.no_grad():
        got = lin(x).double().numpy()
    w, bias = lin.weight.detach().double().numpy(), lin.bias.detach().double().numpy()
    ref = x.double().numpy() @ w.T + bias
    mag = abs(x.double().numpy()) @ abs(w).T + abs(bias)
    assert (abs(got - ref) <= error_bound(mag, 73) + 2.0 ** -8 * abs(ref) + 1e-38).all()
    y = lin(x)  # autograd on: torch's own
    assert y.requires_grad and torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    with torch.no_grad():
        many = x.repeat(7, 1)  # 21 tokens: past the dense kernels, torch's own
        assert torch.equal(lin(many), torch.nn.functional.linear(many, lin.weight, lin.bias))
        # 6 tokens: the bf16 unit's where the CPU has one (its own order, subnormals
        # flushed), else torch's: within the bound either way, a token's bits not its place
        six = lin(x.repeat(2, 1)).double().numpy()
        ref6, mag6 = (np.concatenate([a, a]) for a in (ref, mag))
        assert (abs(six - ref6) <= error_bound(mag6, 73) + 2.0 ** -8 * abs(ref6)
                + 73 * 2.0 ** -126 * 8).all()
        assert (six[:3] == six[3:]).all()
        for other in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
            assert type(other) is mxt.DenseLinear and torch.equal(other(x), lin(x))


def test_router_and_norm_modules(rng):
    """DenseRouter and CompiledRMSNorm against transformers' modules: the router's logits
    within the bound of the exact product (its top-k and softmax transformers' own), the
    norm within its rounding; transformers' forward under autograd and past 16 tokens;
    both copy and pickle."""
    import copy
    import pickle

    from mxfp4x._core.reference import error_bound
    config = transformers.GptOssConfig(hidden_size=72, num_local_experts=9,
                                       num_experts_per_tok=3)
    router = GptOssTopKRouter(config).to(torch.bfloat16)
    norm = GptOssRMSNorm(72, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.standard_normal((9, 72))))
        router.bias.copy_(torch.from_numpy(rng.standard_normal(9)))
        norm.weight.copy_(torch.from_numpy(rng.standard_normal(72) * 0.3 + 1))
    theirs_router, theirs_norm = copy.deepcopy(router), copy.deepcopy(norm)
    assert mxt.use_dense_kernels(torch.nn.Sequential(router, norm)) == 2
    assert type(router) is mxt.DenseRouter and type(norm) is mxt.CompiledRMSNorm
    x = torch.from_numpy(rng.standard_normal((3, 72))).bfloat16()
    with torch.no_grad():
        logits, scores, ids = router(x)
        want = theirs_router(x)
        normed, want_norm = norm(x), theirs_norm(x)
    w, bias = router.weight.double().detach().numpy(), router.bias.double().detach().numpy()
    ref = x.double().numpy() @ w.T + bias
    mag = abs(x.double().numpy()) @ abs(w).T + abs(bias)
    got = logits.double().numpy()
    assert logits.dtype == torch.bfloat16 and logits.shape == want[0].shape
    assert (abs(got - ref) <= error_bound(mag, 73) + 2.0 ** -8 * abs(ref) + 1e-38).all()
    top, top_ids = torch.topk(logits, 3, dim=-1)
    assert torch.equal(ids, top_ids)
    assert torch.equal(scores, torch.softmax(top, dim=1, dtype=top.dtype))
    assert torch.allclose(normed.float(), want_norm.float(), rtol=2.0 ** -7, atol=0)
    xg = x.clone().requires_grad_()
    assert all(torch.equal(a, b) for a, b in zip(router(xg), theirs_router(xg), strict=True))
    assert torch.equal(norm(xg), theirs_norm(xg)) and norm(xg).requires_grad
    with torch.no_grad():
        many = x.repeat(7, 1)  # 21 tokens: past the dense kernels, transformers' own
        assert all(torch.equal(a, b)
                   for a, b in zip(router(many), theirs_router(many), strict=True))
        eight = x.repeat(3, 1)[:8]  # the bf16 unit's where the CPU has one, else torch's
        got8, want8 = router(eight)[0].double(), theirs_router(eight)[0].double()
        assert torch.allclose(got8, want8, rtol=2.0 ** -7, atol=1e-2)
        assert torch.equal(got8[:3], got8[3:6])  # a token's bits: not its place
        for other in (copy.deepcopy(router), pickle.loads(pickle.dumps(router))):
            assert type(other) is mxt.DenseRouter and torch.equal(other(x)[0], logits)
        for other_norm in (copy.deepcopy(norm), pickle.loads(pickle.dumps(norm))):
            assert type(other_norm) is mxt.CompiledRMSNorm and torch.equal(other_norm(x),
                                                                           normed)


def test_scale_rule_and_modules_to_not_convert(checkpoint):
    _, path = checkpoint
    ceil = _quiet(mxt.from_pretrained, path, quantization_config=mxt.Mxfp4xConfig(
        scale_rule="ceil", modules_to_not_convert=["model.layers.1"]))
    first, second = _experts(ceil)
    floor = _experts(_quiet(mxt.from_pretrained, path))[0]
    assert first.gate_up_proj.dtype == torch.uint8
    assert not torch.equal(first.gate_up_proj_scales, floor.gate_up_proj_scales)
    assert second.gate_up_proj.is_floating_point()  # left dense, transformers' forward
    assert second.config._experts_implementation == "mxfp4x"  # shared config: a dense
    # module under "mxfp4x" runs the implementation the model had (it used to raise)
    dtype = second.gate_up_proj.dtype
    dense = _experts(_quiet(transformers.AutoModelForCausalLM.from_pretrained, path,
                            dtype=dtype))[1]
    g = torch.Generator().manual_seed(5)
    h = torch.randn(7, SMALL["hidden_size"], generator=g).to(dtype)
    ids = torch.stack([torch.randperm(first.gate_up_proj.shape[0], generator=g)[:2]
                       for _ in range(7)])
    w = torch.rand(7, 2, generator=g).to(dtype)
    with torch.no_grad():
        assert torch.equal(second(h, ids, w), dense(h, ids, w))
        assert torch.isfinite(ceil(_tokens()).logits).all()
    # a model not loaded by mxfp4x, told to use "mxfp4x": its dense experts refuse
    plain = _quiet(transformers.AutoModelForCausalLM.from_pretrained, path,
                   dtype=torch.float32)
    plain.config._experts_implementation = "mxfp4x"
    with torch.no_grad(), pytest.raises(ValueError, match="dense weights"):
        plain(_tokens())
    with pytest.raises(ValueError, match="scale_rule"):
        mxt.Mxfp4xConfig(scale_rule="nearest")


def test_save_pretrained_refuses_and_says_why(loaded, tmp_path):
    _, _, ours, _, _ = loaded
    with pytest.raises(ValueError, match="not serializable"):
        ours.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_a_width_that_is_not_whole_groups_is_refused_and_the_advice_works(tmp_path):
    """The refusal names every experts module whose width is not whole groups, in the
    modules_to_not_convert list that leaves them dense; following it gives transformers'
    own model (it ended in "no experts module ... routes through its experts interface",
    untrue, naming no list)."""
    config = transformers.Qwen3MoeConfig(**{**SMALL, "hidden_size": 48}, intermediate_size=96,
                                         moe_intermediate_size=64, num_experts=3,
                                         num_experts_per_tok=2, mlp_only_layers=[])
    torch.manual_seed(6)
    _quiet(transformers.AutoModelForCausalLM.from_config(config).save_pretrained, tmp_path)
    names = [f"model.layers.{i}.mlp.experts" for i in range(SMALL["num_hidden_layers"])]
    with pytest.raises(ValueError, match=re.escape(f"modules_to_not_convert={names!r}") +
                       ".*nothing is then quantized"):
        _quiet(mxt.from_pretrained, str(tmp_path))
    with pytest.raises(ValueError, match="multiple of 32.*modules_to_not_convert"):
        _quiet(mxt.from_pretrained, str(tmp_path), quantization_config=mxt.Mxfp4xConfig(
            modules_to_not_convert=names[:1]))  # the other one still named
    ours = _quiet(mxt.from_pretrained, str(tmp_path), dtype=torch.float32,
                  quantization_config=mxt.Mxfp4xConfig(modules_to_not_convert=names))
    plain = _quiet(transformers.AutoModelForCausalLM.from_pretrained, str(tmp_path),
                   dtype=torch.float32)
    assert all(m.gate_up_proj.dtype == torch.float32 for m in _experts(ours))
    ids = _tokens()
    with torch.no_grad():
        got, want = ours(ids).logits, plain(ids).logits
    assert want.abs().max() > 0 and torch.equal(got, want)


def test_peak_memory_against_transformers_dense(tmp_path):
    """A Qwen3-MoE-shaped model with 32 experts of 1024 x 768 in 2 layers (151 MB of bf16
    experts per layer, 302 MB as transformers holds them in fp32): loading quantized
    needs about one dense layer more than the MXFP4 model, not the dense model."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=768,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        num_experts=32, num_experts_per_tok=4, mlp_only_layers=[],
        max_position_embeddings=64)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = _quiet(transformers.AutoModelForCausalLM.from_config, config,
                       dtype=torch.bfloat16)
    _quiet(model.save_pretrained, tmp_path)
    del model
    found = {mode: measure(tmp_path, mode) for mode in ("mxfp4x", "transformers")}
    report(found)
    ours, theirs = found["mxfp4x"], found["transformers"]
    assert ours["experts"] * 7 < theirs["experts"]  # 4.25 bits against 32
    # held after loading: the dense experts' difference, less the page cache of the file
    assert ours["after"] - ours["before"] < theirs["after"] - theirs["before"] - \
        (theirs["experts"] - ours["experts"]) // 2
    assert ours["peak"] < theirs["peak"]


def _module_pair(experts_cls, config, seed):
    """A dense experts module with random weights and its MXFP4 twin (the swap the
    quantizer makes on the meta model, filled by the quantize op), plus the dense one
    holding the dequantized weights."""
    torch.manual_seed(seed)
    dense = experts_cls(config)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.5) if p.dim() == 3 else p.uniform_(0.5, 1.5)
    twin = experts_cls(config)
    twin.load_state_dict(dense.state_dict())
    weights = [w for w in ("gate_up_proj", "up_proj", "down_proj") if w in twin._parameters]
    quantized = {w: mxfp4x.quantize(getattr(dense, w).detach()) for w in weights}
    for w in weights:
        del twin._parameters[w]
        twin.register_buffer(w, quantized[w][0])
        twin.register_buffer(w + "_scales", quantized[w][1])
    twin._mxfp4x_weights = tuple(weights)
    twin._mxfp4x_threads = None
    with torch.no_grad():
        for w in weights:
            getattr(dense, w).copy_(mxfp4x.dequantize(*quantized[w]))
    return dense, twin


@pytest.mark.parametrize("family", ["nemotron_h", "muse_spark"])
def test_ungated_and_post_norm_experts(family):
    """The branches no causal-LM test reaches: experts without a gate (NemotronH: up_proj,
    activation, down_proj) and with a norm after each expert (MuseSpark)."""
    if family == "nemotron_h":
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts as cls
        config = transformers.NemotronHConfig(hidden_size=64, moe_intermediate_size=96,
                                              n_routed_experts=5, moe_latent_size=None)
    else:
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts as cls
        config = transformers.MuseSparkConfig().get_text_config()
        config.num_local_experts, config.moe_hidden_size = 5, 64
        config.moe_intermediate_size = 96
    dense, twin = _module_pair(cls, config, seed=3)
    assert twin.has_gate == (family != "nemotron_h")
    assert getattr(twin, "has_post_expert_norm", False) == (family == "muse_spark")
    g = torch.Generator().manual_seed(4)
    h = torch.randn(7, 64, generator=g)
    idx = torch.randint(0, 5, (7, 2), generator=g)
    w = torch.softmax(torch.randn(7, 2, generator=g), -1)
    with torch.no_grad():
        want = dense(h, idx, w)  # the module's own (eager) forward on the dequantized weights
        got = mxt.mxfp4x_experts_forward(twin, h, idx, w)
    assert want.abs().max() > 0
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("float32_intermediate", [False, True])
def test_bf16_model_feeds_the_down_projection_in_its_dtype(checkpoint, monkeypatch,
                                                           float32_intermediate):
    """The activation's output enters the down projection in the model's dtype (bf16), as
    transformers computes it; Mxfp4xConfig(float32_intermediate=True) keeps it float32."""
    from mxfp4x.integrations.transformers import _dense_experts

    _, path = checkpoint
    model = _quiet(transformers.AutoModelForCausalLM.from_pretrained, path,
                   dtype=torch.bfloat16, quantization_config=mxt.Mxfp4xConfig(
                       float32_intermediate=float32_intermediate))
    seen = []
    for name in ("mxfp4_experts", "mxfp4_experts_slots"):
        real = getattr(_dense_experts, name)
        monkeypatch.setattr(_dense_experts, name,
                            lambda x, w, *a, _f=real, **k: seen.append((x.dtype, w.shape))
                            or _f(x, w, *a, **k))
    with torch.no_grad():
        out = model(_tokens()).logits
    assert torch.isfinite(out).all()
    downs = [dt for dt, shape in seen if shape == _experts(model)[0].down_proj.shape]
    assert downs and set(downs) == {torch.float32 if float32_intermediate else torch.bfloat16}
