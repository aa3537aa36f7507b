"""CUDA tensors: the torch backend on a GPU, the modules moved there, the custom ops under
autograd and torch.compile, and ``bench --device cuda``; skipped without a GPU.

``MXFP4X_CUDA_TESTS_DEVICE=cpu`` runs these tests' own code on CPU tensors (a dry run of
the tests off a GPU; the CUDA-only checks skip)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x import nn
from mxfp4x._core import triton_impl as _triton_impl
from mxfp4x.testing.kimi_k3 import k3_config, kimi_k3_reference, write_k3_checkpoint
from mxfp4x.testing.layers import assert_matches_reference, gguf_blocks_of, random_layer

DEVICE = os.environ.get("MXFP4X_CUDA_TESTS_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                                reason="no CUDA device")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="checks a CUDA device itself")


def _to(layer):
    return {k: v.to(DEVICE) for k, v in layer.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)
def test_cuda_matches_reference(rng, dtype):
    layer = random_layer(rng, 9, 4, 6, 70, 5, dtype=dtype, repeat_expert=True)
    y = mxfp4x.mxfp4_experts(**_to(layer))
    assert y.device.type == DEVICE and y.dtype == dtype
    assert_matches_reference(y, layer)


def test_cuda_lists_follow_latents_device(rng):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    args = {k: v.tolist() for k, v in layer.items()}
    args["latent_tokens"] = layer["latent_tokens"].to(DEVICE)
    assert mxfp4x.mxfp4_experts(**args).device.type == DEVICE


@gpu_only
def test_cuda_mixed_devices_is_an_error(rng):
    layer = random_layer(rng, 2, 1, 2, 3, 1)
    args = dict(layer, latent_tokens=layer["latent_tokens"].cuda())
    with pytest.raises(ValueError, match="packed_weights: on device cpu"):
        mxfp4x.mxfp4_experts(**args)
    with pytest.raises(ValueError, match="backend: 'cpu' needs CPU tensors"):
        mxfp4x.mxfp4_experts(**{k: v.cuda() for k, v in layer.items()}, backend="cpu")


def test_cuda_every_weight_layout(rng):
    """Per-expert lists, float8_e8m0fnu scales and GGUF blocks on the device: each against
    the float64 reference, and the list bit-identical to the stacked form."""
    layer = random_layer(rng, 7, 3, 5, 37, 3, scale_range=(0, 140))
    dev = _to(layer)
    stacked = mxfp4x.mxfp4_experts(**dev)
    assert_matches_reference(stacked, layer)
    lists = dict(dev, packed_weights=list(dev["packed_weights"]),
                 scale_bytes=list(dev["scale_bytes"]))
    assert torch.equal(mxfp4x.mxfp4_experts(**lists), stacked)
    typed = dict(dev, scale_bytes=dev["scale_bytes"].view(torch.float8_e8m0fnu))
    assert torch.equal(mxfp4x.mxfp4_experts(**typed), stacked)
    blocks = torch.from_numpy(gguf_blocks_of(layer["packed_weights"], layer["scale_bytes"]))
    gguf = mxfp4x.mxfp4_experts(**dict(dev, packed_weights=blocks.to(DEVICE), scale_bytes=None))
    assert_matches_reference(gguf, layer)


def test_cuda_inputs_kept_and_result_fresh(rng):
    layer = _to(random_layer(rng, 5, 2, 4, 33, 2, repeat_expert=True))
    before = {k: v.clone() for k, v in layer.items()}
    y = mxfp4x.mxfp4_experts(**layer)
    for k, v in layer.items():
        assert torch.equal(v, before[k]), k
        assert v.untyped_storage().data_ptr() != y.untyped_storage().data_ptr(), k


def test_cuda_slots_and_per_slot_latents(rng):
    layer = random_layer(rng, 6, 3, 5, 40, 2, dtype=torch.float64)
    dev = _to(layer)
    slots = mxfp4x.mxfp4_experts_slots(dev["latent_tokens"], dev["packed_weights"],
                                       dev["scale_bytes"], dev["selected_experts"])
    cpu = mxfp4x.mxfp4_experts_slots(layer["latent_tokens"], layer["packed_weights"],
                                     layer["scale_bytes"], layer["selected_experts"])
    assert slots.device.type == DEVICE and slots.shape == (6, 3, 40)
    torch.testing.assert_close(slots.cpu(), cpu, rtol=1e-12, atol=1e-12)
    per_slot = torch.randn(6, 3, 64, dtype=torch.float64)
    y = mxfp4x.mxfp4_experts(**dict(dev, latent_tokens=per_slot.to(DEVICE)))
    want = mxfp4x.mxfp4_experts(**dict(layer, latent_tokens=per_slot))
    torch.testing.assert_close(y.cpu(), want, rtol=1e-12, atol=1e-12)


def test_cuda_gradcheck_float64(rng):
    layer = _to(random_layer(rng, 4, 2, 3, 7, 2, dtype=torch.float64, repeat_expert=True))
    for k in ("latent_tokens", "mixture_weights", "shared_output"):
        layer[k].requires_grad_(True)

    def f(x, mix, shared):
        return mxfp4x.mxfp4_experts(x, layer["packed_weights"], layer["scale_bytes"],
                                    layer["selected_experts"], mix, shared)

    assert torch.autograd.gradcheck(f, (layer["latent_tokens"], layer["mixture_weights"],
                                        layer["shared_output"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cuda_opcheck(rng, dtype):
    """torch.library's own checks of the custom ops (schema, fake tensors, autograd
    registration) on device tensors."""
    layer = _to(random_layer(rng, 5, 2, 3, 9, 2, dtype=dtype, repeat_expert=True))
    for k in ("latent_tokens", "mixture_weights", "shared_output"):
        layer[k].requires_grad_(True)
    ops = torch.ops.mxfp4x
    torch.library.opcheck(ops.mxfp4_experts.default, (*layer.values(), 1, ""))
    plain = _to(random_layer(rng, 5, 2, 3, 9, 2, dtype=dtype))
    torch.library.opcheck(ops.mxfp4_experts_slots.default,
                          (plain["latent_tokens"], plain["packed_weights"],
                           plain["scale_bytes"], plain["selected_experts"], 1))
    g = torch.randn(5, 9, dtype=dtype, device=DEVICE)
    torch.library.opcheck(ops.mxfp4_experts_grad_latents.default,
                          (g, plain["packed_weights"], plain["scale_bytes"],
                           plain["selected_experts"], plain["mixture_weights"],
                           plain["latent_tokens"], 1))


def test_cuda_compile_fullgraph_equals_eager(rng):
    layer = _to(random_layer(rng, 6, 3, 4, 40, 3))

    def block(x, packed, scales, sel, mix, shared):
        return torch.relu(mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared)) * 2

    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(*layer.values()), block(*layer.values()))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_tokens", [1, 4, 64])
@pytest.mark.parametrize("listed", [False, True], ids=["stacked", "list"])
def test_cuda_graph_captures_a_call_and_replays_it_on_new_inputs(rng, dtype, n_tokens,
                                                                 listed):
    """No host sync while a graph is captured (the ids are then checked on the device: a bad
    id gives its token NaN); replays on new latents and ids give the eager call's bits."""
    shape = (n_tokens, 4, 32, 96, 3)
    static = _to(random_layer(rng, *shape, dtype=dtype))
    if listed:  # per-expert tensors: a device table built by the warm-up, kept for replays
        static["packed_weights"] = list(static["packed_weights"])
        static["scale_bytes"] = list(static["scale_bytes"])
    args = list(static.values())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels
        for _ in range(2):
            mxfp4x.mxfp4_experts(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mxfp4x.mxfp4_experts(*args)
    graph.replay()
    first = out.clone()
    fresh = _to(random_layer(rng, *shape, dtype=dtype))
    for name in ("latent_tokens", "selected_experts", "mixture_weights", "shared_output"):
        static[name].copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, mxfp4x.mxfp4_experts(*static.values()))  # eager, the same inputs
    assert not torch.equal(out, first)
    static["selected_experts"][0, 1] = 32
    graph.replay()
    torch.cuda.synchronize()
    assert out[0].isnan().all() and not out[1:].isnan().any()
    with pytest.raises(IndexError, match="expert id 32 is outside"):
        mxfp4x.mxfp4_experts(*static.values())


@gpu_only
def test_cuda_compile_reduce_overhead_equals_eager(rng):
    """torch.compile(mode="reduce-overhead") captures the op in a CUDA graph."""
    layer = _to(random_layer(rng, 1, 4, 32, 96, 3, dtype=torch.bfloat16))

    def block(x, packed, scales, sel, mix, shared):
        return mxfp4x.mxfp4_experts(x, packed, scales, sel, mix, shared) * 2

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = compiled(*layer.values())
    assert torch.equal(got, block(*layer.values()))


def test_cuda_mxfp4_experts_module(rng):
    layer = random_layer(rng, 8, 2, 5, 24, 3)
    module = nn.MXFP4Experts.from_packed(layer["packed_weights"], layer["scale_bytes"])
    module = module.to(DEVICE)
    dev = _to(layer)
    y = module(dev["latent_tokens"], dev["selected_experts"], dev["mixture_weights"],
               dev["shared_output"])
    assert y.device.type == DEVICE
    assert_matches_reference(y, layer)


@pytest.fixture(scope="module")
def k3_checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("k3"))
    config = k3_config(hidden_size=256, routed_expert_hidden_size=128, num_experts=16,
                       num_experts_per_token=4, moe_intermediate_size=64,
                       num_shared_experts=2, num_hidden_layers=2)
    write_k3_checkpoint(folder, config, [1], seed=3, dense_dtype=torch.float32)
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_kimi_k3_block(k3_checkpoint, rng, dtype):
    """The Kimi K3 block loaded from its checkpoint, then moved to the device: its router,
    latent projections and experts there, against the float64 reference."""
    block = nn.KimiK3MoE.from_checkpoint(k3_checkpoint, layer=1, progress=False).to(DEVICE)
    x = torch.from_numpy(rng.standard_normal((9, 256))).to(dtype).to(DEVICE)
    y = block(x)
    assert y.device.type == DEVICE and y.dtype == dtype and y.shape == (9, 256)
    sel, w = block.router(x)
    block_cpu = nn.KimiK3MoE.from_checkpoint(k3_checkpoint, layer=1, progress=False)
    ref = kimi_k3_reference(block_cpu, x.cpu(), sel.cpu(), w.cpu())
    err = np.abs(y.double().cpu().numpy() - ref).max()
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    assert err <= tol * np.abs(ref).max(), (err, np.abs(ref).max())


@gpu_only
def test_cuda_bench_command(tmp_path):
    """The main job on the GPU: a checked result and a row per T."""
    r = subprocess.run([sys.executable, "-m", "mxfp4x", "bench", "--device", "cuda",
                        "--shape", "gpt-oss-20b-down", "--tokens", "1", "5", "--repeats", "2",
                        "--json", str(tmp_path / "b.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("T=") == 2 and "check: a slice" in r.stdout
    assert ("Triton kernel on" in r.stdout) == _triton_impl.available()


def test_experts_in_cpu_memory_the_rest_on_the_device(tmp_path):
    """``split_devices``: attention, norms, router and head moved to the device, each
    layer's MXFP4 experts left in CPU memory (run by the CPU kernels, the tokens crossing
    each way); the logits and greedy tokens those of the model held whole on the CPU."""
    pytest.importorskip("transformers")
    import mxfp4x.integrations.transformers as mxt
    from mxfp4x.testing.gpt_oss import TINY_GPT_OSS, write_gpt_oss_model
    write_gpt_oss_model(str(tmp_path), seed=4, **TINY_GPT_OSS)
    whole = mxt.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    split = mxt.split_devices(mxt.from_pretrained(str(tmp_path), dtype=torch.float32).eval(),
                              DEVICE)
    experts = [m for m in split.modules() if isinstance(m, mxt.GptOssMxfp4Experts)]
    assert len(experts) == TINY_GPT_OSS["num_hidden_layers"]
    held = {id(t) for m in experts for t in list(m.parameters()) + list(m.buffers())}
    assert all(t.device.type == "cpu" for m in experts for t in m.buffers())
    rest = [t for t in list(split.parameters()) + list(split.buffers()) if id(t) not in held]
    assert rest and all(t.device.type == DEVICE for t in rest)
    ids = torch.tensor([[5, 17, 200, 33, 91, 14, 7, 250, 63, 2, 120]])
    with torch.no_grad():
        want = whole(ids).logits
        got = split(ids.to(DEVICE)).logits
    assert got.device.type == DEVICE
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    kw = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(split.generate(ids.to(DEVICE), **kw).cpu(), whole.generate(ids, **kw))
