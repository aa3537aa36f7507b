"""python -m mxfp4x never leaves a user's file destroyed: every file is replaced whole,
an input written over keeps its tensors, a write that fails leaves the old file."""
import json
import os
import shutil
import subprocess
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


def test_manifest_is_never_written_over_the_one_read(tmp_path, k3, cli_main):
    """--manifest M --write-manifest M (or a link to M): refused before any work.  The
    manifest read is the reference; it used to be rewritten with the hashes of the files
    it was checking (after a mismatch too), and with --layers shrunk to those layers."""
    manifest, link = tmp_path / "sha256.json", tmp_path / "link.json"
    assert cli_main("verify", k3, "--write-manifest", manifest)[0] == 0
    before = manifest.read_bytes()
    link.symlink_to(manifest.name)
    for target in (manifest, link):
        code, out, err = cli_main("verify", k3, "--layers", "1", "--manifest", manifest,
                                  "--write-manifest", target)
        assert code == 2 and out == "", err
        assert "argument --write-manifest: " in err and "the manifest of --manifest" in err
    assert manifest.read_bytes() == before
    assert len(json.loads(before)) == 192


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


def test_quantize_keeps_the_input_metadata(tmp_path, cli_main):
    """The input's __metadata__ entries stay (they were dropped), ours beside them and
    winning a clash of keys."""
    src, dst = tmp_path / "f.safetensors", tmp_path / "q.safetensors"
    save_file({"w": torch.randn(4, 64)}, str(src),
              {"format": "pt", "source": "a fine-tune", "scale_rule": "theirs"})
    code, _, err = cli_main("quantize", src, dst, "--scale-rule", "even")
    assert code == 0, err
    assert SafeTensorsFile(str(dst)).metadata == {
        "format": "pt", "source": "a fine-tune", "mxfp4x": mxfp4x.__version__,
        "scale_rule": "even"}


def _index_less(folder):
    """A Kimi K3 checkpoint in one .safetensors file and config.json, no index: every
    .safetensors of the folder is one of its files."""
    from mxfp4x.testing.kimi_k3 import k3_config, write_k3_checkpoint

    write_k3_checkpoint(str(folder), k3_config(hidden_size=256, routed_expert_hidden_size=128,
                                               num_experts=16, num_experts_per_token=4,
                                               moe_intermediate_size=64, num_shared_experts=2,
                                               num_hidden_layers=2),
                        [1], shards=1, dense_dtype=torch.float32)
    os.remove(folder / "model.safetensors.index.json")
    os.rename(folder / "model-00001-of-00001.safetensors", folder / "model.safetensors")
    return folder


def _tree(folder):
    return {p: p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("output", [
    "ck/model.safetensors", "ck/config.json", "ck/figures.safetensors",
    "ck/model.safetensors.index.json", "hard.json", "soft.json", "ck/../ck/config.json",
], ids=["shard", "config", "new-shard", "new-index", "hard-link", "symlink", "dotdot"])
@pytest.mark.parametrize("command", ["ep-bench", "verify"])
def test_an_output_never_clobbers_the_checkpoint_read(tmp_path, cli_main, command, output):
    """Every file a command writes is checked against every file it reads, and against
    the folder of the checkpoint it reads, before any work: ep-bench --json
    ck/model.safetensors wrote its figures over the shard it was timing (and a JSON file
    named *.safetensors in an index-less folder breaks the folder)."""
    ck = _index_less(tmp_path / "ck")
    os.link(ck / "model.safetensors", tmp_path / "hard.json")
    (tmp_path / "soft.json").symlink_to("ck/config.json")
    before = _tree(tmp_path)
    argv = (["ep-bench", "--checkpoint", ck, "--experts", "16", "--json"]
            if command == "ep-bench" else ["verify", ck, "--write-manifest"])
    code, out, err = cli_main(*argv, tmp_path / output)
    assert code == 2 and out == "", err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert ("--json: " if command == "ep-bench" else "--write-manifest: ") in line
    assert "this command reads" in line
    assert _tree(tmp_path) == before


def test_outputs_beside_the_checkpoint_are_written(tmp_path, cli_main):
    """The other side: a manifest in the checkpoint's folder under another name, and one
    outside it, are written."""
    ck = _index_less(tmp_path / "ck")
    for path in (ck / "sha256.json", tmp_path / "sha256.json"):
        code, _, err = cli_main("verify", ck, "--write-manifest", path)
        assert code == 0, err
        assert len(json.loads(path.read_text())) == 96


def _run_briefly(argv, cwd):
    """``python -m mxfp4x *argv`` in a new process that may not hang: a command waiting
    on a named pipe is a failure, not a test run that never ends."""
    try:
        return subprocess.run([sys.executable, "-m", "mxfp4x", *map(str, argv)], cwd=cwd,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python -m mxfp4x {' '.join(map(str, argv))}: still running after 60 "
                    f"s (waiting on a named pipe)")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
@pytest.mark.parametrize("argv,what", [
    (["info", "{fifo}"], "argument file"),
    (["quantize", "{fifo}", "{tmp}/q.safetensors"], "argument input"),
    (["verify", "{fifo}"], "argument checkpoint"),
    (["verify", "{k3}", "--manifest", "{fifo}"], "argument --manifest"),
    (["verify", "{pipe_shard}"], "argument checkpoint"),
    (["verify", "{pipe_index}"], "argument checkpoint"),
    (["verify", "{pipe_indexed}"], "argument checkpoint"),
    (["ep-bench", "--checkpoint", "{pipe_shard}", "--experts", "16"], "argument --checkpoint"),
], ids=["info", "quantize", "verify-file", "verify-manifest", "verify-shard-of-folder",
        "verify-index", "verify-shard-of-index", "ep-bench-shard"])
def test_a_named_pipe_as_an_input_is_refused(tmp_path, k3, argv, what):
    """An input that is not a regular file (a named pipe here; a device alike) is refused
    before it is opened, naming the argument: opening a named pipe waits for a writer,
    and every one of these commands hung."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    # checkpoint folders with a named pipe where a file is read: a .safetensors of an
    # index-less folder, the index, a shard the index names
    pipe_shard = _index_less(tmp_path / "shard")
    os.mkfifo(pipe_shard / "more.safetensors")
    pipe_index = shutil.copytree(k3, tmp_path / "index")
    os.remove(os.path.join(pipe_index, "model.safetensors.index.json"))
    os.mkfifo(os.path.join(pipe_index, "model.safetensors.index.json"))
    pipe_indexed = shutil.copytree(k3, tmp_path / "indexed")
    os.remove(os.path.join(pipe_indexed, "model-00002-of-00002.safetensors"))
    os.mkfifo(os.path.join(pipe_indexed, "model-00002-of-00002.safetensors"))
    places = dict(fifo=fifo, tmp=tmp_path, k3=k3, pipe_shard=pipe_shard,
                  pipe_index=pipe_index, pipe_indexed=pipe_indexed)
    out = _run_briefly([a.format(**places) for a in argv], tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = [line for line in out.stderr.splitlines() if "error:" in line]
    assert f"{what}: " in line and "is not a regular file (a named pipe)" in line, line
