"""Every JSON file the package reads (config.json, a safetensors index, a verify manifest)
goes through one reader with one cap, ``MAX_JSON_BYTES``: a larger file is a ValueError
naming it, its size and the cap, refused from its size before any byte is read (the files
here are sparse: their length costs no disk)."""
import json
import os
import tracemalloc

import pytest

from mxfp4x.checkpoints import _header
from mxfp4x.checkpoints.families import read_config
from mxfp4x.checkpoints.safetensors import MAX_HEADER_BYTES, MAX_JSON_BYTES, SafeTensorsCheckpoint


def _sparse(path, size):
    with open(path, "wb") as f:
        f.write(b"{}")
        f.truncate(size)
    return str(path)


def _config(folder):
    return read_config(str(folder))


def _index(folder):
    return SafeTensorsCheckpoint(str(folder))


@pytest.mark.parametrize("read, name", [(_config, "config.json"),
                                        (_index, "model.safetensors.index.json")],
                         ids=["config.json", "index"])
def test_a_json_file_over_the_cap_is_refused_unread(tmp_path, read, name):
    path = _sparse(tmp_path / name, MAX_JSON_BYTES + 1)
    if name != "config.json":
        _sparse(tmp_path / "config.json", 2)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as info:
            read(tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    msg = str(info.value)
    assert path in msg and f"{MAX_JSON_BYTES + 1} bytes" in msg and "MAX_JSON_BYTES" in msg
    assert str(MAX_JSON_BYTES) in msg
    assert peak < 1 << 20, peak  # nothing read: it was refused from its size


def test_the_cap_is_one_for_every_json_file():
    assert MAX_HEADER_BYTES == MAX_JSON_BYTES == _header.MAX_JSON_BYTES == 100_000_000


def test_a_file_at_the_cap_is_read_one_byte_more_is_not(tmp_path, monkeypatch):
    doc = json.dumps({"num_experts": 4, "pad": ""}).encode()
    monkeypatch.setattr(_header, "MAX_JSON_BYTES", len(doc))
    (tmp_path / "config.json").write_bytes(doc)
    assert read_config(str(tmp_path))["num_experts"] == 4
    (tmp_path / "config.json").write_bytes(doc + b" ")
    with pytest.raises(ValueError, match=rf"is {len(doc) + 1} bytes, more than the cap of "
                                         rf"{len(doc)} bytes"):
        read_config(str(tmp_path))


def test_config_json_is_read_as_every_json_file(tmp_path):
    # strict: a repeated key (two meanings for one name) is refused, as in an index
    (tmp_path / "config.json").write_text('{"num_experts": 4, "num_experts": 8}')
    with pytest.raises(ValueError, match=r"config\.json: config\.json is not valid JSON "
                                         r"\(duplicate key 'num_experts'\)"):
        read_config(str(tmp_path))
    if hasattr(os, "mkfifo"):  # a named pipe is refused, not waited on
        os.mkfifo(tmp_path / "fifo.json")
        with pytest.raises(ValueError, match="not a regular file"):
            _header.read_json(str(tmp_path / "fifo.json"), "a pipe")


def test_small_files_are_read_without_allocating_the_cap(tmp_path):
    (tmp_path / "config.json").write_text('{"num_experts": 4}')
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    tracemalloc.start()
    try:
        assert read_config(str(tmp_path)) == {"num_experts": 4}
        assert "t" not in SafeTensorsCheckpoint(str(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # read(n) allocates n bytes before it reads
