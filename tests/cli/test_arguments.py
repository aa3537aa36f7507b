"""python -m mxfp4x against a hostile user: every bad argument of every command is
refused before any work (exit status 2, one line naming the argument), and good ones
reach the work."""
import json
import os
import sys
import tempfile
import time

import pytest
import torch
from gguf_files import tiny_gguf

import mxfp4x
from mxfp4x._core.threads import MAX_THREADS
from mxfp4x.checkpoints.safetensors import save_file

PREFIX = "language_model.model.layers.{}.block_sparse_moe.experts."


class _WorkStarted(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch, tmp_path):
    """Every command's first step of real work raises; temporary files go to tmp_path."""
    import torch.distributed

    from mxfp4x._measure import bench as _bench
    from mxfp4x._measure import roofline as _roofline
    from mxfp4x._synthetic import gpt_oss as _gpt_oss
    from mxfp4x._synthetic import kimi_k3 as _kimi_k3
    from mxfp4x._synthetic import layers as _layers
    from mxfp4x.checkpoints import safetensors as _safetensors
    from mxfp4x.checkpoints import verify as _checkpoints

    def work(*args, **kwargs):
        raise _WorkStarted
    for module, name in [(_roofline, "measure"), (_bench, "make_experts"),
                         (_layers, "random_layer"), (mxfp4x, "quantize"),
                         (_safetensors, "save_file"), (_checkpoints, "verify_experts"),
                         (_checkpoints, "verify_gguf_experts"),
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
    (tmp_path / "sha256.json").write_text(json.dumps({PREFIX.format(1) + "0.w1.weight_packed":
                                                      "0" * 64}))
    for name in ("f.st", "none.st", "clash.st", "garbage", "list.json", "hex.json",
                 "sha256.json"):
        paths[name.replace(".", "_")] = str(tmp_path / name)
    (paths["gguf"],) = tiny_gguf(tmp_path / "m.gguf", layers=(0, 2))
    paths["split"] = tiny_gguf(tmp_path / "s.gguf", split=2)[0]
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(15))
    paths["bad_gguf"] = str(tmp_path / "bad.gguf")
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
    (["bench", "--device", "tpu"], "--device"),
    pytest.param(["bench", "--device", "cuda"], "--device", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a GPU is here")),
    pytest.param(["bench", "--device", "cuda", "--threads", "2"], "--threads",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
    (["bench", "--json", "{missing}/x.json"], "--json"),
    (["bench", "--json", "{tmp}"], "--json"),
    (["bench", "--plot", "{tmp}/gflops.png"], "--plot"),
    pytest.param(["bench", "--tokens", str(10 ** 15)], "--tokens", marks=pytest.mark.skipif(
        not _memory_known(), reason="no physical memory size here")),
    # the calls made ahead of the timing: --repeats of them, not --tokens alone
    pytest.param(["bench", "--repeats", str(10 ** 9)], "--repeats", marks=pytest.mark.skipif(
        not _memory_known(), reason="no physical memory size here")),
    (["info", "--jsn"], "--jsn"),
    (["info", "{missing}.gguf"], "file"),
    (["info", "{tmp}"], "file"),
    (["info", "{garbage}"], "file"),  # not GGUF
    (["info", "{bad_gguf}"], "file"),  # truncated
    (["info", "{gguf}", "{gguf}"], "unrecognized"),
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
    (["verify", "{bad_gguf}"], "checkpoint"),
    (["verify", "{gguf}", "--layers", "1"], "--layers"),
    (["verify", "{gguf}", "--layers", "0", "0"], "--layers"),
    (["verify", "{gguf}", "--manifest", "{list_json}"], "--manifest"),
    (["verify", "{gguf}", "--write-manifest", "{gguf}"], "--write-manifest"),
    (["verify", "{split}", "--write-manifest", "{tmp}/s-00002-of-00002.gguf"],
     "--write-manifest"),
    # an output never replaces an input, nor joins the checkpoint folder read
    (["verify", "{k3}", "--manifest", "{sha256_json}", "--write-manifest", "{sha256_json}"],
     "--write-manifest"),
    (["verify", "{k3}", "--write-manifest", "{k3}/sha256.safetensors"], "--write-manifest"),
    (["verify", "{gguf}", "--write-manifest", "{tmp}/sha256.gguf"], "--write-manifest"),
    (["verify", "{gguf}", "--manifest", "{sha256_json}", "--write-manifest",
      "{tmp}/./sha256.json"], "--write-manifest"),
    (["layer", "--experts", "0"], "--experts"),
    (["layer", "--experts", "-5"], "--experts"),
    (["layer", "--experts", "897"], "--experts"),
    (["layer", "--experts", "8"], "--experts"),  # Kimi K3 routes to 16
    (["layer", "--model", "gpt-oss-20b", "--experts", "2"], "--experts"),
    (["layer", "--model", "gpt-oss-120b"], "--model"),
    (["layer", "--tokens", "0"], "--tokens"),
    (["layer", "--threads", "0"], "--threads"),
    (["layer", "--repeats", "0"], "--repeats"),
    (["layer", "--dir", "{garbage}"], "--dir"),  # not a folder
    (["layer", "--dir", "{garbage}/layers"], "--dir"),  # cannot be made: a file in the way
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
    (["ep-bench", "--checkpoint", "{k3}", "--experts", "16", "--json", "{k3}/config.json"],
     "--json"),
    (["ep-bench", "--checkpoint", "{k3}", "--experts", "16", "--json",
      "{k3}/model-00002-of-00002.safetensors"], "--json"),
    (["ep-bench", "--checkpoint", "{k3}", "--experts", "16", "--json",
      "{k3}/model.safetensors.index.json"], "--json"),
    (["ep-bench", "--checkpoint", "{k3}", "--experts", "16", "--json",
      "{k3}/figures.safetensors"], "--json"),
    (["nonsense"], "nonsense"),
]


@pytest.mark.parametrize("argv,names", BAD, ids=[
    " ".join(p.values[0] if hasattr(p, "values") else p[0]) for p in BAD])
def test_bad_argument_is_refused_before_any_work(argv, names, files, k3, no_work, cli_main,
                                                tmp_path):
    argv = [a.format(k3=k3, **files) for a in argv]
    before = sorted(os.listdir(tmp_path))
    t0 = time.perf_counter()
    code, out, err = cli_main(*argv)  # _WorkStarted propagates: work began
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
    ["verify", "{gguf}", "--layers", "2"], ["verify", "{split}"],
    ["layer", "--experts", "16", "--dir", "{tmp}"],
    ["layer", "--model", "gpt-oss-20b", "--experts", "4", "--tokens", "2"],
    ["ep-bench", "--checkpoint", "{k3}", "--experts", "16", "--json", "{tmp}/e.json"],
], ids=lambda argv: argv[0])
def test_good_arguments_reach_the_work(argv, files, k3, no_work, cli_main):
    """The other side of the test above: valid arguments pass the checks, and the
    functions patched there are where each command's work starts."""
    with pytest.raises(_WorkStarted):
        cli_main(*[a.format(k3=k3, **files) for a in argv])


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept"])
def test_layer_makes_its_folder(files, no_work, cli_main, keep):
    """layer --dir naming a folder that does not exist yet: made (it used to be refused),
    and removed with the written layer unless --keep."""
    target = os.path.join(files["missing"], "layers")
    with pytest.raises(_WorkStarted):  # the work starts in the folder made
        cli_main("layer", "--experts", "16", "--dir", target, *["--keep"] * keep)
    if keep:
        (written,) = os.listdir(target)
        assert written.startswith("mxfp4x-kimi-k3-")
    else:
        assert not os.path.exists(files["missing"])


def _k3_with_config(folder, make_k3, **sizes):
    """A tiny Kimi K3 checkpoint whose config.json then says ``sizes``."""
    make_k3(folder, [1])
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["text_config"].update(sizes)
    with open(path, "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.mark.parametrize("sizes,names", [
    # the files' experts are (64, 128) gate/up and (128, 64) down
    (dict(moe_intermediate_size=96),
     [PREFIX.format(1) + "0.w1.weight_packed is (64, 64), expected (96, 64)"]),
    (dict(routed_expert_hidden_size=256),
     [PREFIX.format(1) + "0.w1.weight_packed is (64, 64), expected (64, 128)"]),
    (dict(moe_intermediate_size=100), ["moe_intermediate_size is 100", "multiple of 32"]),
], ids=["ff", "latent", "not-whole-groups"])
def test_ep_bench_checkpoint_shapes_are_checked_against_its_config(
        tmp_path, make_k3, no_work, cli_main, sizes, names):
    """The tokens are made in config.json's sizes: a tensor of another shape is refused
    with the checkpoint, naming it and the shape expected (it used to be a traceback from
    the experts' module, exit status 1, after the process group had started)."""
    folder = _k3_with_config(tmp_path / "ck", make_k3, **sizes)
    code, _, err = cli_main("ep-bench", "--checkpoint", folder, "--experts", "16")
    assert code == 2, err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert "argument --checkpoint: " in line
    for name in names:
        assert name in line
