"""gpt-oss from llama.cpp GGUF files: the experts read in place (gate and up split, GGUF
blocks), against the safetensors form of the same weights and the float64 reference."""
import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="the gguf package writes the test files")

from gguf_files import write_gguf  # noqa: E402  (tests/)

from mxfp4x import nn  # noqa: E402
from mxfp4x.checkpoints.gguf import MXFP4, GGUFCheckpoint  # noqa: E402
from mxfp4x.checkpoints.safetensors import save_file  # noqa: E402
from mxfp4x.testing.gpt_oss import gpt_oss_reference  # noqa: E402
from mxfp4x.testing.layers import gguf_blocks_of  # noqa: E402

E, H, F, K = 5, 96, 64, 2  # odd expert count, hidden 3 groups, intermediate 2 groups


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same random layer 1 as a released safetensors file and as llama.cpp's
    converter writes it (gate rows 0::2 and up rows 1::2 of gate_up, GGUF blocks)."""
    rng = np.random.default_rng(7)
    gu_blocks = rng.integers(0, 256, (E, 2 * F, H // 32, 16), np.uint8)
    gu_scales = rng.integers(117, 124, (E, 2 * F, H // 32), np.uint8)
    gu_scales[0, 0, 0] = 0  # 2^-127: subnormal, must survive
    d_blocks = rng.integers(0, 256, (E, H, F // 32, 16), np.uint8)
    d_scales = rng.integers(117, 124, (E, H, F // 32), np.uint8)
    gu_bias = rng.standard_normal((E, 2 * F)).astype(np.float32) * 0.3
    d_bias = rng.standard_normal((E, H)).astype(np.float32) * 0.3
    router_w = rng.standard_normal((E, H)).astype(np.float32) / 8
    router_b = rng.standard_normal(E).astype(np.float32)
    folder = tmp_path_factory.mktemp("gpt_oss_gguf")
    p = "model.layers.1.mlp."
    st = folder / "model.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in {
        p + "experts.gate_up_proj_blocks": gu_blocks, p + "experts.gate_up_proj_scales":
        gu_scales, p + "experts.gate_up_proj_bias": gu_bias, p + "experts.down_proj_blocks":
        d_blocks, p + "experts.down_proj_scales": d_scales, p + "experts.down_proj_bias":
        d_bias, p + "router.weight": router_w, p + "router.bias": router_b}.items()}, str(st))
    g = gguf_blocks_of(gu_blocks, gu_scales)
    tensors = {
        "blk.1.ffn_gate_exps.weight": (g[:, 0::2].reshape(E, F, -1), MXFP4),
        "blk.1.ffn_up_exps.weight": (g[:, 1::2].reshape(E, F, -1), MXFP4),
        "blk.1.ffn_down_exps.weight": (gguf_blocks_of(d_blocks, d_scales).reshape(E, H, -1),
                                       MXFP4),
        "blk.1.ffn_gate_exps.bias": np.ascontiguousarray(gu_bias[:, 0::2]),
        "blk.1.ffn_up_exps.bias": np.ascontiguousarray(gu_bias[:, 1::2]),
        "blk.1.ffn_down_exps.bias": d_bias,
        "blk.1.ffn_gate_inp.weight": router_w, "blk.1.ffn_gate_inp.bias": router_b,
    }
    gg = folder / "model.gguf"
    write_gguf(gg, "gpt-oss", tensors, metadata=[("gpt-oss.expert_used_count", K, 4)])
    return str(st), str(gg)


def _inputs(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, H, generator=g)
    idx = torch.randint(0, E, (n, K), generator=g)
    w = torch.softmax(torch.randn(n, K, generator=g), -1)
    return h, idx, w


@pytest.mark.parametrize("n", [1, 3, 70])  # the gemv and the panel paths
def test_gguf_experts_match_the_safetensors_form_and_the_reference(files, n):
    st, gg = files
    ours = nn.GptOssExperts.from_checkpoint(gg, 1)
    theirs = nn.GptOssExperts.from_checkpoint(st, 1)
    assert ours.gate_blocks.shape == (E, F, H // 32, 17) and ours.down_scales is None
    h, idx, w = _inputs(n)
    got, st_out = ours(h, idx, w), theirs(h, idx, w)
    want = torch.from_numpy(gpt_oss_reference(theirs, h, idx, w))
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= 1e-5 * scale
    assert (got - st_out).abs().max().item() <= 1e-5 * scale
    assert torch.equal(got[:1], ours(h[:1], idx[:1], w[:1]))  # batch invariance
    assert torch.equal(got, nn.GptOssExperts.from_checkpoint(gg, 1, num_threads=1)(h, idx, w))


def test_gguf_block_with_router_and_expert_range(files):
    st, gg = files
    moe, ref = nn.GptOssMoE.from_checkpoint(gg, 1), nn.GptOssMoE.from_checkpoint(st, 1,
                                                                                top_k=K)
    assert moe.router.top_k == K  # from the GGUF metadata
    h = _inputs(9)[0]
    got, want = moe(h), ref(h)
    assert torch.equal(moe.router(h)[0], ref.router(h)[0])
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    part = nn.GptOssExperts.from_checkpoint(GGUFCheckpoint(gg), 1, expert_range=(0, 3))
    assert part.gate_blocks.shape[0] == 3 and part.down_blocks.shape[0] == 3


def test_gguf_of_another_architecture_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "k.gguf"
    write_gguf(path, "llama", {"x.weight": rng.standard_normal((4, 4)).astype(np.float32)})
    with pytest.raises(ValueError, match="architecture 'llama'.*gpt-oss"):
        nn.GptOssExperts.from_checkpoint(str(path), 0)


def test_safetensors_block_reads_and_checks_its_config(files, tmp_path):
    """GptOssMoE.from_checkpoint of a folder: top_k (experts_per_token) and the clamp
    (swiglu_limit) from config.json, each checked (a missing top-k was a bare KeyError,
    top-k 0 or above the experts ran, the clamp was always 7); expert_range as a range."""
    import json
    import os

    st, _ = files
    folder = tmp_path / "ck"
    folder.mkdir()
    os.symlink(st, folder / "model.safetensors")
    h = _inputs(5)[0]

    def load(config, **kw):
        (folder / "config.json").write_text(json.dumps(config))
        return nn.GptOssMoE.from_checkpoint(str(folder), 1, **kw)
    base = nn.GptOssMoE.from_checkpoint(st, 1, top_k=K)
    assert torch.equal(load({"experts_per_token": K})(h), base(h))
    clamped = load({"experts_per_token": K, "swiglu_limit": 0.5})
    assert clamped.experts.limit == 0.5 and not torch.equal(clamped(h), base(h))
    assert torch.equal(load({"experts_per_token": K}, expert_range=range(0, E))(h), base(h))
    with pytest.raises(ValueError, match="'experts_per_token' is missing"):
        load({})
    for bad in (0, E + 1, "2"):
        with pytest.raises(ValueError, match="top_k"):
            load({"experts_per_token": bad})
    with pytest.raises(ValueError, match="swiglu_limit"):
        load({"experts_per_token": K, "swiglu_limit": -1})
