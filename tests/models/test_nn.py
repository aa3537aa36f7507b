"""mxfp4x.nn: the expert bank, the gpt-oss block against a float64 reference, and
checkpoints in the gpt-oss naming (memory-mapped, not copied)."""
import json

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x import nn
from mxfp4x._core.reference import decode_expert
from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, SafeTensorsFile, save_file
from mxfp4x.testing.layers import random_layer

E, H, F, K, T = 4, 64, 96, 2, 7


def _spy_maps(monkeypatch, f):
    """The mappings ``f`` makes from now on (each call maps just the bytes it reads)."""
    maps = []
    real = f._map
    monkeypatch.setattr(f, "_map", lambda *args: maps.append(real(*args)) or maps[-1])
    return maps


def _gpt_oss_tensors(rng, layer=0):
    gu = torch.from_numpy(rng.standard_normal((E, 2 * F, H)) * 0.1).float()
    down = torch.from_numpy(rng.standard_normal((E, H, F)) * 0.1).float()
    gu_blocks, gu_scales = mxfp4x.quantize(gu)
    down_blocks, down_scales = mxfp4x.quantize(down)
    p = f"model.layers.{layer}.mlp.experts."
    return {p + "gate_up_proj_blocks": gu_blocks, p + "gate_up_proj_scales": gu_scales,
            p + "gate_up_proj_bias": torch.from_numpy(rng.standard_normal((E, 2 * F))
                                                      ).bfloat16(),
            p + "down_proj_blocks": down_blocks, p + "down_proj_scales": down_scales,
            p + "down_proj_bias": torch.from_numpy(rng.standard_normal((E, H))).bfloat16()}


def _reference_block(t, h, idx, w, limit=7.0, alpha=1.702):
    p = "model.layers.0.mlp.experts."
    h = h.double().numpy()
    out = np.zeros((h.shape[0], H))
    for i in range(h.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[i, k])
            wgu = decode_expert(t[p + "gate_up_proj_blocks"][e].numpy(),
                                t[p + "gate_up_proj_scales"][e].numpy())
            wd = decode_expert(t[p + "down_proj_blocks"][e].numpy(),
                               t[p + "down_proj_scales"][e].numpy())
            gu = wgu @ h[i] + t[p + "gate_up_proj_bias"][e].double().numpy()
            gate, up = np.minimum(gu[0::2], limit), np.clip(gu[1::2], -limit, limit)
            act = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[i] += float(w[i, k]) * (wd @ act + t[p + "down_proj_bias"][e].double().numpy())
    return out


def _module(t):
    p = "model.layers.0.mlp.experts."
    return nn.GptOssExperts(t[p + "gate_up_proj_blocks"], t[p + "gate_up_proj_scales"],
                            t[p + "gate_up_proj_bias"], t[p + "down_proj_blocks"],
                            t[p + "down_proj_scales"], t[p + "down_proj_bias"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_gpt_oss_block_against_float64_reference(rng, dtype):
    t = _gpt_oss_tensors(rng)
    block = _module(t)
    # token 0 four times larger: its pre-activations (sd ~10) pass the clamp at 7 on every
    # seed, the others' (sd ~2.4) mostly stay inside it
    h = torch.from_numpy(rng.standard_normal((T, H)) * 3 * np.r_[4, np.ones(T - 1)][:, None])
    h = h.to(dtype)
    idx = torch.from_numpy(rng.integers(0, E, (T, K)))
    w = torch.softmax(torch.randn(T, K), -1)
    y = block(h, idx, w)
    assert y.shape == (T, H) and y.dtype == dtype
    ref = _reference_block(t, h, idx, w)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(y.double().numpy(), ref, rtol=tol, atol=tol * np.abs(ref).max())
    assert np.abs(ref).max() > 1  # the clamps and both projections are exercised
    gu = mxfp4x.mxfp4_experts_slots(h.double(), block.gate_up_blocks, block.gate_up_scales, idx)
    assert (gu.abs() > 7).any() and (gu.abs() < 7).any()  # both sides of the clamp


def test_gpt_oss_block_gradients_flow(rng):
    t = _gpt_oss_tensors(rng)
    block = _module(t)
    h = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    w = torch.softmax(torch.randn(T, K, dtype=torch.float64), -1).requires_grad_(True)
    idx = torch.from_numpy(rng.integers(0, E, (T, K)))
    assert torch.autograd.gradcheck(lambda a, b: block(a, idx, b), (h, w))


def test_checkpoint_is_memory_mapped_and_complete(tmp_path, rng):
    tensors = {**_gpt_oss_tensors(rng, 0), **_gpt_oss_tensors(rng, 1)}
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    f = SafeTensorsFile(path)
    for k, v in tensors.items():
        assert torch.equal(f.get(k), v), k
    block = nn.GptOssExperts.from_checkpoint(path, 1)
    p = "model.layers.1.mlp.experts."
    assert torch.equal(block.down_blocks, tensors[p + "down_proj_blocks"])
    h = torch.randn(T, H)
    idx = torch.from_numpy(rng.integers(0, E, (T, K)))
    w = torch.rand(T, K)
    assert torch.isfinite(block(h, idx, w)).all()


def test_checkpoint_bytes_are_not_copied(tmp_path, rng, monkeypatch):
    tensors = _gpt_oss_tensors(rng)
    path = str(tmp_path / "one.safetensors")
    save_file(tensors, path)
    f = SafeTensorsFile(path)
    maps = _spy_maps(monkeypatch, f)
    key = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    t = f.get(key)
    (mapped,) = maps
    assert t.data_ptr() == mapped.ctypes.data  # a view of the mapping of its bytes


def test_sharded_checkpoint_and_progress(tmp_path, rng, capsys):
    t0, t1 = _gpt_oss_tensors(rng, 0), _gpt_oss_tensors(rng, 1)
    save_file(t0, str(tmp_path / "a.safetensors"))
    save_file(t1, str(tmp_path / "b.safetensors"))
    weight_map = {**{k: "a.safetensors" for k in t0}, **{k: "b.safetensors" for k in t1}}
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": weight_map}, f)
    blocks = nn.load_gpt_oss_experts(str(tmp_path))
    assert len(blocks) == 2
    assert torch.equal(blocks[1].gate_up_scales,
                       t1["model.layers.1.mlp.experts.gate_up_proj_scales"])
    assert "2/2" in capsys.readouterr().err


def test_mxfp4_experts_module(tmp_path, rng):
    layer = random_layer(rng, 6, 2, 3, 40, 2)
    m = nn.MXFP4Experts.from_packed(layer["packed_weights"], layer["scale_bytes"])
    args = (layer["latent_tokens"], layer["selected_experts"], layer["mixture_weights"])
    want = mxfp4x.mxfp4_experts(**layer)
    assert torch.equal(m(*args, layer["shared_output"]), want)
    no_shared = m(*args)  # a missing shared output is zeros
    assert torch.equal(no_shared, mxfp4x.mxfp4_experts(**dict(
        layer, shared_output=torch.zeros_like(layer["shared_output"]))))
    # state_dict round trip into a fresh module of the same shape
    fresh = nn.MXFP4Experts(3, 40, 64)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(fresh(*args, layer["shared_output"]), want)
    # from_float: quantize then run
    w = torch.randn(3, 40, 64)
    q = nn.MXFP4Experts.from_float(w)
    packed, scales = mxfp4x.quantize(w)
    assert torch.equal(q.packed_weights, packed) and torch.equal(q.scale_bytes, scales)
    # from_safetensors
    path = str(tmp_path / "bank.safetensors")
    save_file({"blocks": layer["packed_weights"], "scales": layer["scale_bytes"]}, path)
    s = nn.MXFP4Experts.from_safetensors(path, "blocks", "scales")
    assert torch.equal(s(*args, layer["shared_output"]), want)
    assert "n_experts=3, d_out=40, d_in=64" in repr(s)


def test_modules_check_their_bytes(rng):
    layer = random_layer(rng, 2, 1, 2, 4, 1)
    with pytest.raises(ValueError, match=r"packed_weights.*\[0, 255\]"):
        nn.MXFP4Experts.from_packed(layer["packed_weights"].long() + 200, layer["scale_bytes"])
    with pytest.raises(TypeError, match="scale_bytes"):
        nn.MXFP4Experts.from_packed(layer["packed_weights"], layer["scale_bytes"].float())


def _raw_file(path, header, data=b""):
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data)


@pytest.mark.parametrize("header,data", [
    ({"t": {"dtype": "U8", "shape": [4], "data_offsets": [-8, 0]}}, b"abcd"),
    ({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 100]}}, b"abcd"),
    ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 4]}}, b"abcd"),
    ({"t": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}}, b"abcd"),
    ([1, 2], b""),
    ({"t": {"dtype": "U8"}}, b""),
])
def test_malformed_safetensors_are_rejected(tmp_path, header, data):
    path = str(tmp_path / "bad.safetensors")
    _raw_file(path, header, data)
    with pytest.raises(ValueError, match="bad.safetensors"):
        SafeTensorsFile(path)


def test_index_cannot_point_outside_the_folder(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with open(tmp_path / "ckpt" / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"w": "../elsewhere.safetensors"}}, f)
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        SafeTensorsCheckpoint(str(tmp_path / "ckpt"))


def test_get_many_maps_just_the_span(tmp_path, monkeypatch):
    path = str(tmp_path / "span.safetensors")
    tensors = {f"t{i}": torch.arange(i * 1000, i * 1000 + 4096, dtype=torch.int32)
               for i in range(6)}
    save_file(tensors, path)
    f = SafeTensorsFile(path)
    maps = _spy_maps(monkeypatch, f)
    got = f.get_many(["t2", "t3"])
    (mapped,) = maps  # one mapping of just the span of t2 and t3
    assert len(mapped) == f.byte_range("t3")[1] - f.byte_range("t2")[0]
    for k in ("t2", "t3"):
        assert torch.equal(got[k], tensors[k])
    assert abs(got["t3"].data_ptr() - got["t2"].data_ptr()) == 4096 * 4  # one window


def test_writer_keeps_every_tensor_aligned(tmp_path, monkeypatch):
    path = str(tmp_path / "mixed.safetensors")
    tensors = {"odd_bytes": torch.arange(7, dtype=torch.uint8), "f": torch.randn(5),
               "b": torch.randn(3).bfloat16(), "d": torch.randn(2, dtype=torch.float64)}
    save_file(tensors, path)
    f = SafeTensorsFile(path)
    maps = _spy_maps(monkeypatch, f)
    for k, v in tensors.items():
        t = f.get(k)
        assert torch.equal(t, v)
        assert t.data_ptr() == maps[-1].ctypes.data, k  # a view, not a copy


def test_a_group_that_is_not_a_process_group_is_named():
    """Modules hold their group weakly (so a kept model never keeps a destroyed group):
    something that is not a process group is a TypeError naming ``group``."""
    with pytest.raises(TypeError, match="group: expected a torch.distributed process group"):
        nn.MXFP4Experts(2, 32, 64, expert_range=(0, 2), group="world")
    assert nn.MXFP4Experts(2, 32, 64).group is None
