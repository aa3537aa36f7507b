"""python -m mxfp4x never leaves a user's file destroyed: every file is replaced whole,
an input written over keeps its tensors, a write that fails leaves the old file."""
import json
import os
import sys

import pytest
import torch

import mxfp4x
from mxfp4x.checkpoints.safetensors import SafeTensorsFile, save_file


def _float_file(path):
    tensors = {"experts.w": torch.randn(64, 32, 64), "experts.bias": torch.randn(64, 32),
               "norm": torch.randn(5)}
    save_file(tensors, str(path))
    return tensors


def test_quantize_in_place(tmp_path, cli_run):
    """quantize f f: the kept tensors are views of f's mapping while f is written; the
    output replaces f whole, with the right tensors (it used to leave a bare header)."""
    f = tmp_path / "f.safetensors"
    tensors = _float_file(f)
    out = cli_run("quantize", f, f)
    assert out.returncode == 0, out.stdout + out.stderr
    q = SafeTensorsFile(str(f))
    assert set(q.keys()) == {"experts.w_blocks", "experts.w_scales", "experts.bias", "norm"}
    packed, scales = mxfp4x.quantize(tensors["experts.w"])
    assert torch.equal(q.get("experts.w_blocks"), packed)
    assert torch.equal(q.get("experts.w_scales"), scales)
    assert torch.equal(q.get("experts.bias"), tensors["experts.bias"])
    assert torch.equal(q.get("norm"), tensors["norm"])
    assert os.listdir(tmp_path) == ["f.safetensors"]  # no temporary file left


def _file_size_limit(n_bytes):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE, Linux")
def test_quantize_in_place_that_fails_leaves_the_input(tmp_path, cli_run):
    """A write that fails (here: a file size limit, as a full disk) leaves the target as
    it was and no temporary file."""
    f = tmp_path / "f.safetensors"
    _float_file(f)
    before = f.read_bytes()
    out = cli_run("quantize", f, f, preexec_fn=_file_size_limit(16 << 10))
    assert out.returncode != 0
    assert f.read_bytes() == before
    assert os.listdir(tmp_path) == ["f.safetensors"]


def test_manifest_write_that_fails_leaves_the_old_one(tmp_path, k3, cli_main, monkeypatch):
    """verify --write-manifest over an existing manifest: a failure mid-write (a full
    disk) keeps the old manifest whole (open(..., "w") used to truncate it first)."""
    manifest = tmp_path / "sha256.json"
    manifest.write_text('{"old": "manifest"}')

    def dump_then_fail(obj, f, **kw):
        f.write('{"half": ')
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dump", dump_then_fail)
    code, _, err = cli_main("verify", k3, "--layers", "1", "--write-manifest", manifest)
    assert code == 1 and "No space left on device" in err
    assert manifest.read_text() == '{"old": "manifest"}'
    assert os.listdir(tmp_path) == ["sha256.json"]


def test_manifest_written_over_the_one_read(tmp_path, k3, cli_main):
    manifest = tmp_path / "sha256.json"
    assert cli_main("verify", k3, "--write-manifest", manifest)[0] == 0
    code, out, _ = cli_main("verify", k3, "--manifest", manifest, "--write-manifest", manifest)
    assert code == 0 and "match the manifest" in out
    assert len(json.loads(manifest.read_text())) == 192


def test_output_through_a_symlink_replaces_its_target(tmp_path, cli_main):
    """A symbolic link as the output: its target is the file replaced (whole, atomically)
    and the link stays a link (a rename used to put a regular file where the link was)."""
    src, target, link = tmp_path / "f.safetensors", tmp_path / "t.safetensors", \
        tmp_path / "link.safetensors"
    tensors = _float_file(src)
    save_file({"old": torch.randn(3)}, str(target))
    link.symlink_to(target.name)
    code, _, err = cli_main("quantize", src, link, "--only", "experts.w")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == target.name
    packed, _ = mxfp4x.quantize(tensors["experts.w"])
    assert torch.equal(SafeTensorsFile(str(target)).get("experts.w_blocks"), packed)
    assert sorted(os.listdir(tmp_path)) == ["f.safetensors", "link.safetensors",
                                            "t.safetensors"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_output_to_a_named_pipe_is_written_through(tmp_path, cli_main):
    """A named pipe (or a device: /dev/null, /dev/stdout) as the output is written straight
    through, in sequence, and stays what it was: the bytes a reader gets are the file a
    regular output gets (a rename used to replace the pipe by a regular file)."""
    import stat
    import threading

    src, fifo, plain = tmp_path / "f.safetensors", tmp_path / "pipe", tmp_path / "q.safetensors"
    _float_file(src)
    code, _, err = cli_main("quantize", src, plain, "--only", "experts.w")
    assert code == 0, err
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    code, _, err = cli_main("quantize", src, fifo, "--only", "experts.w")
    reader.join(60)
    assert code == 0, err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got == [plain.read_bytes()]
