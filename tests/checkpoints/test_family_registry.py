"""The families registry is data: a family the package has never heard of, described by
one ``ExpertNaming`` and registered in ``FAMILIES`` (here by a fixture, and taken out
again), is read by ``verify`` (the function and the command line), ``info`` and the
registry's per-expert loader exactly as gpt-oss and Kimi K3 are, with no code of its own.

The toy is a Qwen3-MoE-style naming: each expert's projections stored as their own MXFP4
tensors, ``model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight_{blocks,scales}``
(names no registered family uses), and config keys of its own: the experts' count under
``n_routed_experts`` (not Kimi K3's ``num_experts``, the registry's default, so that a
rule reading that key instead of the entry's fails here; ``num_experts`` is its alias, as
a transformers ``attribute_map`` would take it), top-k under ``num_experts_per_tok``."""
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from mxfp4x import cli
from mxfp4x._core.files import atomic_write
from mxfp4x.checkpoints import families as ck
from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, write_file
from mxfp4x.checkpoints.verify import verify_experts

TOY = ck.ExpertNaming(
    name="toy-qwen3-moe", model_types=("toy_qwen3_moe",),
    expert="model.layers.{layer}.mlp.experts.{expert}.{proj}.{kind}",
    packed="weight_blocks", scale="weight_scales",
    roles={"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    block="model.layers.{layer}.mlp.",
    router="model.layers.{layer}.mlp.gate.weight",
    n_experts_key="n_routed_experts", top_k_key="num_experts_per_tok",
    config_aliases={"num_experts": "n_routed_experts"},
)
SIZES = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=6,
             num_experts_per_tok=2, num_hidden_layers=4)
LAYERS = (1, 3)  # layers 0 and 2 dense: the loaders find the MoE layers by name
ROLES = ("gate", "up", "down")


def _shape(role):
    """(d_out, d_in) of a projection."""
    h, f = SIZES["hidden_size"], SIZES["moe_intermediate_size"]
    return (h, f) if role == "down" else (f, h)


def write_toy_checkpoint(folder, config, layers=LAYERS, seed=0, shards=2):
    """A random checkpoint of the toy family: config.json, ``shards`` safetensors files
    and the index, every name from the registry entry.  Returns the tensors written,
    name -> tensor (the expert bytes: uint8, every value drawn from 0..255)."""
    rng = np.random.default_rng(seed)
    n_exp, hid = config[TOY.n_experts_key], config["hidden_size"]
    written = {}
    files = [{} for _ in range(shards)]
    for layer in layers:
        router = torch.from_numpy(rng.standard_normal((n_exp, hid)).astype(np.float32))
        written[TOY.router.format(layer=layer)] = router
        files[0][TOY.router.format(layer=layer)] = router
        for e in range(n_exp):
            for role in ROLES:
                d_out, d_in = _shape(role)
                for kind, cols in ((TOY.packed, d_in // 2), (TOY.scale, d_in // 32)):
                    name = TOY.tensor("", layer, e, role, kind)
                    written[name] = t = torch.from_numpy(
                        rng.integers(0, 256, (d_out, cols), dtype=np.uint8))
                    files[e % shards][name] = t
    os.makedirs(folder, exist_ok=True)
    with atomic_write(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    where = {}
    for i, entries in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_file(os.path.join(folder, fname),
                   {n: (t.dtype, tuple(t.shape), lambda t=t: t) for n, t in entries.items()})
        where.update(dict.fromkeys(entries, fname))
    with atomic_write(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": where}, f)
    return written


def _sha256(t):
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Read-only: (folder, tensors written) of a toy checkpoint of layers 1 and 3."""
    folder = str(tmp_path_factory.mktemp("toy"))
    written = write_toy_checkpoint(folder, dict(SIZES, model_type="toy_qwen3_moe"))
    return folder, written


@pytest.fixture
def toy_family(monkeypatch):
    """The toy registered in the families registry for one test, then taken out."""
    monkeypatch.setitem(ck.FAMILIES, TOY.name, TOY)
    return TOY


def _expert_tensors(written):
    """name -> tensor of the expert tensors written (the router left out)."""
    return {n: t for n, t in written.items() if not n.endswith(".gate.weight")}


def test_the_toy_is_registered_only_where_a_test_asks():
    config = {"model_type": "toy_qwen3_moe"}
    assert TOY.name not in ck.FAMILIES
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(ck.FAMILIES, TOY.name, TOY)
        assert ck.family_of(config) is TOY
        assert ck.num_experts({**config, "n_routed_experts": 6}, TOY) == 6
        assert ck.num_experts({**config, "num_experts": 6}, TOY) == 6  # the alias
    assert TOY.name not in ck.FAMILIES
    with pytest.raises(ValueError, match="unknown MoE family"):
        ck.family_of(config)


def test_the_toy_names_are_its_own(toy):
    folder, written = toy
    experts = _expert_tensors(written)
    assert len(experts) == len(LAYERS) * SIZES["n_routed_experts"] * len(ROLES) * 2
    assert "model.layers.3.mlp.experts.5.down_proj.weight_scales" in experts
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_blocks" in experts
    for t in experts.values():  # random bytes, not a constant a wrong read could match
        assert len(torch.unique(t)) > 1
    ckpt = SafeTensorsCheckpoint(folder)
    for family in (ck.GPT_OSS, ck.KIMI_K3):  # no other family claims them
        assert ck.expert_names(ckpt, family) == {}


def test_the_per_expert_loader_hands_out_the_bytes_written(toy, toy_family):
    folder, written = toy
    ckpt = ck.open_checkpoint(folder)
    assert ck.moe_layers(ckpt, toy_family) == list(LAYERS)
    assert sorted(ck.iter_expert_tensors(toy_family, LAYERS, SIZES["n_routed_experts"], "")
                  ) == sorted(_expert_tensors(written))
    for layer in LAYERS:
        prefix = ck.find_prefix(ckpt, toy_family, layer)
        assert prefix == ""
        experts = [5, 0, 2]  # any subset, in any order
        got = ck.load_experts(ckpt, toy_family, layer, experts, prefix)
        assert sorted(got) == sorted(ROLES)
        for role, (packed, scales) in got.items():
            for e, p, s in zip(experts, packed, scales, strict=True):
                want_p = written[toy_family.tensor("", layer, e, role, toy_family.packed)]
                want_s = written[toy_family.tensor("", layer, e, role, toy_family.scale)]
                assert p.dtype == s.dtype == torch.uint8
                assert torch.equal(p, want_p) and torch.equal(s, want_s)


def test_verify_checks_every_toy_tensor_against_the_bytes_written(toy, toy_family,
                                                                  tmp_path):
    folder, written = toy
    experts = _expert_tensors(written)
    want = {name: _sha256(t) for name, t in experts.items()}
    report = verify_experts(folder)
    assert report["mismatches"] == []
    assert report["layers"] == list(LAYERS)
    assert report["checked"] == len(experts)
    assert report["hashes"] == want
    assert report["bytes"] == sum(t.numel() for t in experts.values())
    assert verify_experts(folder, layers=[3], manifest=want)["mismatches"] == []

    # one byte of one expert changed in the file: named, and nothing else
    bad = shutil.copytree(folder, tmp_path / "bad")
    name = toy_family.tensor("", 3, 4, "up", toy_family.scale)
    path, begin, _ = SafeTensorsCheckpoint(str(bad)).byte_range(name)
    with open(path, "r+b") as f:
        f.seek(begin)
        b = f.read(1)
        f.seek(begin)
        f.write(bytes([b[0] ^ 1]))
    report = verify_experts(str(bad), manifest=want)
    assert report["mismatches"] == [(name, "the file's bytes differ from the manifest")]


def test_verify_names_the_toy_count_key_for_experts_missing(toy, toy_family, tmp_path):
    """A config claiming more experts than the files hold: the mismatch names the
    family's key of the count, not another family's."""
    folder, _ = toy
    more = shutil.copytree(folder, tmp_path / "more")
    with open(more / "config.json", "w") as f:
        json.dump(dict(SIZES, model_type="toy_qwen3_moe", n_routed_experts=8), f)
    report = verify_experts(str(more), layers=[1])
    assert [name for name, _ in report["mismatches"]] == [
        "model.layers.1.mlp.experts.6..7.*.*"]
    what = report["mismatches"][0][1]
    assert "experts 6 to 7" in what and "config.json's n_routed_experts 8" in what


def test_info_and_verify_commands_read_the_toy(toy, toy_family, capsys):
    folder, written = toy
    experts = _expert_tensors(written)
    assert cli.main(["info", folder, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == TOY.name and info["model_type"] == "toy_qwen3_moe"
    assert (info["n_experts"], info["top_k"]) == (6, 2)
    assert info["expert_layers"] == list(LAYERS)
    assert info["expert_tensors"] == len(experts)
    assert info["expert_bytes"] == sum(t.numel() for t in experts.values())
    assert cli.main(["verify", folder, "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{len(experts) // 2} expert tensors of layers [1]" in out
    assert "the bytes handed to the kernels are the file's bytes" in out


# the command line in a new process, the toy registered there from its entry's fields
# alone (JSON): what a family is to the registry
_REGISTER_AND_RUN = """
import json, sys
from mxfp4x.checkpoints import families as ck
from mxfp4x.cli import main
fields = json.loads(sys.argv[1])
family = ck.ExpertNaming(**{k: tuple(v) if isinstance(v, list) else v
                            for k, v in fields.items()})
ck.FAMILIES[family.name] = family
sys.exit(main(sys.argv[2:]))
"""


def test_the_verify_command_line_reads_a_family_given_as_data(toy, tmp_path):
    folder, written = toy
    manifest = tmp_path / "sha256.json"
    run = subprocess.run(
        [sys.executable, "-c", _REGISTER_AND_RUN, json.dumps(dataclasses.asdict(TOY)),
         "verify", folder, "--write-manifest", str(manifest)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the bytes handed to the kernels are the file's bytes" in run.stdout
    want = {name: _sha256(t) for name, t in _expert_tensors(written).items()}
    assert json.loads(manifest.read_text()) == want
