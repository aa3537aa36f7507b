"""python -m mxfp4x info and verify on GGUF files: what a file holds, and the sha256 of
the exact bytes the kernels are handed (each expert tensor's byte range), one file or a
split set, against a manifest."""
import hashlib
import json
import os

import pytest
import torch
from gguf_files import tiny_gguf

from mxfp4x.checkpoints import families
from mxfp4x.checkpoints.gguf import GGUFCheckpoint
from mxfp4x.checkpoints.verify import verify_gguf_experts

EXPERTS = [f"blk.{layer}.ffn_{p}_exps.weight" for layer in (0, 1)
           for p in ("gate", "up", "down")]


def _sha(path, name):
    file_path, begin, end = GGUFCheckpoint(path).byte_range(name)
    with open(file_path, "rb") as f:
        f.seek(begin)
        return hashlib.sha256(f.read(end - begin)).hexdigest()


def test_info_lists_the_experts(tmp_path, cli_main):
    (path,) = tiny_gguf(tmp_path / "m.gguf")
    code, out, err = cli_main("info", path)
    assert code == 0, err
    assert "architecture   gpt-oss (mxfp4x names: gpt-oss)" in out
    for name in EXPERTS:
        assert name in out
    assert "[3, 37, 96]" in out and "3 experts" in out and f"{3 * 37 * 3 * 17:,d} bytes" in out
    assert "summary        6 MXFP4 expert tensors in 2 layers" in out
    assert "8, 0.000 GB: 6 MXFP4, 2 F32" in out


def test_info_json_of_a_split_set(tmp_path, cli_main):
    paths = tiny_gguf(tmp_path / "m.gguf", arch="kimi-k3", split=3)
    code, out, err = cli_main("info", paths[1], "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["files"] == paths and report["architecture"] == "kimi-k3"
    assert report["family"] == "kimi-k3" and report["tensors"] == 8
    assert [r["name"] for r in report["mxfp4_experts"]] == sorted(EXPERTS[:3]) + sorted(
        EXPERTS[3:])
    row = report["mxfp4_experts"][0]
    assert row["shape"] == [3, 37, 96] and row["experts"] == 3 and row["bytes"] == 3 * 37 * 51
    assert report["expert_layers"] == [0, 1] and report["other_experts"] == []


def test_info_of_an_unknown_architecture_and_other_types(tmp_path, cli_main):
    (path,) = tiny_gguf(tmp_path / "m.gguf", arch="qwen3moe",
                        types={"blk.1.ffn_down_exps.weight"})
    code, out, _ = cli_main("info", path)
    assert code == 0
    assert "qwen3moe (no mxfp4x entry: llama.cpp's common expert names)" in out
    assert "expert tensors in other types (not run by the kernels):" in out
    assert "summary        5 MXFP4 expert tensors in 2 layers" in out


@pytest.mark.parametrize("content", [b"", b"GGML" + bytes(20), b"GGUF\x09\x00\x00\x00"])
def test_info_refuses_what_is_not_a_gguf_file(tmp_path, cli_main, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    code, _, err = cli_main("info", path)
    assert code == 2 and "argument file" in err and str(path) in err


def test_verify_a_gguf_file_and_its_manifest(tmp_path, cli_main, flip_byte):
    (path,) = tiny_gguf(tmp_path / "m.gguf")
    manifest = tmp_path / "sha256.json"
    code, out, err = cli_main("verify", path, "--write-manifest", manifest)
    assert code == 0, err
    assert "6 expert tensors of layers [0, 1]" in out
    assert "the bytes handed to the kernels are the file's bytes" in out
    hashes = json.loads(manifest.read_text())
    assert hashes == {name: _sha(path, name) for name in EXPERTS}
    code, out, _ = cli_main("verify", path, "--manifest", manifest)
    assert code == 0 and "and match the manifest" in out
    victim = "blk.1.ffn_up_exps.weight"
    flip_byte(GGUFCheckpoint(path), victim)
    code, out, _ = cli_main("verify", path, "--layers", "0", "--manifest", manifest)
    assert code == 1
    assert "3 expert tensors of layers [0] and 3 other tensors of the manifest" in out
    assert f"MISMATCH {victim}: the file's bytes differ from the manifest" in out


def test_verify_a_split_set(tmp_path, cli_main):
    paths = tiny_gguf(tmp_path / "m.gguf", split=2)
    manifest = tmp_path / "sha256.json"
    code, out, _ = cli_main("verify", paths[1], "--write-manifest", manifest)
    assert code == 0 and "6 expert tensors of layers [0, 1]" in out
    assert json.loads(manifest.read_text()) == {n: _sha(paths[0], n) for n in EXPERTS}
    code, _, err = cli_main("verify", paths[0], "--write-manifest", paths[1])
    assert code == 2 and "--write-manifest" in err and "a file of the checkpoint" in err


def test_verify_fails_on_experts_the_kernels_cannot_run(tmp_path, cli_main):
    name = "blk.0.ffn_gate_exps.weight"
    (path,) = tiny_gguf(tmp_path / "m.gguf", types={name})
    code, out, _ = cli_main("verify", path)
    assert code == 1 and f"MISMATCH {name}: I8 [{3 * 37 * 51}], not MXFP4 experts" in out
    assert "6 expert tensors" in out


def test_verify_finds_a_missing_projection_and_handed_bytes_that_differ(tmp_path):
    (path,) = tiny_gguf(tmp_path / "m.gguf")
    ckpt = GGUFCheckpoint(path)
    handed = {}
    for layer in (0, 1):
        for role, t in families.load_gguf_experts(ckpt, layer).items():
            handed[f"blk.{layer}.ffn_{role}_exps.weight"] = t
    report = verify_gguf_experts(ckpt, handed=handed)
    assert report["checked"] == 6 and not report["mismatches"]
    changed = dict(handed)
    victim = "blk.0.ffn_down_exps.weight"
    changed[victim] = handed[victim].clone()
    changed[victim][1, 2, 0, 0] ^= 1  # one scale byte
    report = verify_gguf_experts(ckpt, handed=changed)
    assert report["mismatches"] == [(victim, "the bytes handed to the kernels differ from "
                                             "the file's")]
    del changed[victim]
    assert verify_gguf_experts(ckpt, handed=changed)["mismatches"] == [
        (victim, "not handed to the kernels")]


def test_verify_reports_a_layer_without_its_up_experts(tmp_path, cli_main):
    (path,) = tiny_gguf(tmp_path / "m.gguf", layers=(0,))
    with open(path, "r+b") as f:  # rename the tensor in place: same length
        raw = f.read()
        at = raw.index(b"blk.0.ffn_up_exps.weight")
        f.seek(at)
        f.write(b"blk.0.ffn_uq_exps.weight")
    code, out, _ = cli_main("verify", path)
    assert code == 1 and "2 expert tensors of layers [0]" in out
    assert "MISMATCH blk.0.ffn_up_exps.weight: missing from the checkpoint" in out


def test_verify_refuses_a_gguf_file_without_experts(tmp_path, cli_main):
    from gguf_files import F32, STRING, encode, kv, tensor_info

    path = tmp_path / "dense.gguf"
    path.write_bytes(encode([kv("general.architecture", STRING, "llama")],
                            [tensor_info("output.weight", [4], F32, 0)], bytes(16)))
    code, _, err = cli_main("verify", path)
    assert code == 2 and "nothing to verify" in err
    with pytest.raises(ValueError, match="nothing to verify"):
        verify_gguf_experts(str(path))
    assert cli_main("info", path)[0] == 0


def test_the_mapped_experts_are_what_the_op_takes(tmp_path):
    """uint8 (E, O, G, 17), contiguous views of the file: the GGUF form of
    mxfp4x.mxfp4_experts(x, blocks, None, ...)."""
    (path,) = tiny_gguf(tmp_path / "m.gguf")
    blocks = families.load_gguf_experts(GGUFCheckpoint(path), 1, (1, 3))["gate"]
    assert blocks.dtype == torch.uint8 and blocks.shape == (2, 37, 3, 17)
    assert blocks.is_contiguous()
    file_path, begin, _ = GGUFCheckpoint(path).byte_range("blk.1.ffn_gate_exps.weight")
    with open(file_path, "rb") as f:
        f.seek(begin + 37 * 3 * 17)
        assert f.read(2 * 37 * 3 * 17) == blocks.numpy().tobytes()
    assert os.path.getsize(path) > begin
