"""A Kimi K3 MoE layer from a GGUF file as llama.cpp's converter writes it (architecture
``kimi-k3``): the routed experts as GGUF MXFP4 blocks read in place, the dense parts in
F32, F16, BF16 and Q8_0, the hyperparameters from the metadata.  Held to the float64
reference, and to the same layer loaded from the release's safetensors layout (within
the bound, not bit for bit: the kernels' lanes hold different elements of the two
arrangements); bit-identical across threads and batches within the GGUF arrangement."""
import numpy as np
import pytest
import torch

from mxfp4x import nn
from mxfp4x.checkpoints.gguf import GGUFCheckpoint
from mxfp4x.testing.kimi_k3 import kimi_k3_reference

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402 (after the skip: the helpers import gguf)
    UINT32,
    k3_layer,
    write_k3_gguf,
    write_k3_safetensors,
)

LAYER = 1
N_EXPERTS, HIDDEN, LATENT, D_FF = 6, 96, 64, 64
# as tests/models/test_kimi_k3.py: |block - float64 reference| <= TOL * max|reference|
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def weights():
    return k3_layer(np.random.default_rng(11), N_EXPERTS, HIDDEN, LATENT, D_FF)


@pytest.fixture(scope="module")
def files(tmp_path_factory, weights):
    folder = tmp_path_factory.mktemp("k3gguf")
    (path,) = write_k3_gguf(folder / "k3.gguf", weights, LAYER)
    st = write_k3_safetensors(str(folder / "st"), path, weights, LAYER)
    return path, st


def load(path, **kw):
    return nn.KimiK3MoE.from_checkpoint(path, LAYER, progress=False, **kw)


def _x(rng, n, dtype=torch.float32):
    return torch.from_numpy(rng.standard_normal((n, HIDDEN))).to(dtype)


def test_block_reads_the_file_as_the_converter_wrote_it(files, weights):
    block = load(files[0])
    ex = block.experts
    assert ex.n_local == N_EXPERTS and (ex.d_latent, ex.d_ff) == (LATENT, D_FF)
    assert ex.gate_up_scales is None and ex.down_scales is None
    assert (ex.beta, ex.linear_beta) == (4.0, 25.0)
    r = block.router
    assert (r.top_k, r.renormalize, r.scaling, r.n_group, r.topk_group) == (2, True, 2.5, 1, 1)
    assert block.norm_eps == float(np.float32(1e-5))
    # dense types kept as stored (views), Q8_0 dequantized once to float32
    assert block.down_proj.dtype == torch.bfloat16 and block.up_proj.dtype == torch.float16
    assert block.shared_gate.dtype == torch.float32 and block.router.weight.dtype == torch.float32
    np.testing.assert_array_equal(block.router.weight.numpy(), weights["router"])
    # state: {e}.w1.weight_packed holds the (O, G, 17) blocks, no scale tensors
    state = ex.state_dict()
    assert tuple(state["0.w1.weight_packed"].shape) == (D_FF, LATENT // 32, 17)
    assert tuple(state["5.w2.weight_packed"].shape) == (LATENT, D_FF // 32, 17)
    assert not any(k.endswith("weight_scale") for k in state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_block_matches_float64_reference(isa, files, rng, dtype):
    block = load(files[0])
    block.experts.isa = isa
    x = _x(rng, 13, dtype)
    y = block(x)
    assert y.shape == (13, HIDDEN) and y.dtype == dtype
    sel, w = block.router(x)
    ref = kimi_k3_reference(block, x, sel, w)
    err = np.abs(y.double().numpy() - ref).max()
    assert err <= TOL[dtype] * np.abs(ref).max(), (err, np.abs(ref).max())


def test_same_block_as_the_safetensors_checkpoint(files, rng):
    g, s = load(files[0]), load(files[1])
    x = _x(rng, 17)
    sel_g, w_g = g.router(x)
    sel_s, w_s = s.router(x)
    assert torch.equal(sel_g, sel_s) and torch.equal(w_g, w_s)
    ref = kimi_k3_reference(s, x, sel_s, w_s)
    # the same matrices in both: the references agree to float64 rounding
    np.testing.assert_allclose(kimi_k3_reference(g, x, sel_g, w_g), ref, rtol=0,
                               atol=1e-12 * np.abs(ref).max())
    bound = TOL[torch.float32] * np.abs(ref).max()
    yg, ys = g(x).double().numpy(), s(x).double().numpy()
    assert np.abs(yg - ref).max() <= bound and np.abs(ys - ref).max() <= bound
    assert np.abs(yg - ys).max() <= 2 * bound
    # the routed experts alone, on the same latents
    h = torch.from_numpy(rng.standard_normal((17, LATENT))).float()
    eg, es = g.experts(h, sel_g, w_g), s.experts(h, sel_s, w_s)
    scale = es.abs().max().item()
    assert (eg - es).abs().max().item() <= 2e-5 * scale


def test_experts_are_views_of_just_the_range(files):
    ckpt = GGUFCheckpoint(files[0])
    e0, e1 = 2, 5
    block = load(ckpt, expert_range=(e0, e1))
    ex = block.experts
    assert ex.expert_ids == [2, 3, 4] and ex.n_local == 3
    name = f"blk.{LAYER}.ffn_gate_exps.weight"
    info = ckpt.tensor(name)
    w1 = [ex.get_submodule(f"{e}.w1").weight_packed for e in ex.expert_ids]
    # one mapping of experts e0..e1-1 only, every expert a view into it
    storage = w1[0].untyped_storage()
    assert storage.nbytes() == (e1 - e0) * info.row_bytes
    for i, t in enumerate(w1):
        assert t.untyped_storage().data_ptr() == storage.data_ptr()
        assert t.data_ptr() == storage.data_ptr() + i * info.row_bytes
    with open(files[0], "rb") as f:
        f.seek(info.begin + e0 * info.row_bytes)
        assert f.read(info.row_bytes) == bytes(w1[0].flatten().numpy())


def test_expert_range_subset_is_bit_identical(files, rng):
    full, sub = load(files[0]), load(files[0], expert_range=range(2, 5))
    h = torch.from_numpy(rng.standard_normal((9, LATENT))).float()
    sel = torch.from_numpy(rng.integers(2, 5, (9, 2)))
    w = torch.from_numpy(rng.random((9, 2))).float()
    assert torch.equal(sub.experts(h, sel, w), full.experts(h, sel, w))
    with pytest.raises(IndexError, match="expert 0 is not held"):
        sub.experts(h, torch.zeros_like(sel), w)
    with pytest.raises(ValueError, match="expert_range"):
        load(files[0], expert_range=(4, 7))


def test_bit_identical_across_threads_and_batches(files, rng):
    """The block across thread counts; the routed experts also across batches (the
    dense parts are torch's matmuls, whose results may depend on the batch)."""
    x = _x(rng, 23)
    one = load(files[0], num_threads=1)
    two = load(files[0], num_threads=2)
    assert torch.equal(two(x), one(x))
    h = torch.from_numpy(rng.standard_normal((23, LATENT))).float()
    sel, w = one.router(x)
    y = one.experts(h, sel, w)
    assert torch.equal(two.experts(h, sel, w), y)
    for t in (0, 11, 22):
        assert torch.equal(two.experts(h[t:t + 1], sel[t:t + 1], w[t:t + 1])[0], y[t])
    assert torch.equal(two.experts(h[5:19], sel[5:19], w[5:19]), y[5:19])


def test_split_set_opens_from_any_name(tmp_path, files, weights, rng):
    paths = write_k3_gguf(tmp_path / "k3.gguf", weights, LAYER, split_max_tensors=4)
    assert len(paths) == 3 and paths[1].endswith("-00002-of-00003.gguf")
    x = _x(rng, 5)
    assert torch.equal(load(paths[1])(x), load(files[0])(x))


def test_torch_path_with_gradients(files, rng):
    block = load(files[0])
    x = _x(rng, 6).requires_grad_()
    y = block(x)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad():
        direct = block(x.detach())
    bound = TOL[torch.float32] * direct.abs().max().item()
    assert (y.detach() - direct).abs().max().item() <= bound


def test_state_dict_round_trip_and_replaced_weights(files, rng):
    a, b = load(files[0]), load(files[0], expert_range=(0, N_EXPERTS))
    h = torch.from_numpy(rng.standard_normal((4, LATENT))).float()
    sel = torch.tensor([[0, 1], [1, 2], [3, 4], [5, 0]])
    w = torch.rand(4, 2)
    before = a.experts(h, sel, w)
    state = {k: v.clone() for k, v in a.experts.state_dict().items()}
    state["0.w2.weight_packed"][..., 0] += 1  # every scale of expert 0's w2: times 2
    b.experts.load_state_dict(state)
    after = b.experts(h, sel, w)
    assert not torch.equal(after, before)
    keep = (sel != 0).all(1)
    assert torch.equal(after[keep], before[keep])
    # expert 0's down scaled by 2 exactly: the rows that chose it
    only0 = a.experts(h, sel, w * (sel == 0))
    assert torch.allclose(after - before, only0, rtol=1e-5, atol=1e-5 * before.abs().max())
    # one arrangement per module
    m = b.experts.get_submodule("3.w1")
    m.weight_scale = torch.zeros(D_FF, LATENT // 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one arrangement per module"):
        b.experts(h, sel, w)


def test_mixed_arrangements_are_refused(files):
    ex = load(files[0]).experts
    blocks = [ex.get_submodule(f"{e}.w1").weight_packed for e in ex.expert_ids]
    packed = torch.zeros(N_EXPERTS, LATENT, D_FF // 2, dtype=torch.uint8)
    scales = torch.zeros(N_EXPERTS, LATENT, D_FF // 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="one arrangement for all three"):
        nn.KimiK3Experts((blocks, None), (blocks, None), (packed, scales))
    with pytest.raises(ValueError, match="GGUF blocks"):
        nn.KimiK3Experts(([b.flatten()[:-1] for b in blocks], None), (blocks, None),
                         (blocks, None))


def test_wrong_architecture(tmp_path, weights):
    (path,) = write_k3_gguf(tmp_path / "x.gguf", weights, LAYER, arch="deepseek2")
    with pytest.raises(ValueError, match="architecture is 'deepseek2', expected 'kimi-k3'"):
        load(path)


@pytest.mark.parametrize("missing", ["ffn_routed_up.weight", "exp_probs_b.bias",
                                     "ffn_down_shexp.weight", "ffn_up_exps.weight"])
def test_missing_tensor(tmp_path, weights, missing):
    (path,) = write_k3_gguf(tmp_path / "x.gguf", weights, LAYER, omit=(missing,))
    with pytest.raises(ValueError, match=f"no tensor 'blk.{LAYER}.{missing}'"):
        load(path)


def test_missing_layer(files):
    with pytest.raises(ValueError, match="no tensor 'blk.7.ffn_gate_exps.weight'"):
        nn.KimiK3MoE.from_checkpoint(files[0], 7)


def test_hyperparameters_missing_from_the_metadata_come_from_config(tmp_path, files, weights,
                                                                    rng):
    omit = ("activation.situ_beta", "activation.situ_linear_beta")
    (path,) = write_k3_gguf(tmp_path / "x.gguf", weights, LAYER, omit=omit)
    with pytest.raises(ValueError, match="kimi-k3.activation.situ_beta.*config="):
        load(path)
    block = load(path, config={"activation_situ_beta": 4.0,
                               "activation_situ_linear_beta": 25.0})
    x = _x(rng, 3)
    assert torch.equal(block(x), load(files[0])(x))
    no_clip = load(path, config={"activation_situ_beta": 4.0,
                                 "activation_situ_linear_beta": None})
    assert no_clip.experts.linear_beta is None
    with pytest.raises(ValueError, match="expert_weights_scale is 2.5, but config gives"):
        load(files[0], config={"routed_scaling_factor": 1.0})
    load(files[0], config={"routed_scaling_factor": 2.5})  # agreeing is fine
    with pytest.raises(TypeError, match="only for GGUF files"):
        load(files[1], config={})


def test_wrong_metadata_is_refused(tmp_path, weights):
    (path,) = write_k3_gguf(tmp_path / "x.gguf", weights, LAYER,
                            metadata={"expert_gating_func": (1, UINT32)})
    with pytest.raises(ValueError, match="router is sigmoid"):
        load(path)
    (path,) = write_k3_gguf(tmp_path / "y.gguf", weights, LAYER,
                            metadata={"expert_count": (8, UINT32)})
    with pytest.raises(ValueError, match="holds 6 experts, the metadata 8"):
        load(path)
