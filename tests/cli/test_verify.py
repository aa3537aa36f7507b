"""python -m mxfp4x verify fails unless it checked every expert tensor and every manifest
entry: layers found from the tensor names, entries the checkpoint lacks, tensors missing
from the index, a checkpoint without experts."""
import json
import os
import sys

import pytest
import torch

import mxfp4x
from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, save_file
from mxfp4x.testing.kimi_k3 import k3_config

PREFIX = "language_model.model.layers.{}.block_sparse_moe.experts."


@pytest.mark.parametrize("layers", [(1, 5), (5,)], ids=["1+5", "5"])
def test_verify_finds_a_tampered_layer_above_num_hidden_layers(tmp_path, make_k3, cli_main,
                                                              layers, flip_byte):
    """Layer 5 of a 3-layer config: the loader reads it, so verify checks it (it used to
    check only layers below num_hidden_layers: "0 expert tensors ... match", exit 0)."""
    folder = make_k3(tmp_path / "ck", layers)
    manifest = tmp_path / "sha256.json"
    code, out, _ = cli_main("verify", folder, "--write-manifest", manifest)
    n = 96 * len(layers)
    assert code == 0 and f"{n} expert tensors of layers {list(layers)}" in out
    assert len(json.loads(manifest.read_text())) == n
    victim = PREFIX.format(5) + "3.w2.weight_packed"
    flip_byte(SafeTensorsCheckpoint(folder), victim)
    block = mxfp4x.nn.KimiK3MoE.from_checkpoint(folder, layer=5, progress=False)
    assert block.experts.n_local == 16  # what verify must cover: the loader takes it
    code, out, _ = cli_main("verify", folder, "--manifest", manifest)
    assert code == 1
    assert f"MISMATCH {victim}: the file's bytes differ from the manifest" in out


def test_verify_reports_a_manifest_entry_the_checkpoint_lacks(tmp_path, k3, cli_main):
    manifest = tmp_path / "sha256.json"
    assert cli_main("verify", k3, "--write-manifest", manifest)[0] == 0
    hashes = json.loads(manifest.read_text())
    ghost = PREFIX.format(1) + "16.w1.weight_packed"  # expert 16 of 16
    hashes[ghost] = "0" * 64
    manifest.write_text(json.dumps(hashes))
    code, out, _ = cli_main("verify", k3, "--manifest", manifest)
    assert code == 1
    assert f"MISMATCH {ghost}: in the manifest but missing from the checkpoint" in out


def test_verify_checks_manifest_entries_outside_the_layers_asked(tmp_path, make_k3, cli_main,
                                                                flip_byte):
    folder = make_k3(tmp_path / "ck")
    manifest = tmp_path / "sha256.json"
    assert cli_main("verify", folder, "--write-manifest", manifest)[0] == 0
    victim = PREFIX.format(5) + "0.w3.weight_scale"
    flip_byte(SafeTensorsCheckpoint(folder), victim)
    code, out, _ = cli_main("verify", folder, "--layers", "1", "--manifest", manifest)
    assert code == 1
    assert "96 expert tensors of layers [1] and 96 other tensors of the manifest" in out
    assert f"MISMATCH {victim}: the file's bytes differ from the manifest" in out


def test_verify_reports_an_expert_tensor_missing_from_the_checkpoint(tmp_path, make_k3,
                                                                    cli_main):
    """A tensor the config's experts need, gone from the index: a mismatch, not a
    KeyError ending the run."""
    folder = make_k3(tmp_path / "ck", [1])
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        doc = json.load(f)
    gone = PREFIX.format(1) + "9.w1.weight_scale"
    del doc["weight_map"][gone]
    with open(index, "w") as f:
        json.dump(doc, f)
    code, out, _ = cli_main("verify", folder)
    assert code == 1
    assert f"MISMATCH {gone}: missing from the checkpoint" in out
    # the loader refuses expert 9 whole: its other tensors reach no kernel
    assert f"MISMATCH {PREFIX.format(1)}9.w2.weight_packed: not handed to the kernels" in out


def test_verify_with_nothing_to_check_fails(tmp_path, cli_main):
    """A checkpoint without expert tensors: an error, not "0 expert tensors ... match"."""
    from mxfp4x.checkpoints.verify import verify_experts

    with open(tmp_path / "config.json", "w") as f:
        json.dump(k3_config(num_experts=16), f)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)},
              str(tmp_path / "model.safetensors"))
    code, _, err = cli_main("verify", tmp_path)
    assert code == 2 and "holds no kimi-k3 expert tensors" in err
    with pytest.raises(ValueError, match="nothing to verify"):
        verify_experts(str(tmp_path))


def test_verify_library_refuses_layers_without_experts(k3):
    from mxfp4x.checkpoints.families import KIMI_K3, moe_layers, open_checkpoint
    from mxfp4x.checkpoints.verify import verify_experts

    assert moe_layers(open_checkpoint(k3), KIMI_K3) == [1, 5]
    with pytest.raises(ValueError, match=r"no kimi-k3 expert tensors for layer\(s\) \[2\]"):
        verify_experts(k3, layers=[2])
    with pytest.raises(ValueError, match="expected a JSON object"):
        verify_experts(k3, manifest=["not", "a", "dict"])  # type: ignore[arg-type]


def test_verify_writes_no_manifest_after_a_mismatch(tmp_path, make_k3, cli_main, flip_byte):
    """A manifest is a reference: one written from files that failed verification would
    vouch for their bad bytes (it was written, whatever was found)."""
    folder = make_k3(tmp_path / "ck", [1])
    manifest, new, old = tmp_path / "sha256.json", tmp_path / "new.json", tmp_path / "old.json"
    assert cli_main("verify", folder, "--write-manifest", manifest)[0] == 0
    old.write_text('{"old": "manifest"}')
    flip_byte(SafeTensorsCheckpoint(folder), PREFIX.format(1) + "2.w3.weight_packed")
    for target in (new, old):
        code, out, err = cli_main("verify", folder, "--manifest", manifest,
                                  "--write-manifest", target)
        assert code == 1 and "1 MISMATCHES" in out
        assert f"--write-manifest: {target} not written" in err
    assert not new.exists() and old.read_text() == '{"old": "manifest"}'


def _zero_expert_checkpoint(folder):
    """config.json and a file whose expert tensors hold 0 rows: 0 bytes to hash."""
    os.makedirs(folder)
    with open(folder / "config.json", "w") as f:
        json.dump(k3_config(num_experts=1), f)
    tensors = {}
    for proj in ("w1", "w2", "w3"):
        stem = PREFIX.format(1) + f"0.{proj}."
        tensors[stem + "weight_packed"] = torch.zeros(0, 32, dtype=torch.uint8)
        tensors[stem + "weight_scale"] = torch.zeros(0, 2, dtype=torch.uint8)
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


def _zero_expert_gguf(path):
    """A GGUF file whose stacked expert tensors hold 0 experts."""
    import numpy as np
    from gguf_files import write_gguf

    from mxfp4x.checkpoints.gguf import MXFP4

    stack = (np.zeros((0, 4, 34), np.uint8), MXFP4)
    (written,) = write_gguf(path, "gpt-oss", {f"blk.0.ffn_{p}_exps.weight": stack
                                             for p in ("gate", "up", "down")})
    return written


@pytest.mark.parametrize("make", [_zero_expert_checkpoint, _zero_expert_gguf],
                         ids=["safetensors", "gguf"])
def test_verify_of_expert_tensors_without_bytes_fails(tmp_path, cli_main, make):
    """Expert tensors of no experts hash nothing: a failure (it reported that "the bytes
    handed to the kernels are the file's bytes", exit status 0), and no manifest."""
    path = make(tmp_path / "ck")
    manifest = tmp_path / "sha256.json"
    code, out, err = cli_main("verify", path, "--write-manifest", manifest)
    assert code == 1, out + err
    assert "holds 0 bytes: no expert's weights" in out
    assert "the bytes handed to the kernels are the file's bytes" not in out
    assert not manifest.exists()


def _set_num_experts(folder, n):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["text_config"]["num_experts"] = n
    with open(path, "w") as f:
        json.dump(config, f)


def test_verify_reports_experts_the_config_claims_in_one_line(tmp_path, make_k3):
    """Experts of config.json's num_experts with no tensor at all: one mismatch per run
    of ids (there was one per tensor: six per expert)."""
    from mxfp4x.checkpoints.verify import verify_experts

    folder = make_k3(tmp_path / "ck", [1])
    _set_num_experts(folder, 20)
    report = verify_experts(folder)
    assert report["mismatches"] == [(
        PREFIX.format(1) + "16..19.*.*", "missing from the checkpoint: experts 16 to 19 "
        "(4 experts) of config.json's num_experts 20, no tensor of any of them")]
    assert report["checked"] == 96
    _set_num_experts(folder, 17)
    assert verify_experts(folder)["mismatches"] == [(
        PREFIX.format(1) + "16.*.*", "missing from the checkpoint: expert 16 of "
        "config.json's num_experts 17, no tensor of it")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA, Linux")
def test_verify_time_and_memory_do_not_follow_a_huge_num_experts(tmp_path, make_k3):
    """num_experts 10^12 in config.json: verify built a list of each of its experts'
    tensors (memory and time in proportion).  Now: the experts the files hold, and one
    line for the rest; run under a 2 GiB data limit, so a regression fails fast."""
    import resource
    import subprocess

    folder = make_k3(tmp_path / "ck", [1])
    _set_num_experts(folder, 10 ** 12)

    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
    out = subprocess.run([sys.executable, "-m", "mxfp4x", "verify", folder],
                         preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert (f"MISMATCH {PREFIX.format(1)}16..999999999999.*.*: missing from the checkpoint: "
            f"experts 16 to 999999999999") in out.stdout
    assert "96 expert tensors of layers [1]" in out.stdout and "1 MISMATCHES" in out.stdout
