"""What the safetensors and GGUF readers promise about the files under them: every tensor
handed out is its caller's own (a write to it reaches no other call, no model loaded
later, and never the file), a file truncated after it was opened is a ValueError naming
it and the tensor (never a mapping past its end, SIGBUS when read), a closed reader
refuses every read, and anything but a regular file (a named pipe, a device, a folder)
is refused before it is opened, without blocking."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf_files import F32, MXFP4, STRING, encode, kv, tensor_info

from mxfp4x.checkpoints import _files
from mxfp4x.checkpoints.families import read_config
from mxfp4x.checkpoints.gguf import GGUFCheckpoint, GGUFFile, is_gguf
from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, SafeTensorsFile, save_file
from mxfp4x.models.gpt_oss import GptOssExperts
from mxfp4x.testing.gpt_oss import write_gpt_oss_layer

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# safetensors: the writer puts the widest elements first, so "a" (I64) is at the start
# of the data and "big" (F32, 32 KiB: several pages) and "experts" (U8) after it
ST = {"a": torch.arange(4, dtype=torch.int64) - 2,
      "big": torch.arange(8192, dtype=torch.float32) / 7,
      "experts": torch.arange(8 * 4 * 17, dtype=torch.int32).remainder(251).to(
          torch.uint8).reshape(8, 4, 17),
      "empty": torch.zeros(0, 3)}


def _write_st(path):
    save_file(ST, str(path))
    return str(path)


def _gguf_parts():
    rng = np.random.default_rng(0)
    return [("f32", [3, 2], F32, np.arange(6, dtype=np.float32).tobytes()),
            ("blk.0.ffn_up_exps.weight", [32, 4, 8], MXFP4,
             rng.integers(0, 256, 8 * 4 * 17, dtype=np.uint8).tobytes()),
            ("big", [8192], F32, (np.arange(8192, dtype=np.float32) / 7).tobytes()),
            ("empty", [0, 4], F32, b"")]


def _write_gguf(path):
    infos, data = [], b""
    for name, ne, t, raw in _gguf_parts():
        data += bytes(-len(data) % 32)
        infos.append(tensor_info(name, ne, t, len(data)))
        data += raw
    with open(path, "wb") as f:
        f.write(encode([kv("general.architecture", STRING, "gpt-oss")], infos, data))
    return str(path)


def _file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# ---------------------------------------------------------------------------------------
# every tensor handed out is its caller's own


_ST_READS = {
    "get": lambda f: f.get("big"),
    "get_many": lambda f: f.get_many(["a", "big"])["big"],
    "get_rows": lambda f: f.get_rows("big", 0, 8192),
}


@pytest.mark.parametrize("write", sorted(_ST_READS))
@pytest.mark.parametrize("reader", [SafeTensorsFile, SafeTensorsCheckpoint])
def test_a_safetensors_tensor_written_to_is_the_callers_alone(tmp_path, reader, write):
    path = _write_st(tmp_path / "m.safetensors")
    on_disk = _file_bytes(path)
    f = reader(path)
    mine = _ST_READS[write](f)
    rows = f.get_rows("experts", 2, 5)
    mine.mul_(0).add_(3)  # the caller's tensor is writable, and its writes stay there
    rows.fill_(9)
    assert torch.equal(mine, torch.full((8192,), 3.0))
    for name, read in _ST_READS.items():
        assert torch.equal(read(f), ST["big"]), name
    assert torch.equal(f.get("experts"), ST["experts"])
    assert torch.equal(f.get_rows("experts", 2, 5), ST["experts"][2:5])
    assert torch.equal(f.get_many(["experts", "a"])["experts"], ST["experts"])
    assert torch.equal(SafeTensorsFile(path).get("big"), ST["big"])
    assert _file_bytes(path) == on_disk


_GGUF_READS = {
    "get": lambda f: f.get("big"),
    "get_raw": lambda f: f.get_raw("big").view(torch.float32).reshape(-1),
    "get_rows": lambda f: f.get_rows("big", 0, 8192),
}


@pytest.mark.parametrize("write", sorted(_GGUF_READS))
@pytest.mark.parametrize("reader", [GGUFFile, GGUFCheckpoint])
def test_a_gguf_tensor_written_to_is_the_callers_alone(tmp_path, reader, write):
    path = _write_gguf(tmp_path / "m.gguf")
    on_disk = _file_bytes(path)
    f = reader(path)
    name = "blk.0.ffn_up_exps.weight"
    want_big = torch.arange(8192, dtype=torch.float32) / 7
    want_blocks = f.get(name).clone()
    want_values = f.dequantize(name)
    mine = _GGUF_READS[write](f)
    mine.fill_(7)
    f.get(name).zero_()
    f.get_rows(name, 1, 3).fill_(255)  # scale bytes 255: NaN, if it were seen
    f.get_raw(name).fill_(1)
    assert torch.equal(mine, torch.full((8192,), 7.0))
    for what, read in _GGUF_READS.items():
        assert torch.equal(read(f), want_big), what
    assert torch.equal(f.get(name), want_blocks)
    assert torch.equal(f.get_rows(name, 0, 8), want_blocks)
    assert np.array_equal(f.dequantize(name).numpy(), want_values.numpy(), equal_nan=True)
    assert torch.equal(GGUFFile(path).get("big"), want_big)
    assert _file_bytes(path) == on_disk


def test_a_model_written_to_does_not_change_the_next_one_loaded(tmp_path):
    """Loading weights into one module (``load_state_dict`` copies into its buffers,
    views of the file) leaves what the same open checkpoint gives the next module."""
    write_gpt_oss_layer(str(tmp_path), num_local_experts=4, hidden_size=64,
                        intermediate_size=64, experts_per_token=2)
    ckpt = SafeTensorsCheckpoint(str(tmp_path))
    first = GptOssExperts.from_checkpoint(ckpt, 0)
    file_state = {k: v.clone() for k, v in first.state_dict().items()}
    first.load_state_dict({k: torch.zeros_like(v) for k, v in file_state.items()})
    assert all(not v.any() for v in first.state_dict().values())
    second = GptOssExperts.from_checkpoint(ckpt, 0)
    for k, v in second.state_dict().items():
        assert torch.equal(v, file_state[k]), k
    fresh = GptOssExperts.from_checkpoint(str(tmp_path), 0)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, file_state[k]), k


def test_without_libc_mmap_tensors_are_private_too(tmp_path, monkeypatch):
    """Where libc's mmap is not used (Windows): Python's mmap, copy-on-write, likewise."""
    monkeypatch.setattr(_files, "_LIBC", None)
    f = SafeTensorsFile(_write_st(tmp_path / "m.safetensors"))
    g = GGUFFile(_write_gguf(tmp_path / "m.gguf"))
    for reader in (f, g):
        mine = reader.get("big")
        mine.fill_(7)
        assert torch.equal(reader.get("big"), ST["big"])
        assert torch.equal(reader.get_rows("big", 0, 8192), ST["big"])
    assert torch.equal(f.get_many(["a", "big"])["big"], ST["big"])


_HELD = textwrap.dedent("""
    import gc, os, resource, sys, torch
    from mxfp4x.checkpoints.gguf import GGUFFile
    from mxfp4x.checkpoints.safetensors import SafeTensorsFile, save_file

    path = sys.argv[1]
    save_file({f"t{i}": torch.full((16,), float(i)) for i in range(3000)}, path + ".st")
    st = SafeTensorsFile(path + ".st")
    gg = GGUFFile(path)

    def mappings():
        with open("/proc/self/maps") as f:
            return sum(line.rstrip().endswith((path, path + ".st")) for line in f)

    # far fewer file descriptors than tensors held: a mapping must not need one
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16,
                                                resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = [st.get(f"t{i}") for i in range(3000)]
    held += [st.get_rows(f"t{i}", 0, 16) for i in range(1000)]
    held += [st.get_many([f"t{i}"])[f"t{i}"] for i in range(1000)]
    held += [gg.get("big") for _ in range(1000)] + [gg.get_raw("f32") for _ in range(500)]
    held += [gg.get_rows("blk.0.ffn_up_exps.weight", 1, 2) for _ in range(500)]
    assert all(float(t[0]) == i for i, t in enumerate(held[:3000]))
    print(mappings() >= len(held), flush=True)
    del held
    gc.collect()
    print(mappings(), flush=True)  # each mapping unmapped with its last tensor
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_held_tensors_hold_no_file_descriptor_and_are_unmapped_when_freed(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf")
    out = subprocess.run([sys.executable, "-c", _HELD, path], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "0"], out.stdout


# ---------------------------------------------------------------------------------------
# a file truncated after it was opened, and a closed reader


_TRUNCATED = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from test_reading_files import _write_gguf, _write_st
    from mxfp4x.checkpoints.gguf import GGUFFile
    from mxfp4x.checkpoints.safetensors import SafeTensorsFile

    folder = sys.argv[2]
    st = SafeTensorsFile(_write_st(folder + "/m.safetensors"))
    gg = GGUFFile(_write_gguf(folder + "/m.gguf"))
    kept = {"st": st.get("big"), "gguf": gg.get("big")}  # a first read of each file
    st.get("a"), gg.get("f32")
    # cut both files just past their first tensor (the rest of their data gone)
    for f, first in ((st, "a"), (gg, "f32")):
        with open(f.path, "r+b") as fh:
            fh.truncate(f.byte_range(first)[1] + 1)
    calls = {
        "st get": (st, "big", lambda: st.get("big")),
        "st get_many": (st, "tensors", lambda: st.get_many(["a", "experts"])),
        "st get_rows": (st, "experts", lambda: st.get_rows("experts", 7, 8)),
        "gguf get": (gg, "big", lambda: gg.get("big")),
        "gguf get_raw": (gg, "blk.0.ffn_up_exps.weight",
                         lambda: gg.get_raw("blk.0.ffn_up_exps.weight")),
        "gguf get_rows": (gg, "blk.0.ffn_up_exps.weight",
                          lambda: gg.get_rows("blk.0.ffn_up_exps.weight", 0, 1)),
        "gguf dequantize": (gg, "blk.0.ffn_up_exps.weight",
                            lambda: gg.dequantize("blk.0.ffn_up_exps.weight")),
    }
    for what, (f, name, call) in calls.items():
        try:
            got = call()
        except ValueError as exc:
            msg = str(exc)
            assert f.path in msg and name in msg and "truncated" in msg, msg
            print("refused", what, flush=True)
        else:
            print("handed out", what, flush=True)
            got = got if not isinstance(got, dict) else got["experts"]
            print(float(got.double().sum()), flush=True)  # SIGBUS here
    # what still lies inside the file reads as before
    assert st.get("a").tolist() == [-2, -1, 0, 1] and st.get_many(["a", "empty"])
    assert gg.get("f32").tolist() == [[0, 1, 2], [3, 4, 5]] and gg.get("empty").numel() == 0
    print("inside", flush=True)
""")


@pytest.mark.skipif(os.name == "nt", reason="Windows refuses to shrink a mapped file")
def test_a_file_truncated_after_a_first_read_is_refused(tmp_path):
    # in a subprocess: a mapping past the end of a file is SIGBUS when read
    out = subprocess.run([sys.executable, "-c", _TRUNCATED, os.path.dirname(__file__),
                          str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [TESTS, os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    lines = out.stdout.split("\n")
    assert sorted(line for line in lines if line.startswith("refused")) == sorted(
        f"refused {f} {c}" for f, cs in (("st", ("get", "get_many", "get_rows")),
                                         ("gguf", ("get", "get_raw", "get_rows",
                                                   "dequantize"))) for c in cs), out.stdout
    assert "inside" in lines


def test_a_closed_reader_refuses_every_read(tmp_path):
    st = SafeTensorsFile(_write_st(tmp_path / "m.safetensors"))
    gg = GGUFCheckpoint(_write_gguf(tmp_path / "m.gguf"))
    before = st.get("big"), gg.get("big")
    st.close()
    gg.close()
    calls = [lambda: st.get("big"), lambda: st.get("empty"), lambda: st.get_many(["a"]),
             lambda: st.get_rows("experts", 0, 1), lambda: gg.get("big"),
             lambda: gg.get("empty"), lambda: gg.get_raw("f32"),
             lambda: gg.get_rows("blk.0.ffn_up_exps.weight", 0, 1),
             lambda: gg.dequantize("blk.0.ffn_up_exps.weight")]
    for call in calls:
        with pytest.raises(ValueError, match="was closed") as info:
            call()
        assert str(tmp_path) in str(info.value)
    # what was read before stays valid; the headers stay readable
    assert torch.equal(before[0], ST["big"]) and torch.equal(before[1], ST["big"])
    assert "big" in st and st.byte_range("a")[0] > 8 and gg.tensor("big").n_bytes == 32768


# ---------------------------------------------------------------------------------------
# only regular files


_PIPES = textwrap.dedent("""
    import json, os, sys
    from mxfp4x.checkpoints import _files
    from mxfp4x.checkpoints.families import read_config
    from mxfp4x.checkpoints.gguf import GGUFCheckpoint, GGUFFile, is_gguf
    from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, SafeTensorsFile, save_file
    import torch

    d = sys.argv[1]
    def pipe(*parts):
        path = os.path.join(d, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkfifo(path)
        return path

    def refused(what, call, path):
        try:
            call()
        except ValueError as exc:
            assert path in str(exc) and "is not a regular file" in str(exc), exc
            print("refused", what, flush=True)
        else:
            print("accepted", what, flush=True)

    fifo = pipe("p.safetensors")
    refused("SafeTensorsFile", lambda: SafeTensorsFile(fifo), fifo)
    refused("SafeTensorsCheckpoint file", lambda: SafeTensorsCheckpoint(fifo), fifo)
    os.makedirs(os.path.join(d, "scan"))
    save_file({"w": torch.ones(2)}, os.path.join(d, "scan", "a.safetensors"))
    scanned = pipe("scan", "b.safetensors")
    refused("folder scan", lambda: SafeTensorsCheckpoint(os.path.join(d, "scan")), scanned)
    index = pipe("indexed", "model.safetensors.index.json")
    refused("index", lambda: SafeTensorsCheckpoint(os.path.join(d, "indexed")), index)
    os.makedirs(os.path.join(d, "shard"))
    with open(os.path.join(d, "shard", "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": "s.safetensors"}}, f)
    shard = pipe("shard", "s.safetensors")
    refused("shard", lambda: SafeTensorsCheckpoint(os.path.join(d, "shard")).get("w"), shard)
    config = pipe("config", "config.json")
    refused("config.json", lambda: read_config(os.path.join(d, "config")), config)
    gg = pipe("p.gguf")
    refused("GGUFFile", lambda: GGUFFile(gg), gg)
    refused("GGUFCheckpoint", lambda: GGUFCheckpoint(gg), gg)
    with open(os.path.join(d, "m-00001-of-00002.gguf"), "wb") as f:
        f.write(b"GGUF")
    second = pipe("m-00002-of-00002.gguf")
    refused("split file", lambda: GGUFCheckpoint(os.path.join(d, "m-00001-of-00002.gguf")),
            second)
    print("is_gguf", is_gguf(gg), flush=True)
    # a path that becomes a named pipe after it was checked: the open does not block either
    _files.check_regular_file = lambda path: None
    refused("replaced after the check", lambda: SafeTensorsFile(fifo), fifo)
    print("done", flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_named_pipes_are_refused_without_blocking(tmp_path):
    # in a subprocess with a timeout: opening a named pipe blocks until a writer comes
    (tmp_path / "files").mkdir()
    with open(tmp_path / "out.txt", "w") as log:
        try:
            out = subprocess.run([sys.executable, "-c", _PIPES, str(tmp_path / "files")],
                                 stdout=log, stderr=subprocess.PIPE, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"blocked on a named pipe; done before: "
                        f"{(tmp_path / 'out.txt').read_text()!r}")
    printed = (tmp_path / "out.txt").read_text()
    assert out.returncode == 0, (printed, out.stderr)
    lines = printed.split("\n")
    for what in ("SafeTensorsFile", "SafeTensorsCheckpoint file", "folder scan", "index",
                 "shard", "config.json", "GGUFFile", "GGUFCheckpoint", "split file",
                 "replaced after the check"):
        assert f"refused {what}" in lines, (what, printed)
    assert "is_gguf False" in lines and "done" in lines


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="a character device")
def test_devices_and_folders_are_refused(tmp_path):
    (tmp_path / "sub.safetensors").mkdir()
    for path in ("/dev/null", str(tmp_path), str(tmp_path / "sub.safetensors")):
        for read in (SafeTensorsFile, GGUFFile, GGUFCheckpoint):
            with pytest.raises(ValueError, match="is not a regular file") as info:
                read(path)
            assert path in str(info.value)
        assert not is_gguf(path)
    with pytest.raises(ValueError, match="sub.safetensors: is not a regular file"):
        SafeTensorsCheckpoint(str(tmp_path))
    (tmp_path / "sub.safetensors").rmdir()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match="config.json: is not a regular file"):
        read_config(str(tmp_path))
    with pytest.raises(FileNotFoundError):  # missing is still missing
        GGUFCheckpoint(str(tmp_path / "none.gguf"))
    with pytest.raises(FileNotFoundError):
        SafeTensorsFile(str(tmp_path / "none.safetensors"))


def test_a_symbolic_link_to_a_regular_file_reads(tmp_path):
    path = _write_st(tmp_path / "m.safetensors")
    os.symlink(path, tmp_path / "link.safetensors")
    assert torch.equal(SafeTensorsFile(str(tmp_path / "link.safetensors")).get("big"),
                       ST["big"])
    gg = _write_gguf(tmp_path / "m.gguf")
    os.symlink(gg, tmp_path / "link.gguf")
    assert is_gguf(str(tmp_path / "link.gguf"))
    assert GGUFCheckpoint(str(tmp_path / "link.gguf")).get("f32").shape == (2, 3)
