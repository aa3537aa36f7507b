"""What a file's header costs in memory: a GGUF header's metadata is held in about its own
bytes (arrays of numbers as numpy arrays, arrays of strings or of arrays as their bytes and
one offset per element, each element decoded when read), each tensor info in a few hundred
bytes, and the counts a header may declare are capped (``gguf.MAX_KEYS``,
``gguf.MAX_TENSORS``), so a small hostile file cannot ask for gigabytes; a file the size of
a real model's header (a 200k-token vocabulary, its merges, tens of thousands of tensors)
still loads.

Measured in this process with tracemalloc (numpy reports its buffers to it too) on files
of a few MB: a regression shows as a ratio to the file's bytes, not as gigabytes."""
import struct
import tracemalloc

import numpy as np
import pytest
from gguf_files import ARRAY, BOOL, F32, FLOAT32, INT32, STRING, UINT8, encode, kv, string

from mxfp4x.checkpoints import gguf
from mxfp4x.checkpoints.gguf import GGUFFile, GGUFList

ARCH = kv("general.architecture", STRING, "gpt-oss")


def _write(path, kvs, infos=b"", n_kv=None, n_tensors=0, size=None):
    """A GGUF file of ``kvs`` (after the architecture) and ``infos`` (encoded tensor
    infos, ``n_tensors`` of them), no data; ``size``: extended to that many bytes (a
    sparse file)."""
    raw = encode([ARCH, *kvs], [infos], b"", n_kv=n_kv, n_tensors=n_tensors)
    with open(path, "wb") as f:
        f.write(raw)
        if size is not None:
            f.truncate(size)
    return str(path), len(raw)


def _array(key, etype, elements):
    """Key ``key``: an array of ``etype`` whose elements are ``elements`` (encoded)."""
    return string(key) + struct.pack("<IIQ", ARRAY, etype, len(elements)) + b"".join(elements)


def _opened(path):
    """(the opened file, tracemalloc's peak while it was opened, in bytes)."""
    tracemalloc.start()
    try:
        f = GGUFFile(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return f, peak


def test_nested_arrays_cost_about_their_bytes(tmp_path):
    n = 100_000  # 1.2 MB of empty uint8 arrays in one array (a Python list of numpy
    # arrays: 20 times that)
    path, size = _write(tmp_path / "nested.gguf",
                        [_array("k", ARRAY, [struct.pack("<IQ", UINT8, 0)] * n)])
    f, peak = _opened(path)
    assert peak < 2 * size + (1 << 20), (peak, size)
    value = f.metadata["k"]
    assert isinstance(value, GGUFList) and len(value) == n
    assert value[0].tolist() == [] and value[-1].dtype == np.uint8


def test_nested_arrays_read_as_values(tmp_path):
    elements = [struct.pack("<IQ", INT32, 2) + struct.pack("<2i", -1, 7),
                struct.pack("<IQ", STRING, 2) + string("a") + string(b"\xff"),
                struct.pack("<IQ", BOOL, 2) + b"\x01\x00",
                struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", FLOAT32, 1)
                + struct.pack("<f", 0.5)]
    path, _ = _write(tmp_path / "values.gguf", [_array("k", ARRAY, elements)])
    value = GGUFFile(path).metadata["k"]
    assert value == [[-1, 7], ["a", b"\xff"], [True, False], [[0.5]]]
    assert value.tolist() == [[-1, 7], ["a", b"\xff"], [True, False], [[0.5]]]
    assert value[-1][0].dtype == np.float32 and value[2].dtype == np.bool_
    assert value[1:3][0] == ["a", b"\xff"] and value[-4].tolist() == [-1, 7]
    assert value != [[-1, 7]] and "GGUFList(ARRAY, 4 elements" in repr(value)
    with pytest.raises(IndexError, match="key 'k'"):
        value[4]
    bad = struct.pack("<IQ", BOOL, 1) + b"\x02"  # a bool inside an array is checked too
    path, _ = _write(tmp_path / "bad.gguf", [_array("k", ARRAY, [bad])])
    with pytest.raises(ValueError, match=r"bad\.gguf: key 'k'\[0\]: a bool array"):
        GGUFFile(path)


def test_string_arrays_cost_about_their_bytes(tmp_path):
    n = 100_000  # one-character strings outside Latin-1: 10 bytes each in the file, a
    # Python str of 74 bytes and a list's pointer each
    path, size = _write(tmp_path / "strings.gguf",
                        [_array("tokens", STRING, [string("\u0101")] * n)])
    f, peak = _opened(path)
    assert peak < 2 * size + (1 << 20), (peak, size)
    tokens = f.metadata["tokens"]
    assert len(tokens) == n and tokens[0] == tokens[-1] == "\u0101"
    assert list(tokens) == [tokens[i] for i in range(n)] == ["\u0101"] * n


def test_tensor_infos_cost_a_few_hundred_bytes_each(tmp_path):
    n = 20_000  # empty F32 tensors of 4-character names: 36 bytes each in the file
    infos = b"".join(string(f"{i:04x}") + struct.pack("<IQIQ", 1, 0, F32, 0)
                     for i in range(n))
    path, size = _write(tmp_path / "infos.gguf", [], infos, n_tensors=n)
    f, peak = _opened(path)
    assert peak < 450 * n + (1 << 20), (peak / n, size)  # was ~600 a tensor
    assert len(f.tensors) == n and f.tensor(f"{n - 1:04x}").shape == (0,)


@pytest.mark.parametrize("what", ["tensors", "keys"])
def test_counts_over_the_caps_are_refused_before_any_entry_is_read(tmp_path, what):
    # a file long enough for the entries the count declares (sparse: zeros), so that
    # only the cap refuses it, before the first entry is read
    over = {"tensors": gguf.MAX_TENSORS, "keys": gguf.MAX_KEYS}[what] + 1
    path, _ = _write(tmp_path / "many.gguf", [], size=30 * over + 4096,
                     **({"n_tensors": over} if what == "tensors" else {"n_kv": over}))
    cap = f"gguf.MAX_{what.upper()}"
    with pytest.raises(ValueError, match=rf"many\.gguf: {over} .* cap .*\({cap}\)"):
        GGUFFile(path)


def test_a_real_models_header_loads(tmp_path):
    # gpt-oss's tokenizer (o200k: 201,088 tokens, 446,189 merges, their token types) and
    # 30,000 tensor infos (llama.cpp's largest MoE files hold about 1,000); what each element
    # costs is measured above, on smaller files (tracemalloc slows this one tenfold)
    n_tokens, n_merges, n_tensors = 201_088, 446_189, 30_000
    tokens = [string(f"t{i}") for i in range(n_tokens)]
    merges = [string(f"t{i % 997} t{i % 89}") for i in range(n_merges)]
    types = struct.pack("<IIQ", ARRAY, INT32, n_tokens) + np.ones(n_tokens, "<i4").tobytes()
    infos = b"".join(string(f"blk.{i // 10}.w{i % 10}.weight") + struct.pack("<IQIQ", 1, 0,
                                                                          F32, 0)
                     for i in range(n_tensors))
    path, _ = _write(tmp_path / "real.gguf",
                        [_array("tokenizer.ggml.tokens", STRING, tokens),
                         _array("tokenizer.ggml.merges", STRING, merges),
                         string("tokenizer.ggml.token_type") + types],
                        infos, n_tensors=n_tensors)
    f = GGUFFile(path)
    m = f.metadata
    assert len(m["tokenizer.ggml.tokens"]) == n_tokens and m["tokenizer.ggml.tokens"][-1] == \
        f"t{n_tokens - 1}"
    assert len(m["tokenizer.ggml.merges"]) == n_merges and m["tokenizer.ggml.merges"][1] == \
        "t1 t1"
    assert m["tokenizer.ggml.token_type"].shape == (n_tokens,) and len(f.tensors) == n_tensors
