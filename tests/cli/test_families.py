"""One families registry (mxfp4x.checkpoints.families.FAMILIES) for both model families:
the loaders take their tensor names from it, and ``verify``, ``info`` and the ``layer``
command read gpt-oss checkpoints through it as they read Kimi K3's."""
import json
import os

import pytest
import torch

from mxfp4x import nn
from mxfp4x.checkpoints import families as ck
from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint
from mxfp4x.checkpoints.verify import verify_experts
from mxfp4x.testing.gpt_oss import write_gpt_oss_layer, write_gpt_oss_model

E, H, F = 4, 64, 64
# the projections' tensors of a layer, as the release names them
NAMES = ["model.layers.{}.mlp.experts." + f"{p}_proj_{k}" for p in ("gate_up", "down")
         for k in ("blocks", "scales")]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """Read-only: a tiny gpt-oss model of 2 layers as mxfp4x.testing writes it
    (transformers' config, an index and two files)."""
    pytest.importorskip("transformers")
    folder = str(tmp_path_factory.mktemp("gpt_oss"))
    write_gpt_oss_model(folder, seed=3, layers_per_file=1, num_hidden_layers=2,
                        hidden_size=H, intermediate_size=F, num_local_experts=E,
                        num_experts_per_tok=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, vocab_size=512)
    return folder


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_the_registry_holds_both_families_for_every_reader():
    from mxfp4x.cli._families import MODELS
    from mxfp4x.models.gpt_oss import tensor_names

    assert {"gpt-oss", "kimi-k3"} <= set(ck.FAMILIES)
    assert ck.family_of({"model_type": "gpt_oss"}) is ck.FAMILIES["gpt-oss"]
    assert ck.family_of({"model_type": "kimi_linear"}) is ck.FAMILIES["kimi-k3"]
    for model in MODELS.values():  # the layer command's models name their family
        assert ck.FAMILIES[model.family.name] is model.family
        assert model.n_experts() >= model.top_k() >= 1
    g = ck.FAMILIES["gpt-oss"]
    names = tensor_names("", 7)  # the gpt-oss loader's names are the registry's
    for role in g.roles:
        assert names[f"{role}_blocks"] == g.tensor("", 7, None, role, g.packed)
        assert names[f"{role}_scales"] == g.tensor("", 7, None, role, g.scale)
    assert [names[a] for a in ("gate_up_blocks", "gate_up_scales", "down_blocks",
                               "down_scales")] == [n.format(7) for n in NAMES]
    assert names["down_bias"] == "model.layers.7.mlp.experts.down_proj_bias"


def test_verify_a_gpt_oss_checkpoint(gpt_oss, tmp_path, cli_main, flip_byte):
    """It was refused: "unknown MoE family (model_type 'gpt_oss')"."""
    folder = _copy(gpt_oss, tmp_path / "ck")
    manifest = tmp_path / "sha256.json"
    code, out, err = cli_main("verify", folder, "--write-manifest", manifest)
    assert code == 0, out + err
    assert "8 expert tensors of layers [0, 1]" in out
    assert "the bytes handed to the kernels are the file's bytes" in out
    assert sorted(json.loads(manifest.read_text())) == sorted(
        n.format(layer) for layer in (0, 1) for n in NAMES)
    code, out, _ = cli_main("verify", folder, "--layers", "1", "--manifest", manifest)
    assert code == 0 and "4 expert tensors of layers [1] and 4 other tensors" in out
    victim = NAMES[3].format(1)
    flip_byte(SafeTensorsCheckpoint(folder), victim)
    code, out, _ = cli_main("verify", folder, "--manifest", manifest)
    assert code == 1 and f"MISMATCH {victim}: the file's bytes differ from the manifest" in out


def test_verify_checks_what_the_gpt_oss_loader_hands_the_kernels(gpt_oss):
    experts = nn.GptOssExperts.from_checkpoint(gpt_oss, 1)
    handed = dict(zip((n.format(1) for n in NAMES),
                      (experts.gate_up_blocks, experts.gate_up_scales, experts.down_blocks,
                       experts.down_scales), strict=True))
    assert not verify_experts(gpt_oss, layers=[1], handed=handed)["mismatches"]
    victim = NAMES[0].format(1)
    handed[victim] = handed[victim].clone()
    handed[victim][1, 2, 0, 3] ^= 0x21
    assert verify_experts(gpt_oss, layers=[1], handed=handed)["mismatches"] == [
        (victim, "the bytes handed to the kernels differ from the file's")]


def test_verify_gpt_oss_missing_tensor_and_expert_count(gpt_oss, tmp_path, cli_main):
    folder = _copy(gpt_oss, tmp_path / "ck")
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        doc = json.load(f)
    gone = NAMES[1].format(0)
    del doc["weight_map"][gone]
    with open(index, "w") as f:
        json.dump(doc, f)
    config = os.path.join(folder, "config.json")
    with open(config) as f:
        cfg = json.load(f)
    cfg["num_local_experts"] = E + 1
    with open(config, "w") as f:
        json.dump(cfg, f)
    code, out, _ = cli_main("verify", folder)
    assert code == 1
    assert f"MISMATCH {gone}: missing from the checkpoint" in out
    # the loader refuses the projection without its scales: its blocks reach no kernel
    assert f"MISMATCH {NAMES[0].format(0)}: not handed to the kernels" in out
    assert (f"MISMATCH {NAMES[2].format(1)}: holds {E} experts, config.json's "
            f"num_local_experts is {E + 1}") in out


def test_verify_a_gpt_oss_layer_file(tmp_path, cli_main):
    """The layer writer's single file (layer 3 only) and its config.json."""
    write_gpt_oss_layer(str(tmp_path), layer=3, seed=1, num_local_experts=E, hidden_size=H,
                        intermediate_size=F, experts_per_token=2)
    code, out, err = cli_main("verify", tmp_path / "model.safetensors")
    assert code == 0, out + err
    assert "4 expert tensors of layers [3]" in out
    # and the loader of every layer finds it by name (it counted layers from 0)
    (only,) = nn.load_gpt_oss_experts(str(tmp_path), progress=False)
    assert torch.equal(only.down_blocks, nn.GptOssExperts.from_checkpoint(
        str(tmp_path), 3).down_blocks)


@pytest.mark.parametrize("family", ["gpt-oss", "kimi-k3"])
def test_info_of_a_safetensors_checkpoint(family, gpt_oss, k3, cli_main):
    folder = gpt_oss if family == "gpt-oss" else k3
    code, out, err = cli_main("info", folder, "--json")
    assert code == 0, err
    report = json.loads(out)
    if family == "gpt-oss":
        assert report["family"] == "gpt-oss" and report["model_type"] == "gpt_oss"
        assert (report["n_experts"], report["top_k"]) == (E, 2)
        assert report["expert_layers"] == [0, 1] and report["expert_tensors"] == 8
        per_layer = E * (2 * F * H + H * F) // 32 * 17  # 16 packed bytes and a scale
    else:
        assert report["family"] == "kimi-k3" and report["model_type"] == "kimi_linear"
        assert (report["n_experts"], report["top_k"]) == (16, 4)
        assert report["expert_layers"] == [1, 5] and report["expert_tensors"] == 2 * 96
        per_layer = 16 * 3 * 128 * 64 // 32 * 17
    assert report["expert_bytes"] == 2 * per_layer
    code, out, err = cli_main("info", folder)
    assert code == 0, err
    assert f"family         {family}" in out and "expert layers" in out
