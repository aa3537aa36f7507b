"""python -m mxfp4x against a hostile user: files are never destroyed, a verification that
checked nothing never passes, and every bad argument of every command is refused before
any work (exit status 2, one line naming the argument)."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import mxfp4x
from mxfp4x import __main__ as cli
from mxfp4x._kimi_k3 import k3_config, write_k3_checkpoint
from mxfp4x._safetensors import SafeTensorsCheckpoint, SafeTensorsFile, save_file
from mxfp4x._threads import MAX_THREADS

COMMANDS = ["bench", "info", "check", "quantize", "roofline", "verify", "layer", "ep-bench"]
# config.json says 3 layers, the files hold layers 1 and 5: the loader reads both
TINY = dict(hidden_size=256, routed_expert_hidden_size=128, num_experts=16,
            num_experts_per_token=4, moe_intermediate_size=64, num_shared_experts=2,
            num_hidden_layers=3)
PREFIX = "language_model.model.layers.{}.block_sparse_moe.experts."


def _k3(folder, layers=(1, 5)):
    write_k3_checkpoint(str(folder), k3_config(**TINY), list(layers), seed=7, shards=2,
                        dense_dtype=torch.float32)
    return str(folder)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """Read-only: tests that change a checkpoint write their own."""
    return _k3(tmp_path_factory.mktemp("k3"))


def _main(capsys, *argv):
    """(exit status, stdout, stderr) of ``python -m mxfp4x *argv``, in this process."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _run(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "mxfp4x", *map(str, argv)],
                          capture_output=True, text=True, timeout=300, **kw)


def _flip_byte(folder, name):
    path, begin, end = SafeTensorsCheckpoint(folder).byte_range(name)
    with open(path, "r+b") as f:
        f.seek((begin + end) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


# ---- 1. no command leaves a user's file destroyed -------------------------------------

def _float_file(path):
    tensors = {"experts.w": torch.randn(64, 32, 64), "experts.bias": torch.randn(64, 32),
               "norm": torch.randn(5)}
    save_file(tensors, str(path))
    return tensors


def test_quantize_in_place(tmp_path):
    """quantize f f: the kept tensors are views of f's mapping while f is written; the
    output replaces f whole, with the right tensors (it used to leave a bare header)."""
    f = tmp_path / "f.safetensors"
    tensors = _float_file(f)
    out = _run("quantize", f, f)
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
def test_quantize_in_place_that_fails_leaves_the_input(tmp_path):
    """A write that fails (here: a file size limit, as a full disk) leaves the target as
    it was and no temporary file."""
    f = tmp_path / "f.safetensors"
    _float_file(f)
    before = f.read_bytes()
    out = _run("quantize", f, f, preexec_fn=_file_size_limit(16 << 10))
    assert out.returncode != 0
    assert f.read_bytes() == before
    assert os.listdir(tmp_path) == ["f.safetensors"]


def test_manifest_write_that_fails_leaves_the_old_one(tmp_path, k3, capsys, monkeypatch):
    """verify --write-manifest over an existing manifest: a failure mid-write (a full
    disk) keeps the old manifest whole (open(..., "w") used to truncate it first)."""
    manifest = tmp_path / "sha256.json"
    manifest.write_text('{"old": "manifest"}')

    def dump_then_fail(obj, f, **kw):
        f.write('{"half": ')
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dump", dump_then_fail)
    code, _, err = _main(capsys, "verify", k3, "--layers", "1", "--write-manifest", manifest)
    assert code == 1 and "No space left on device" in err
    assert manifest.read_text() == '{"old": "manifest"}'
    assert os.listdir(tmp_path) == ["sha256.json"]


def test_manifest_written_over_the_one_read(tmp_path, k3, capsys):
    manifest = tmp_path / "sha256.json"
    assert _main(capsys, "verify", k3, "--write-manifest", manifest)[0] == 0
    code, out, _ = _main(capsys, "verify", k3, "--manifest", manifest,
                         "--write-manifest", manifest)
    assert code == 0 and "match the manifest" in out
    assert len(json.loads(manifest.read_text())) == 192


# ---- 2. verify fails unless it checked every expert tensor and every manifest entry -----

@pytest.mark.parametrize("layers", [(1, 5), (5,)], ids=["1+5", "5"])
def test_verify_finds_a_tampered_layer_above_num_hidden_layers(tmp_path, capsys, layers):
    """Layer 5 of a 3-layer config: the loader reads it, so verify checks it (it used to
    check only layers below num_hidden_layers: "0 expert tensors ... match", exit 0)."""
    folder = _k3(tmp_path / "ck", layers)
    manifest = tmp_path / "sha256.json"
    code, out, _ = _main(capsys, "verify", folder, "--write-manifest", manifest)
    n = 96 * len(layers)
    assert code == 0 and f"{n} expert tensors of layers {list(layers)}" in out
    assert len(json.loads(manifest.read_text())) == n
    victim = PREFIX.format(5) + "3.w2.weight_packed"
    _flip_byte(folder, victim)
    block = mxfp4x.nn.KimiK3MoE.from_checkpoint(folder, layer=5, progress=False)
    assert block.experts.n_local == 16  # what verify must cover: the loader takes it
    code, out, _ = _main(capsys, "verify", folder, "--manifest", manifest)
    assert code == 1
    assert f"MISMATCH {victim}: the file's bytes differ from the manifest" in out


def test_verify_reports_a_manifest_entry_the_checkpoint_lacks(tmp_path, k3, capsys):
    manifest = tmp_path / "sha256.json"
    assert _main(capsys, "verify", k3, "--write-manifest", manifest)[0] == 0
    hashes = json.loads(manifest.read_text())
    ghost = PREFIX.format(1) + "16.w1.weight_packed"  # expert 16 of 16
    hashes[ghost] = "0" * 64
    manifest.write_text(json.dumps(hashes))
    code, out, _ = _main(capsys, "verify", k3, "--manifest", manifest)
    assert code == 1
    assert f"MISMATCH {ghost}: in the manifest but missing from the checkpoint" in out


def test_verify_checks_manifest_entries_outside_the_layers_asked(tmp_path, capsys):
    folder = _k3(tmp_path / "ck")
    manifest = tmp_path / "sha256.json"
    assert _main(capsys, "verify", folder, "--write-manifest", manifest)[0] == 0
    victim = PREFIX.format(5) + "0.w3.weight_scale"
    _flip_byte(folder, victim)
    code, out, _ = _main(capsys, "verify", folder, "--layers", "1", "--manifest", manifest)
    assert code == 1
    assert "96 expert tensors of layers [1] and 96 other tensors of the manifest" in out
    assert f"MISMATCH {victim}: the file's bytes differ from the manifest" in out


def test_verify_reports_an_expert_tensor_missing_from_the_checkpoint(tmp_path, capsys):
    """A tensor the config's experts need, gone from the index: a mismatch, not a
    KeyError ending the run."""
    folder = _k3(tmp_path / "ck", [1])
    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        doc = json.load(f)
    gone = PREFIX.format(1) + "9.w1.weight_scale"
    del doc["weight_map"][gone]
    with open(index, "w") as f:
        json.dump(doc, f)
    code, out, _ = _main(capsys, "verify", folder)
    assert code == 1
    assert f"MISMATCH {gone}: missing from the checkpoint" in out
    # the loader refuses expert 9 whole: its other tensors reach no kernel
    assert f"MISMATCH {PREFIX.format(1)}9.w2.weight_packed: not handed to the kernels" in out


def test_verify_with_nothing_to_check_fails(tmp_path, capsys):
    """A checkpoint without expert tensors: an error, not "0 expert tensors ... match"."""
    from mxfp4x._checkpoints import verify_experts

    with open(tmp_path / "config.json", "w") as f:
        json.dump(k3_config(**TINY), f)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 8)},
              str(tmp_path / "model.safetensors"))
    code, _, err = _main(capsys, "verify", tmp_path)
    assert code == 2 and "holds no kimi-k3 expert tensors" in err
    with pytest.raises(ValueError, match="nothing to verify"):
        verify_experts(str(tmp_path))


def test_verify_library_refuses_layers_without_experts(k3):
    from mxfp4x._checkpoints import KIMI_K3, moe_layers, open_checkpoint, verify_experts

    assert moe_layers(open_checkpoint(k3), KIMI_K3) == [1, 5]
    with pytest.raises(ValueError, match=r"no kimi-k3 expert tensors for layer\(s\) \[2\]"):
        verify_experts(k3, layers=[2])
    with pytest.raises(ValueError, match="expected a JSON object"):
        verify_experts(k3, manifest=["not", "a", "dict"])  # type: ignore[arg-type]


# ---- 3. every argument is checked before any work --------------------------------------

class _WorkStarted(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Every command's first step of real work raises; temporary files go to tmp_path."""
    import torch.distributed

    from mxfp4x import _bench, _checkpoints, _gpt_oss, _kimi_k3, _roofline, _safetensors, _testing

    def work(*args, **kwargs):
        raise _WorkStarted
    for module, name in [(_roofline, "measure"), (_bench, "make_experts"),
                         (_testing, "random_layer"), (mxfp4x, "quantize"),
                         (_safetensors, "save_file"), (_checkpoints, "verify_experts"),
                         (_kimi_k3, "write_k3_checkpoint"), (_gpt_oss, "write_gpt_oss_layer"),
                         (torch.distributed, "init_process_group")]:
        monkeypatch.setattr(module, name, work)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed


@pytest.fixture
def files(tmp_path):
    """Inputs of the bad-argument cases, by the placeholders the cases use."""
    paths = {"tmp": str(tmp_path), "missing": str(tmp_path / "missing")}
    save_file({"w": torch.randn(4, 64), "w.bias": torch.randn(4)}, str(tmp_path / "f.st"))
    save_file({"norm": torch.randn(4), "ids": torch.zeros(4, 64, dtype=torch.int64)},
              str(tmp_path / "none.st"))
    save_file({"w": torch.randn(4, 64), "w_scales": torch.zeros(4, 2, dtype=torch.uint8)},
              str(tmp_path / "clash.st"))
    (tmp_path / "garbage").write_bytes(b"\x07not a safetensors file, nor JSON")
    (tmp_path / "list.json").write_text('["a", "b"]')
    (tmp_path / "hex.json").write_text(json.dumps({PREFIX.format(1) + "0.w1.weight_packed":
                                                   "abc"}))
    for name in ("f.st", "none.st", "clash.st", "garbage", "list.json", "hex.json"):
        paths[name.replace(".", "_")] = str(tmp_path / name)
    return paths


def _memory_known():
    try:
        return os.sysconf("SC_PHYS_PAGES") > 0
    except (AttributeError, OSError, ValueError):
        return False


BAD = [  # argv ({placeholders}), what the error line must name
    (["bench", "--tokens", "0"], "--tokens"),
    (["bench", "--tokens", "-3"], "--tokens"),
    (["bench", "--tokens", "1", "many"], "--tokens"),
    (["--tokens", "0"], "--tokens"),  # bench, the default command
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--threads", str(MAX_THREADS + 1)], "--threads"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--dtype", "int8"], "--dtype"),
    (["bench", "--shape", "gpt-oss-200b"], "--shape"),
    (["bench", "--json", "{missing}/x.json"], "--json"),
    (["bench", "--json", "{tmp}"], "--json"),
    (["bench", "--plot", "{tmp}/gflops.png"], "--plot"),
    pytest.param(["bench", "--tokens", str(10 ** 15)], "--tokens", marks=pytest.mark.skipif(
        not _memory_known(), reason="no physical memory size here")),
    (["info", "--jsn"], "--jsn"),
    (["check", "--seed", "-1"], "--seed"),
    (["quantize", "{missing}.st", "{tmp}/q.st"], "input"),
    (["quantize", "{tmp}", "{tmp}/q.st"], "input"),
    (["quantize", "{garbage}", "{tmp}/q.st"], "input"),
    (["quantize", "{none_st}", "{tmp}/q.st"], "input"),
    (["quantize", "{clash_st}", "{tmp}/q.st"], "input"),
    (["quantize", "{f_st}", "{missing}/q.st"], "output"),
    (["quantize", "{f_st}", "{tmp}"], "output"),
    (["quantize", "{f_st}", "{tmp}/q.st", "--only", "nothing"], "--only"),
    (["quantize", "{f_st}", "{tmp}/q.st", "--scale-rule", "round"], "--scale-rule"),
    (["roofline", "--threads", "0"], "--threads"),
    (["roofline", "--threads", "1", "-2"], "--threads"),
    (["verify", "{missing}"], "checkpoint"),
    (["verify", "{tmp}"], "checkpoint"),  # a folder without config.json
    (["verify", "{f_st}"], "checkpoint"),  # a file without config.json beside it
    (["verify", "{k3}", "--layers", "2"], "--layers"),
    (["verify", "{k3}", "--layers", "-1"], "--layers"),
    (["verify", "{k3}", "--layers", "1", "1"], "--layers"),
    (["verify", "{k3}", "--manifest", "{missing}.json"], "--manifest"),
    (["verify", "{k3}", "--manifest", "{list_json}"], "--manifest"),
    (["verify", "{k3}", "--manifest", "{hex_json}"], "--manifest"),
    (["verify", "{k3}", "--manifest", "{garbage}"], "--manifest"),
    (["verify", "{k3}", "--write-manifest", "{missing}/m.json"], "--write-manifest"),
    (["verify", "{k3}", "--write-manifest", "{tmp}"], "--write-manifest"),
    (["verify", "{k3}", "--write-manifest", "{k3}/config.json"], "--write-manifest"),
    (["layer", "--experts", "0"], "--experts"),
    (["layer", "--experts", "-5"], "--experts"),
    (["layer", "--experts", "897"], "--experts"),
    (["layer", "--experts", "8"], "--experts"),  # Kimi K3 routes to 16
    (["layer", "--model", "gpt-oss-20b", "--experts", "2"], "--experts"),
    (["layer", "--model", "gpt-oss-120b"], "--model"),
    (["layer", "--tokens", "0"], "--tokens"),
    (["layer", "--threads", "0"], "--threads"),
    (["layer", "--repeats", "0"], "--repeats"),
    (["layer", "--dir", "{missing}"], "--dir"),
    (["layer", "--dir", "{garbage}"], "--dir"),
    (["ep-bench", "--experts", "0"], "--experts"),
    (["ep-bench", "--experts", "15"], "--experts"),
    (["ep-bench", "--tokens", "0"], "--tokens"),
    (["ep-bench", "--threads", "0"], "--threads"),
    (["ep-bench", "--repeats", "0"], "--repeats"),
    (["ep-bench", "--checkpoint", "{missing}"], "--checkpoint"),
    (["ep-bench", "--checkpoint", "{tmp}"], "--checkpoint"),
    (["ep-bench", "--checkpoint", "{k3}", "--experts", "17"], "--experts"),  # it holds 16
    (["ep-bench", "--dir", "{missing}"], "--dir"),
    (["ep-bench", "--json", "{missing}/x.json"], "--json"),
    (["nonsense"], "nonsense"),
]


@pytest.mark.parametrize("argv,names", BAD, ids=[
    " ".join(p.values[0] if hasattr(p, "values") else p[0]) for p in BAD])
def test_bad_argument_is_refused_before_any_work(argv, names, files, k3, no_work, capsys,
                                                tmp_path):
    argv = [a.format(k3=k3, **files) for a in argv]
    before = sorted(os.listdir(tmp_path))
    t0 = time.perf_counter()
    code, out, err = _main(capsys, *argv)  # _WorkStarted propagates: work began
    assert time.perf_counter() - t0 < 10
    assert code == 2, (code, out, err)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    assert names in errors[0], err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, not even a temp folder


@pytest.mark.parametrize("argv", [
    ["bench", "--tokens", "1", "--threads", "1", "--repeats", "1", "--json", "{tmp}/b.json"],
    ["roofline", "--threads", "1", "--quick"], ["check", "--seed", "3"],
    ["quantize", "{f_st}", "{f_st}"], ["verify", "{k3}", "--layers", "5"],
    ["layer", "--experts", "16", "--dir", "{tmp}"],
    ["layer", "--model", "gpt-oss-20b", "--experts", "4", "--tokens", "2"],
    ["ep-bench", "--checkpoint", "{k3}", "--experts", "16", "--json", "{tmp}/e.json"],
], ids=lambda argv: argv[0])
def test_good_arguments_reach_the_work(argv, files, k3, no_work, capsys):
    """The other side of the test above: valid arguments pass the checks, and the
    functions patched there are where each command's work starts."""
    with pytest.raises(_WorkStarted):
        _main(capsys, *[a.format(k3=k3, **files) for a in argv])


def test_docstring_and_help_list_every_command(capsys):
    first = cli.__doc__.splitlines()[0]
    code, out, _ = _main(capsys, "--help")
    assert code == 0
    for cmd in COMMANDS:
        assert cmd in first.translate({ord(c): " " for c in "[|]"}).split(), (cmd, first)
        assert cmd in out


def test_ep_bench_takes_the_shapes_of_its_checkpoint(tmp_path, k3):
    """ep-bench --checkpoint with a checkpoint smaller than the released model: tokens in
    its own shapes (they were made in Kimi K3's 3584-wide latent)."""
    out = _run("ep-bench", "--checkpoint", k3, "--tokens", "3", "--threads", "1",
               "--repeats", "1", "--json", tmp_path / "ep.json")
    assert out.returncode == 0, out.stdout + out.stderr
    (row,) = json.loads((tmp_path / "ep.json").read_text())
    assert row["tokens"] == 3 and row["experts"] == 16
