"""What every module constructor and checkpoint loader is given is checked where it is
given, before any file is read: ``num_threads`` by the op's own rule (also when set on a
module afterwards)."""
import numpy as np
import pytest
import torch

import mxfp4x
from mxfp4x import _validation, nn
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
            _validation.check_num_threads(bad)
        with pytest.raises(type(op.value)) as module:
            nn.MXFP4Experts(E, 32, 64, num_threads=bad)
        assert str(module.value) == str(op.value)
