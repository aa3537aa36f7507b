"""What every module constructor and checkpoint loader is given is checked where it is
given, before any file is read: ``num_threads`` by the op's own rule (also when set on a
module afterwards), ``expert_range`` by the one parser (a pair or a range of step 1, the
same module either way, named in every refusal), each loader's parameters explicit."""
import inspect
import sys

import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x import nn
from mxfp4x._core import arguments as _arguments
from mxfp4x.testing.gpt_oss import write_gpt_oss_layer
from mxfp4x.testing.kimi_k3 import k3_config, write_k3_checkpoint

E, H, F, K, LAYER = 6, 64, 64, 2, 1
K3 = dict(hidden_size=128, routed_expert_hidden_size=64, num_experts=E,
          num_experts_per_token=2, moe_intermediate_size=64, num_shared_experts=1,
          num_hidden_layers=2)
BAD_THREADS = [0, -1, "2", 2.5, True, 2.0]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    write_gpt_oss_layer(str(folder), layer=LAYER, seed=5, num_local_experts=E, hidden_size=H,
                        intermediate_size=F, experts_per_token=K)
    return str(folder)


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory, gpt_oss):
    """The same layer as llama.cpp's converter writes it (gate and up split)."""
    pytest.importorskip("gguf")
    from gguf_files import write_gguf

    from mxfp4x.checkpoints.gguf import MXFP4
    from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint
    from mxfp4x.testing.layers import gguf_blocks_of

    ck = SafeTensorsCheckpoint(gpt_oss)
    p = f"model.layers.{LAYER}.mlp."

    def arr(name):
        t = ck.get(p + name)
        return t.float().numpy() if t.is_floating_point() else t.numpy()
    g = gguf_blocks_of(arr("experts.gate_up_proj_blocks"), arr("experts.gate_up_proj_scales"))
    d = gguf_blocks_of(arr("experts.down_proj_blocks"), arr("experts.down_proj_scales"))
    gu_bias = arr("experts.gate_up_proj_bias")
    q = f"blk.{LAYER}."
    tensors = {q + "ffn_gate_exps.weight": (g[:, 0::2].reshape(E, F, -1), MXFP4),
               q + "ffn_up_exps.weight": (g[:, 1::2].reshape(E, F, -1), MXFP4),
               q + "ffn_down_exps.weight": (d.reshape(E, H, -1), MXFP4),
               q + "ffn_gate_exps.bias": np.ascontiguousarray(gu_bias[:, 0::2]),
               q + "ffn_up_exps.bias": np.ascontiguousarray(gu_bias[:, 1::2]),
               q + "ffn_down_exps.bias": arr("experts.down_proj_bias"),
               q + "ffn_gate_inp.weight": arr("router.weight"),
               q + "ffn_gate_inp.bias": arr("router.bias")}
    path = tmp_path_factory.mktemp("gpt_oss_gguf") / "model.gguf"
    write_gguf(path, "gpt-oss", tensors, metadata=[("gpt-oss.expert_used_count", K, 4)])
    return str(path)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3")
    write_k3_checkpoint(str(folder), k3_config(**K3), [LAYER], seed=3, shards=2,
                        dense_dtype=torch.float32)
    return str(folder)


class _Group:
    """Stands for a process group where a module is only built (no forward runs)."""


def _gpt_oss_tensors(rng):
    gu = torch.from_numpy(rng.standard_normal((E, 2 * F, H)) * 0.1).float()
    down = torch.from_numpy(rng.standard_normal((E, H, F)) * 0.1).float()
    (gub, gus), (db, ds) = mxfp4x.quantize(gu), mxfp4x.quantize(down)
    return (gub, gus, torch.from_numpy(rng.standard_normal((E, 2 * F))).float(), db, ds,
            torch.from_numpy(rng.standard_normal((E, H))).float())


# ---- num_threads ------------------------------------------------------------------------

def _missing(tmp_path):
    return str(tmp_path / "no-such-checkpoint")


LOADERS = {
    "MXFP4Experts.from_safetensors": lambda path, **kw: nn.MXFP4Experts.from_safetensors(
        path, "a", "b", **kw),
    "GptOssExperts.from_checkpoint": lambda path, **kw: nn.GptOssExperts.from_checkpoint(
        path, LAYER, **kw),
    "GptOssMoE.from_checkpoint": lambda path, **kw: nn.GptOssMoE.from_checkpoint(
        path, LAYER, **kw),
    "load_gpt_oss_experts": lambda path, **kw: nn.load_gpt_oss_experts(path, progress=False,
                                                                       **kw),
    "KimiK3MoE.from_checkpoint": lambda path, **kw: nn.KimiK3MoE.from_checkpoint(
        path, LAYER, progress=False, **kw),
}


@pytest.mark.parametrize("bad", BAD_THREADS, ids=repr)
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_loaders_refuse_bad_num_threads_before_reading_a_file(tmp_path, loader, bad):
    """The path does not exist: the refusal must name num_threads, not the file (it used
    to come at the first forward, after the whole model had loaded)."""
    with pytest.raises((TypeError, ValueError), match="num_threads"):
        LOADERS[loader](_missing(tmp_path), num_threads=bad)


@pytest.mark.parametrize("bad", BAD_THREADS, ids=repr)
def test_from_pretrained_and_its_config_refuse_bad_num_threads(tmp_path, bad):
    pytest.importorskip("transformers")
    from mxfp4x.integrations import transformers as mxt

    with pytest.raises((TypeError, ValueError), match="num_threads"):
        mxt.Mxfp4xConfig(num_threads=bad)
    with pytest.raises((TypeError, ValueError), match="num_threads"):
        mxt.from_pretrained(_missing(tmp_path), num_threads=bad)
    assert mxt.Mxfp4xConfig(num_threads=np.int64(3)).num_threads == 3


def _modules(rng, k3):
    """A module of each class that holds num_threads, built with ``num_threads=n``."""
    t = _gpt_oss_tensors(rng)
    gguf = [torch.from_numpy(rng.integers(0, 256, (E, F, H // 32, 17), dtype=np.uint8)),
            torch.from_numpy(rng.integers(0, 256, (E, F, H // 32, 17), dtype=np.uint8)),
            t[2][:, 0::2], t[2][:, 1::2],
            torch.from_numpy(rng.integers(0, 256, (E, H, F // 32, 17), dtype=np.uint8)), t[5]]
    moe = nn.KimiK3MoE.from_checkpoint(k3, LAYER, progress=False)
    ex = moe.experts
    w = [ex.weights().gate_up_packed, ex.weights().gate_up_scales, ex.weights().down_packed,
         ex.weights().down_scales]
    n = ex.n_local
    return {
        "MXFP4Experts": lambda **kw: nn.MXFP4Experts(E, 32, 64, **kw),
        "MXFP4Experts.from_packed": lambda **kw: nn.MXFP4Experts.from_packed(t[0], t[1], **kw),
        "MXFP4Experts.from_float": lambda **kw: nn.MXFP4Experts.from_float(
            torch.from_numpy(rng.standard_normal((2, 8, 64))).float(), **kw),
        "GptOssExperts": lambda **kw: nn.GptOssExperts(*t, **kw),
        "GptOssExperts.from_gguf_blocks": lambda **kw: nn.GptOssExperts.from_gguf_blocks(
            *gguf, **kw),
        "KimiK3Experts": lambda **kw: nn.KimiK3Experts(
            (list(w[0][:n]), list(w[1][:n])), (list(w[0][n:]), list(w[1][n:])),
            (list(w[2]), list(w[3])), **kw),
    }


def test_constructors_check_num_threads_and_so_does_setting_it(rng, k3):
    for name, make in _modules(rng, k3).items():
        for bad in BAD_THREADS:
            with pytest.raises((TypeError, ValueError), match="num_threads"):
                make(num_threads=bad)
        m = make(num_threads=np.int64(2))
        assert m.num_threads == 2 and type(m.num_threads) is int, name
        assert make().num_threads is None, name
        for bad in BAD_THREADS:
            with pytest.raises((TypeError, ValueError), match="num_threads"):
                m.num_threads = bad
            assert m.num_threads == 2, name  # a refused value leaves the module as it was
        m.num_threads = None
        assert m.num_threads is None
        m.num_threads = 1
        assert m.num_threads == 1


def test_the_modules_use_the_ops_rule(rng, k3):
    """One rule: a count the op takes, the modules take; one it refuses, they refuse with
    the op's words."""
    for bad in BAD_THREADS:
        with pytest.raises((TypeError, ValueError)) as op:
            _arguments.check_num_threads(bad)
        with pytest.raises(type(op.value)) as module:
            nn.MXFP4Experts(E, 32, 64, num_threads=bad)
        assert str(module.value) == str(op.value)


# ---- expert_range -----------------------------------------------------------------------

def _same_modules(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    for m, n in zip(a.modules(), b.modules(), strict=True):
        assert getattr(m, "expert_range", None) == getattr(n, "expert_range", None)
        assert type(m) is type(n)


def _range_loaders(gpt_oss, gpt_oss_gguf, k3):
    """name -> (load(expert_range), (e0, e1) of a range it takes, needs a group)."""
    blocks, scales = (f"model.layers.{LAYER}.mlp.experts.gate_up_proj_{k}"
                      for k in ("blocks", "scales"))
    out = {
        "MXFP4Experts.from_safetensors": lambda r, g: nn.MXFP4Experts.from_safetensors(
            gpt_oss, blocks, scales, expert_range=r, group=g),
        "GptOssExperts.from_checkpoint": lambda r, g: nn.GptOssExperts.from_checkpoint(
            gpt_oss, LAYER, expert_range=r, group=g),
        "GptOssMoE.from_checkpoint": lambda r, g: nn.GptOssMoE.from_checkpoint(
            gpt_oss, LAYER, expert_range=r, group=g),
        "load_gpt_oss_experts": lambda r, g: torch.nn.ModuleList(nn.load_gpt_oss_experts(
            gpt_oss, [LAYER], progress=False, expert_range=r, group=g)),
        "KimiK3MoE.from_checkpoint": lambda r, g: nn.KimiK3MoE.from_checkpoint(
            k3, LAYER, progress=False, expert_range=r, group=g),
    }
    if gpt_oss_gguf is not None:
        out.update({
            "GptOssExperts.from_checkpoint(gguf)": lambda r, g: nn.GptOssExperts.from_checkpoint(
                gpt_oss_gguf, LAYER, expert_range=r, group=g),
            "GptOssMoE.from_checkpoint(gguf)": lambda r, g: nn.GptOssMoE.from_checkpoint(
                gpt_oss_gguf, LAYER, expert_range=r, group=g)})
    return out


@pytest.fixture(scope="module")
def range_loaders(request, gpt_oss, k3):
    try:
        gg = request.getfixturevalue("gpt_oss_gguf")
    except pytest.skip.Exception:
        gg = None
    return _range_loaders(gpt_oss, gg, k3)


@pytest.mark.parametrize("e0,e1", [(1, 3), (0, E), (2, E)])
def test_a_range_and_a_pair_give_the_same_module(range_loaders, e0, e1):
    group = _Group()
    for name, load in range_loaders.items():
        by_range, by_pair = load(range(e0, e1), group), load((e0, e1), group)
        _same_modules(by_range, by_pair)
        held = [m.expert_range for m in by_pair.modules() if hasattr(m, "expert_range")]
        assert held and all(r == (e0, e1) for r in held), name


@pytest.mark.parametrize("bad,kind", [
    (range(0, 4, 2), ValueError), (range(3, 1), ValueError), ((3, 1), ValueError),
    ((-1, 2), ValueError), ((0, E + 1), ValueError), (range(2, E + 3), ValueError),
    ((0.0, 2.0), TypeError), ((0, 2.5), TypeError), ((0, 1, 2), ValueError),
    ("0:2", TypeError), (3, TypeError)], ids=repr)
def test_a_bad_range_is_refused_naming_expert_range(range_loaders, bad, kind):
    for name, load in range_loaders.items():
        with pytest.raises(kind, match="expert_range"):
            load(bad, _Group())
            pytest.fail(f"{name} took expert_range={bad!r}")


PUBLIC_LOADERS = {
    "MXFP4Experts": nn.MXFP4Experts.__init__,
    "MXFP4Experts.from_packed": nn.MXFP4Experts.from_packed,
    "MXFP4Experts.from_safetensors": nn.MXFP4Experts.from_safetensors,
    "GptOssExperts": nn.GptOssExperts.__init__,
    "GptOssExperts.from_gguf_blocks": nn.GptOssExperts.from_gguf_blocks,
    "GptOssExperts.from_checkpoint": nn.GptOssExperts.from_checkpoint,
    "GptOssMoE.from_checkpoint": nn.GptOssMoE.from_checkpoint,
    "load_gpt_oss_experts": nn.load_gpt_oss_experts,
    "KimiK3Experts": nn.KimiK3Experts.__init__,
    "KimiK3MoE.from_checkpoint": nn.KimiK3MoE.from_checkpoint,
    "load_gguf_experts": mxfp4x.checkpoints.load_gguf_experts,
}


@pytest.mark.parametrize("name", sorted(PUBLIC_LOADERS))
def test_every_loader_shows_its_parameters(name):
    """help() and inspect.signature show expert_range (and num_threads where the module
    runs the kernels): no parameter hides in **kwargs."""
    params = inspect.signature(PUBLIC_LOADERS[name]).parameters
    assert "expert_range" in params
    assert not any(p.kind == p.VAR_KEYWORD for p in params.values()), name
    if name != "load_gguf_experts":
        assert "num_threads" in params


def test_one_load_parses_the_range_once(monkeypatch, gpt_oss, k3):
    """The pair is read once per load, however many steps use it (a gpt-oss load read it
    up to six times)."""
    real = _arguments.parse_expert_range
    raw = []

    def counting(value):
        if not isinstance(value, _arguments.ExpertRange):  # an already parsed range
            raw.append(value)
        return real(value)
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("mxfp4x") and \
                getattr(mod, "parse_expert_range", None) is real:
            monkeypatch.setattr(mod, "parse_expert_range", counting)
    for load in (lambda r: nn.GptOssMoE.from_checkpoint(gpt_oss, LAYER, expert_range=r),
                 lambda r: nn.GptOssExperts.from_checkpoint(gpt_oss, LAYER, expert_range=r),
                 lambda r: nn.KimiK3MoE.from_checkpoint(k3, LAYER, expert_range=r,
                                                        progress=False)):
        raw.clear()
        load(range(0, E))
        assert raw == [range(0, E)]


@pytest.mark.parametrize("gguf", [False, True])
def test_some_experts_without_a_group_refuse_the_others(gpt_oss, request, gguf):
    """expert_range without a group means the same for every family: the module holds
    those experts, gives the full module's bits for tokens routed to them, and refuses a
    token routed elsewhere with an IndexError naming the expert."""
    path = request.getfixturevalue("gpt_oss_gguf") if gguf else gpt_oss
    blocks, scales = (f"model.layers.{LAYER}.mlp.experts.gate_up_proj_{k}"
                      for k in ("blocks", "scales"))
    rng = np.random.default_rng(7)
    h = torch.from_numpy(rng.standard_normal((5, H))).float()
    w = torch.from_numpy(rng.random((5, K))).float()
    inside = torch.from_numpy(rng.integers(2, 5, (5, K)))
    outside = inside.clone()
    outside[3, 1] = 1
    full = nn.GptOssExperts.from_checkpoint(path, LAYER)
    part = nn.GptOssExperts.from_checkpoint(path, LAYER, expert_range=(2, 5))
    assert torch.equal(part(h, inside, w), full(h, inside, w))
    with pytest.raises(IndexError, match="expert 1 is not held"):
        part(h, outside, w)
    if not gguf:
        full = nn.MXFP4Experts.from_safetensors(gpt_oss, blocks, scales)
        part = nn.MXFP4Experts.from_safetensors(gpt_oss, blocks, scales, expert_range=(2, 5))
        assert torch.equal(part(h, inside, w), full(h, inside, w))
        with pytest.raises(IndexError, match="expert 1 is not held"):
            part(h, outside, w)
