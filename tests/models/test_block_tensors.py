"""Every tensor a model block reads is checked at load against the shape the config and
the other tensors imply (a wrong one is a ValueError naming the file, the tensor, its
shape and the shape expected; it used to broadcast silently, or fail at the first
forward naming nothing), GGUF metadata counts are integers, and state dicts read
MXFP4 bytes typed int8 or float8_e8m0fnu by view, never by value."""
import json
import os
import re

import numpy as np
import pytest
import torch

from mxfp4x import nn
from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, save_file
from mxfp4x.testing.kimi_k3 import k3_config, write_k3_checkpoint

E8M0 = getattr(torch, "float8_e8m0fnu", None)
needs_e8m0 = pytest.mark.skipif(E8M0 is None, reason="no float8_e8m0fnu in this torch")


def _raises(exc, *parts):
    """pytest.raises whose message must hold each of ``parts`` (literally), in order."""
    return pytest.raises(exc, match=".*".join(re.escape(p) for p in parts))


# ---- gpt-oss, safetensors -------------------------------------------------------------

E, H, F, K = 4, 64, 64, 2
P = "model.layers.0.mlp."


def _gpt_oss(seed=0):
    rng = np.random.default_rng(seed)

    def u8(*shape, lo=0, hi=256):
        return torch.from_numpy(rng.integers(lo, hi, shape, np.uint8))

    def f32(*shape, scale=0.3):
        return torch.from_numpy(rng.standard_normal(shape) * scale).float()

    return {P + "experts.gate_up_proj_blocks": u8(E, 2 * F, H // 32, 16),
            P + "experts.gate_up_proj_scales": u8(E, 2 * F, H // 32, lo=118, hi=126),
            P + "experts.gate_up_proj_bias": f32(E, 2 * F),
            P + "experts.down_proj_blocks": u8(E, H, F // 32, 16),
            P + "experts.down_proj_scales": u8(E, H, F // 32, lo=118, hi=126),
            P + "experts.down_proj_bias": f32(E, H),
            P + "router.weight": f32(E, H, scale=0.2), P + "router.bias": f32(E)}


def _write_gpt_oss(folder, tensors, **config):
    os.makedirs(folder, exist_ok=True)
    cfg = dict(experts_per_token=K, num_local_experts=E, hidden_size=H, intermediate_size=F)
    cfg.update(config)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return str(folder)


def test_gpt_oss_checkpoint_loads_and_runs(tmp_path):
    moe = nn.GptOssMoE.from_checkpoint(_write_gpt_oss(tmp_path, _gpt_oss()), 0)
    assert moe.experts.n_experts == E and moe.experts.hidden_size == H
    assert torch.isfinite(moe(torch.randn(5, H))).all()
    # a config without the sizes: nothing to compare them with
    bare = _write_gpt_oss(tmp_path / "bare", _gpt_oss(), num_local_experts=None,
                          hidden_size=None, intermediate_size=None)
    assert nn.GptOssMoE.from_checkpoint(bare, 0).router.top_k == K


def _cut(t, *index):
    return t[index].contiguous()


GPT_OSS_CASES = {
    # router rows against the experts: 3 rows never choose expert 3; 6 route past it
    "router 3 rows": ({"router.weight": lambda t: t[:3].contiguous(),
                       "router.bias": lambda t: t[:3].contiguous()},
                      "router.weight", f"expected shape ({E}, {H})", f"got (3, {H})"),
    "router 6 rows": ({"router.weight": lambda t: torch.cat([t, t[:2]]),
                       "router.bias": lambda t: torch.cat([t, t[:2]])},
                      "router.weight", f"expected shape ({E}, {H})", f"got (6, {H})"),
    "router bias": ({"router.bias": lambda t: torch.cat([t, t[:1]])},
                    "router.bias", f"expected shape ({E},)", f"got ({E + 1},)"),
    "router hidden": ({"router.weight": lambda t: t[:, :32].contiguous()},
                      "router.weight", f"expected shape ({E}, {H})", f"got ({E}, 32)"),
    # biases: (E, 1) broadcast silently, (E, 2F + 2) failed in the forward
    "gate_up_bias (E, 1)": ({"experts.gate_up_proj_bias": lambda t: t[:, :1].contiguous()},
                            "gate_up_proj_bias", f"expected shape (*, {2 * F})",
                            f"got ({E}, 1)"),
    "gate_up_bias (E, 2F + 2)": ({"experts.gate_up_proj_bias":
                                  lambda t: torch.cat([t, t[:, :2]], 1)},
                                 "gate_up_proj_bias", f"expected shape (*, {2 * F})",
                                 f"got ({E}, {2 * F + 2})"),
    "gate_up_bias (E - 1, 2F)": ({"experts.gate_up_proj_bias": lambda t: t[1:].contiguous()},
                                 "gate_up_proj_bias", f"expected shape ({E}, {2 * F})",
                                 f"got ({E - 1}, {2 * F})"),
    "down_bias (E, 1)": ({"experts.down_proj_bias": lambda t: t[:, :1].contiguous()},
                         "down_proj_bias", f"expected shape ({E}, {H})", f"got ({E}, 1)"),
    "down_bias (E - 1, H)": ({"experts.down_proj_bias": lambda t: t[1:].contiguous()},
                             "down_proj_bias", f"expected shape ({E}, {H})",
                             f"got ({E - 1}, {H})"),
    # ranks: 3-D blocks failed with "not enough values to unpack", 5-D in the forward
    "gate_up_blocks 3-D": ({"experts.gate_up_proj_blocks":
                            lambda t: t.reshape(E, 2 * F, -1).contiguous()},
                           "gate_up_proj_blocks", "expected shape (*, *, *, 16)",
                           f"got ({E}, {2 * F}, {H // 2})"),
    "down_blocks 5-D": ({"experts.down_proj_blocks":
                         lambda t: t.reshape(E, H, F // 32, 4, 4).contiguous()},
                        "down_proj_blocks", f"expected shape ({E}, {H}, {F // 32}, 16)",
                        f"got ({E}, {H}, {F // 32}, 4, 4)"),
    "down_blocks of another width": ({"experts.down_proj_blocks":
                                      lambda t: torch.cat([t, t], 2)},
                                     "down_proj_blocks",
                                     f"expected shape ({E}, {H}, {F // 32}, 16)",
                                     f"got ({E}, {H}, {2 * F // 32}, 16)"),
    "gate_up_scales": ({"experts.gate_up_proj_scales": lambda t: t[..., :1].contiguous()},
                       "gate_up_proj_scales", f"expected shape ({E}, {2 * F}, {H // 32})",
                       f"got ({E}, {2 * F}, 1)"),
    "down_scales": ({"experts.down_proj_scales": lambda t: t[:, :32].contiguous()},
                    "down_proj_scales", f"expected shape ({E}, {H}, {F // 32})",
                    f"got ({E}, 32, {F // 32})"),
}


@pytest.mark.parametrize("case", sorted(GPT_OSS_CASES))
def test_gpt_oss_tensors_are_checked_at_load(tmp_path, case):
    changes, tensor, *expected = GPT_OSS_CASES[case]
    t = _gpt_oss()
    for name, change in changes.items():
        t[P + name] = change(t[P + name])
    folder = _write_gpt_oss(tmp_path, t)
    full = P + ("" if tensor.startswith("router") else "experts.") + tensor
    with _raises(ValueError, os.path.join(folder, "model.safetensors"), f"{full}'",
                 *expected):
        nn.GptOssMoE.from_checkpoint(folder, 0)


@pytest.mark.parametrize("key, value, found", [
    ("num_local_experts", 5, f"the experts' biases hold {E}"),
    ("hidden_size", 128, f"the experts' blocks are {H}"),
    ("intermediate_size", 32, f"the experts' blocks are {F}"),
])
def test_gpt_oss_config_sizes_are_compared_with_the_tensors(tmp_path, key, value, found):
    folder = _write_gpt_oss(tmp_path, _gpt_oss(), **{key: value})
    with _raises(ValueError, "config.json", f"{key} is {value}", found):
        nn.GptOssMoE.from_checkpoint(folder, 0)
    folder = _write_gpt_oss(tmp_path / "str", _gpt_oss(), **{key: str(value)})
    with _raises(ValueError, f"{key}: expected an integer"):
        nn.GptOssMoE.from_checkpoint(folder, 0)


def _experts_args(t):
    return [t[P + "experts." + n] for n in (
        "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
        "down_proj_blocks", "down_proj_scales", "down_proj_bias")]


def test_gpt_oss_modules_built_directly_are_checked():
    t = _gpt_oss()
    args = _experts_args(t)
    experts = nn.GptOssExperts(*args)
    bad = list(args)
    bad[5] = bad[5][:, :1]
    with _raises(ValueError, "down_bias: expected shape", f"got ({E}, 1)"):
        nn.GptOssExperts(*bad)
    bad = list(args)
    bad[0] = bad[0].reshape(E, 2 * F, -1)
    with _raises(ValueError, "gate_up_blocks: expected shape (*, *, *, 16)"):
        nn.GptOssExperts(*bad)
    router = nn.GptOssRouter(t[P + "router.weight"][:3], t[P + "router.bias"][:3], K)
    with _raises(ValueError, f"router weight: expected shape ({E}, {H})", f"got (3, {H})"):
        nn.GptOssMoE(router, experts)
    # expert-parallel ranges keep the biases whole: at least the range's end
    part = nn.GptOssExperts(args[0][:2], args[1][:2], args[2], args[3][:2], args[4][:2],
                            args[5], expert_range=(0, 2))
    assert part.n_experts == E
    with _raises(ValueError, "gate_up_bias", f"{E} experts, fewer than expert_range"):
        nn.GptOssExperts(args[0][:2], args[1][:2], args[2], args[3][:2], args[4][:2],
                         args[5], expert_range=(E - 1, E + 1), group=object())


# ---- gpt-oss, GGUF --------------------------------------------------------------------

GH = 96  # hidden 3 groups


def _gpt_oss_gguf(path, meta=(("gpt-oss.expert_used_count", 2, 4),), router_rows=5,
                  down_bias_cols=GH):
    pytest.importorskip("gguf", reason="the gguf package writes the test files")
    from gguf_files import MXFP4, write_gguf

    from mxfp4x.testing.layers import gguf_blocks_of

    n, ff = 5, 64
    rng = np.random.default_rng(7)
    gu = gguf_blocks_of(rng.integers(0, 256, (n, 2 * ff, GH // 32, 16), np.uint8),
                        rng.integers(117, 124, (n, 2 * ff, GH // 32), np.uint8))
    down = gguf_blocks_of(rng.integers(0, 256, (n, GH, ff // 32, 16), np.uint8),
                          rng.integers(117, 124, (n, GH, ff // 32), np.uint8))
    bias = (rng.standard_normal((n, 2 * ff)) * 0.3).astype(np.float32)
    tensors = {
        "blk.1.ffn_gate_exps.weight": (gu[:, 0::2].reshape(n, ff, -1), MXFP4),
        "blk.1.ffn_up_exps.weight": (gu[:, 1::2].reshape(n, ff, -1), MXFP4),
        "blk.1.ffn_down_exps.weight": (down.reshape(n, GH, -1), MXFP4),
        "blk.1.ffn_gate_exps.bias": np.ascontiguousarray(bias[:, 0::2]),
        "blk.1.ffn_up_exps.bias": np.ascontiguousarray(bias[:, 1::2]),
        "blk.1.ffn_down_exps.bias": np.ones((n, down_bias_cols), np.float32),
        "blk.1.ffn_gate_inp.weight": np.full((router_rows, GH), 0.01, np.float32),
        "blk.1.ffn_gate_inp.bias": np.zeros(router_rows, np.float32),
    }
    write_gguf(path, "gpt-oss", tensors, metadata=list(meta))
    return str(path)


def test_gpt_oss_gguf_tensors_and_sizes_are_checked(tmp_path):
    from gguf_files import UINT32

    good = nn.GptOssMoE.from_checkpoint(_gpt_oss_gguf(tmp_path / "ok.gguf"), 1)
    assert good.router.top_k == 2 and torch.isfinite(good(torch.randn(3, GH))).all()
    path = _gpt_oss_gguf(tmp_path / "r3.gguf", router_rows=3)
    with _raises(ValueError, path, "'blk.1.ffn_gate_inp.weight'", f"expected shape (5, {GH})",
                 f"got (3, {GH})"):
        nn.GptOssMoE.from_checkpoint(path, 1)
    path = _gpt_oss_gguf(tmp_path / "b.gguf", down_bias_cols=1)
    with _raises(ValueError, path, "'blk.1.ffn_down_exps.bias'", f"expected shape (5, {GH})",
                 "got (5, 1)"):
        nn.GptOssMoE.from_checkpoint(path, 1)
    path = _gpt_oss_gguf(tmp_path / "n.gguf", meta=(("gpt-oss.expert_used_count", 2, UINT32),
                                                   ("gpt-oss.expert_count", 6, UINT32)))
    with _raises(ValueError, path, "gpt-oss.expert_count is 6",
                 "the experts' biases hold 5"):
        nn.GptOssMoE.from_checkpoint(path, 1)


@pytest.mark.parametrize("label, value, vtype", [
    ("FLOAT32 2.9", 2.9, "FLOAT32"), ("FLOAT32 2.0", 2.0, "FLOAT32"),
    ("STRING 3", "3", "STRING"), ("STRING two", "two", "STRING"), ("BOOL", True, "BOOL"),
    ("ARRAY", [2, 3], "ARRAY"), ("zero", 0, "UINT32"),
])
def test_gguf_metadata_counts_are_integers(tmp_path, label, value, vtype):
    """expert_used_count as a float was truncated (2.9 -> 2), a string parsed ("3"), a
    bool read as 1, and "two" failed with int()'s message, naming nothing."""
    import gguf_files

    path = _gpt_oss_gguf(tmp_path / "m.gguf", meta=(
        ("gpt-oss.expert_used_count", value, getattr(gguf_files, vtype)),))
    with _raises(ValueError, path, "'gpt-oss.expert_used_count'", "expected an integer"):
        nn.GptOssMoE.from_checkpoint(path, 1)


def test_kimi_k3_gguf_counts_and_sizes_are_checked(tmp_path):
    pytest.importorskip("gguf", reason="the gguf package writes the test files")
    from gguf_files import FLOAT32, UINT32, k3_layer, write_k3_gguf

    weights = k3_layer(np.random.default_rng(11), 6, 96, 64, 64)
    (path,) = write_k3_gguf(tmp_path / "f.gguf", weights, 1,
                            metadata={"expert_used_count": (2.0, FLOAT32)})
    with _raises(ValueError, path, "'kimi-k3.expert_used_count'", "expected an integer"):
        nn.KimiK3MoE.from_checkpoint(path, 1)
    (path,) = write_k3_gguf(tmp_path / "h.gguf", weights, 1,
                            metadata={"embedding_length": (128, UINT32)})
    with _raises(ValueError, path, "kimi-k3.embedding_length is 128",
                 "'blk.1.ffn_gate_inp.weight' has columns 96"):
        nn.KimiK3MoE.from_checkpoint(path, 1)


# ---- Kimi K3, safetensors -------------------------------------------------------------

TINY = dict(hidden_size=128, routed_expert_hidden_size=64, num_experts=6,
            num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=2,
            num_hidden_layers=2)
KH, KL, KS = 128, 64, 64  # hidden, latent, shared experts' width
BASE = "language_model.model.layers.1.block_sparse_moe."


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("k3"))
    write_k3_checkpoint(folder, k3_config(**TINY), [1], seed=5, shards=1,
                        dense_dtype=torch.float32)
    ckpt = SafeTensorsCheckpoint(folder)
    tensors = {k: ckpt.get(k).clone() for k in ckpt._where}
    return folder, tensors


def _write_k3(folder, tensors, config_changes=None, **changes):
    """The checkpoint with some tensors replaced (None: removed) and config.json's text
    config changed."""
    os.makedirs(folder, exist_ok=True)
    t = dict(tensors)
    for name, value in changes.items():
        if value is None:
            t.pop(BASE + name)
        else:
            t[BASE + name] = value
    config = k3_config(**TINY)
    config["text_config"].update(config_changes or {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(t, os.path.join(folder, "model.safetensors"))
    return str(folder)


def _load_k3(folder):
    return nn.KimiK3MoE.from_checkpoint(folder, 1, progress=False)


def test_kimi_k3_checkpoint_loads(k3, tmp_path):
    block = _load_k3(_write_k3(tmp_path, k3[1]))
    assert block.norm_weight is not None and tuple(block.norm_weight.shape) == (KL,)
    assert torch.isfinite(block(torch.randn(3, KH))).all()


K3_CASES = {  # tensor -> (its replacement from the good one, the shape expected)
    "routed_expert_norm.weight": (lambda t: torch.ones(1), (KL,)),
    "shared_experts.up_proj.weight": (lambda t: t[:1].contiguous(), (KS, KH)),
    "routed_expert_up_proj.weight": (lambda t: t[:1].contiguous(), (KH, KL)),
    "shared_experts.down_proj.weight": (lambda t: t[:1].contiguous(), (KH, KS)),
    "routed_expert_down_proj.weight": (lambda t: t[:, :1].contiguous(), (KL, KH)),
    "shared_experts.gate_proj.weight": (lambda t: t[:, :32].contiguous(), "(*, 128)"),
}


@pytest.mark.parametrize("name", sorted(K3_CASES))
def test_kimi_k3_dense_tensors_are_checked_at_load(k3, tmp_path, name):
    """A norm of one element, a projection of one row: they broadcast, silently."""
    change, shape = K3_CASES[name]
    bad = change(k3[1][BASE + name])
    folder = _write_k3(tmp_path, k3[1], **{name: bad})
    with _raises(ValueError, os.path.join(folder, "model.safetensors"), f"{BASE}{name}'",
                 f"expected shape {shape}", f"got {tuple(bad.shape)}"):
        _load_k3(folder)


def test_kimi_k3_norm_the_config_asks_for_is_required(k3, tmp_path):
    folder = _write_k3(tmp_path / "a", k3[1], **{"routed_expert_norm.weight": None})
    with _raises(ValueError, f"no tensor '{BASE}routed_expert_norm.weight'",
                 "latent_moe_use_norm"):
        _load_k3(folder)
    # a config without the norm: the block has none
    off = _write_k3(tmp_path / "b", k3[1], {"latent_moe_use_norm": False},
                    **{"routed_expert_norm.weight": None})
    assert _load_k3(off).norm_weight is None
    with _raises(ValueError, "latent_moe_use_norm: expected true or false"):
        _load_k3(_write_k3(tmp_path / "c", k3[1], {"latent_moe_use_norm": "yes"}))


@pytest.mark.parametrize("changes, parts", [
    ({"hidden_size": 256}, ("hidden_size is 256", "gate.weight' has columns 128")),
    ({"routed_expert_hidden_size": 32}, ("routed_expert_hidden_size is 32", "latents are 64")),
    ({"moe_intermediate_size": 64}, ("moe_intermediate_size is 64", "width is 32")),
    ({"num_shared_experts": 3},
     ("moe_intermediate_size x num_shared_experts is 96", "gate_proj.weight' has rows 64")),
])
def test_kimi_k3_config_sizes_are_compared_with_the_tensors(k3, tmp_path, changes, parts):
    with _raises(ValueError, "config.json", *parts):
        _load_k3(_write_k3(tmp_path, k3[1], changes))


def test_kimi_k3_block_built_directly_is_checked(k3, tmp_path):
    good = _load_k3(_write_k3(tmp_path, k3[1]))
    args = dict(router=good.router, down_proj=good.down_proj, experts=good.experts,
                norm_weight=good.norm_weight, up_proj=good.up_proj,
                shared_gate=good.shared_gate, shared_up=good.shared_up,
                shared_down=good.shared_down)
    nn.KimiK3MoE(**args)
    for name, bad in (("norm_weight", torch.ones(1)), ("shared_up", good.shared_up[:1]),
                      ("up_proj", good.up_proj[:1]), ("shared_down", good.shared_down[:1]),
                      ("down_proj", good.down_proj.t())):
        with _raises(ValueError, f"{name}: expected shape", f"got {tuple(bad.shape)}"):
            nn.KimiK3MoE(**dict(args, **{name: bad}))
    with _raises(ValueError, "shared_gate: expected a float tensor"):
        nn.KimiK3MoE(**dict(args, shared_gate=good.shared_gate.to(torch.int32)))


# ---- state dicts: bytes by view -------------------------------------------------------

def _typed(state, scale_dtype, packed_dtype=torch.int8):
    """A state dict with its scale bytes typed ``scale_dtype`` and the other byte tensors
    int8: the same bytes, as checkpoints may store them."""
    out = {}
    for k, v in state.items():
        if v.dtype != torch.uint8:
            out[k] = v
        elif k.endswith(("scale", "scales", "scale_bytes")):
            out[k] = v.view(scale_dtype)
        else:
            out[k] = v.view(packed_dtype)
    return out


def _kimi_experts(seed):
    g = torch.Generator().manual_seed(seed)

    def w(o, groups):
        return (torch.randint(0, 256, (3, o, groups, 16), dtype=torch.uint8, generator=g),
                torch.randint(119, 127, (3, o, groups), dtype=torch.uint8, generator=g))
    return nn.KimiK3Experts(w(64, 2), w(64, 2), w(64, 2))


@needs_e8m0
@pytest.mark.parametrize("assign", [False, True])
def test_kimi_k3_experts_load_typed_bytes_by_view(assign):
    """load_state_dict cast float8_e8m0fnu scales by value (byte s -> 2^(s-127): 0 for
    every scale a checkpoint holds); with assign=True they stayed typed and the forward
    refused them."""
    src, dst = _kimi_experts(0), _kimi_experts(1)
    h, sel, p = torch.randn(4, 64), torch.tensor([[0, 1], [2, 0], [1, 2], [0, 0]]), \
        torch.rand(4, 2)
    want = src(h, sel, p)
    assert not torch.equal(dst(h, sel, p), want)
    state = src.state_dict()
    dst.load_state_dict(_typed(state, E8M0), assign=assign)
    for k, v in dst.state_dict().items():
        assert v.dtype == torch.uint8 and torch.equal(v, state[k]), k
    assert torch.equal(dst(h, sel, p), want)
    with _raises(TypeError, "'0.w1.weight_scale'", "expected bytes"):
        dst.load_state_dict({**state, "0.w1.weight_scale": state["0.w1.weight_scale"].float()})


@needs_e8m0
def test_gpt_oss_and_generic_experts_load_typed_bytes_by_view():
    t = _gpt_oss()
    args = _experts_args(t)
    src = nn.GptOssExperts(*args)
    other = _gpt_oss(seed=1)
    dst = nn.GptOssExperts(*_experts_args(other))
    h, idx, w = torch.randn(3, H), torch.tensor([[0, 1], [2, 3], [3, 0]]), torch.rand(3, 2)
    dst.load_state_dict(_typed(src.state_dict(), E8M0))
    assert dst.gate_up_scales.dtype == torch.uint8
    assert torch.equal(dst(h, idx, w), src(h, idx, w))

    bank = nn.MXFP4Experts.from_packed(args[0], args[1])
    empty = nn.MXFP4Experts(E, 2 * F, H)
    empty.load_state_dict(_typed(bank.state_dict(), E8M0))
    assert torch.equal(empty.scale_bytes, bank.scale_bytes)
    assert torch.equal(empty.packed_weights, bank.packed_weights)


def test_gpt_oss_experts_take_numpy_bytes(rng):
    """GptOssExperts built from numpy byte arrays (read by view) runs as from tensors."""
    e, f, h = 2, 32, 32
    gub = rng.integers(0, 256, (e, 2 * f, h // 32, 16), dtype=np.uint8)
    gus = rng.integers(120, 130, (e, 2 * f, h // 32), dtype=np.uint8)
    db = rng.integers(0, 256, (e, h, f // 32, 16), dtype=np.uint8)
    ds = rng.integers(120, 130, (e, h, f // 32), dtype=np.uint8)
    biases = torch.zeros(e, 2 * f), torch.zeros(e, h)
    a = nn.GptOssExperts(gub, gus, biases[0], db, ds, biases[1])
    b = nn.GptOssExperts(*(torch.from_numpy(t) for t in (gub, gus)), biases[0],
                         *(torch.from_numpy(t) for t in (db, ds)), biases[1])
    x = torch.from_numpy(rng.standard_normal((3, h))).float()
    ids, mix = torch.tensor([[0], [1], [1]]), torch.ones(3, 1)
    assert torch.equal(a(x, ids, mix), b(x, ids, mix))
