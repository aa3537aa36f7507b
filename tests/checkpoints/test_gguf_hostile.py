"""Hostile GGUF files.

A file is untrusted input: whatever its header says, opening it either fails with a
``ValueError`` naming the file (and the key or tensor), or gives tensors whose bytes are
exactly their own range of the file, inside it and shared with no other tensor.  Never a
crash, a hang, a MemoryError or an allocation a count in the header asks for.  One test
per kind of defect (counts, lengths, types, dimensions, offsets, alignment, names, split
sets), then hypothesis fuzzers over header bytes and header fields.  The files are built
byte by byte here (tests/gguf_files.py), not by the gguf package: no dependency on it.
"""
import os
import struct
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import torch
from gguf_files import (
    ARRAY,
    BF16,
    BOOL,
    F16,
    F32,
    FLOAT32,
    INT32,
    MXFP4,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    encode,
    kv,
    string,
    tensor_info,
)
from hypothesis import event, given, note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from mxfp4x.checkpoints.gguf import MAX_ARRAY_DEPTH, GGUFCheckpoint, GGUFFile

ARCH = kv("general.architecture", STRING, "gpt-oss")


def _base():
    """(kvs, infos, data) of a small valid file: an MXFP4 stack (3 experts of 5 rows of
    one group), F32, F16, BF16, an odd-sized I8 and an empty F32 tensor; offsets aligned
    to 32."""
    rng = np.random.default_rng(0)
    parts = [("blk.0.ffn_up_exps.weight", [32, 5, 3], MXFP4,
              rng.integers(0, 256, 3 * 5 * 17, dtype=np.uint8).tobytes()),
             ("f32", [3, 2], F32, np.arange(6, dtype=np.float32).tobytes()),
             ("f16", [4], F16, np.arange(4, dtype=np.float16).tobytes()),
             ("bf16", [2, 2], BF16, bytes(range(8))),
             ("i8", [7], 24, bytes(range(7))),
             ("empty", [0, 4], F32, b"")]
    infos, data = [], b""
    for name, ne, t, raw in parts:
        data += bytes(-len(data) % 32)
        infos.append((name, ne, t, len(data)))
        data += raw
    kvs = [ARCH, kv("general.name", STRING, "tiny"),
           kv("tokens", ARRAY, (STRING, ["a", "bc", ""])),
           kv("scores", ARRAY, (FLOAT32, [0.5, -1.0])), kv("flag", BOOL, True)]
    return kvs, infos, data


def _file(path, kvs=None, infos=None, data=None, **kw):
    base_kvs, base_infos, base_data = _base()
    kvs = base_kvs if kvs is None else kvs
    infos = base_infos if infos is None else infos
    data = base_data if data is None else data
    raw = encode(kvs, [i if isinstance(i, bytes) else tensor_info(*i) for i in infos], data,
                 **kw)
    with open(path, "wb") as f:
        f.write(raw)
    return str(path)


def _bytes_of(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_the_base_file_reads():
    with tempfile.TemporaryDirectory() as d:
        f = GGUFFile(_file(os.path.join(d, "base.gguf")))
        assert f.metadata["tokens"] == ["a", "bc", ""] and f.metadata["flag"] is True
        assert f.metadata["scores"].tolist() == [0.5, -1.0]
        assert f.get("blk.0.ffn_up_exps.weight").shape == (3, 5, 1, 17)
        assert f.get("f32").tolist() == [[0, 1, 2], [3, 4, 5]]
        assert f.get("bf16").dtype == torch.bfloat16 and f.get("empty").shape == (4, 0)
        _check_file(f.path)


def _refused(path, *names, where=None):
    """Opening ``path`` is a ValueError naming ``where`` (default: ``path``; a file of
    a split set names the file at fault) and ``names``."""
    with pytest.raises(ValueError) as info:
        GGUFCheckpoint(path)
    msg = str(info.value)
    assert (where or path) in msg and all(n in msg for n in names), msg
    return msg


def _event(what):
    if currently_in_test_context():  # the checks below also run outside the fuzzers
        event(what)


def _kv_case(*kvs):
    return dict(kvs=[ARCH, *kvs])


def _ti_case(*infos):
    return dict(infos=list(infos), data=bytes(64 * 17))


HUGE = 2**64 - 1
CASES = {  # case -> (arguments of _file, what the message names besides the file)
    "version 1": (dict(version=1), "version 1"),
    "version 4": (dict(version=4), "version 4"),
    "big-endian": (dict(version=3 << 24), "big-endian"),
    "2^64-1 tensors": (dict(n_tensors=HUGE), "tensors"),
    "2^63 keys": (dict(n_kv=2**63), "key-value"),
    "one key too many": (dict(n_kv=6), "tensor 0's name"),  # reads a tensor as a key
    "a 2^64-1 byte key": (_kv_case(struct.pack("<Q", HUGE) + b"k"), "key 1"),
    "a key not UTF-8": (_kv_case(kv(b"k\xff", UINT8, 1)), "key 1"),
    "a duplicate key": (_kv_case(kv("k", UINT8, 1), kv("k", UINT8, 2)), "'k' appears twice"),
    "value type 13": (_kv_case(string("k") + struct.pack("<IB", 13, 0)), "'k'"),
    "array of type 13": (_kv_case(string("k") + struct.pack("<IIQ", ARRAY, 13, 1)), "'k'"),
    "array of 2^62 u32": (_kv_case(string("k") + struct.pack("<IIQ", ARRAY, UINT32, 2**62)),
                          "'k'"),
    "array of 2^64-1 strings": (
        _kv_case(string("k") + struct.pack("<IIQ", ARRAY, STRING, HUGE)), "'k'"),
    "arrays nested too deep": (_kv_case(string("k") + struct.pack("<I", ARRAY) + struct.pack(
        "<IQ", ARRAY, 1) * 100_000 + struct.pack("<IQ", UINT8, 0)), "'k'"),
    "a bool of 2": (_kv_case(kv("k", UINT8, 2)[:-5] + struct.pack("<IB", BOOL, 2)), "'k'"),
    "a 2^40 byte string": (_kv_case(string("k") + struct.pack("<IQ", STRING, 2**40)), "'k'"),
    "alignment a u64": (_kv_case(kv("general.alignment", UINT64, 32)), "general.alignment"),
    "alignment 0": (_kv_case(kv("general.alignment", UINT32, 0)), "general.alignment"),
    "alignment 48": (_kv_case(kv("general.alignment", UINT32, 48)), "general.alignment"),
    "architecture an int": (dict(kvs=[kv("general.architecture", INT32, 3)]),
                            "general.architecture"),
    "a 64-byte name": (_ti_case(("n" * 64, [32], MXFP4, 0)), "tensor 0"),
    "an empty name": (_ti_case(("", [32], MXFP4, 0)), "tensor 0"),
    "a name not UTF-8": (_ti_case((b"t\xff", [32], MXFP4, 0)), "tensor 0"),
    "a duplicate name": (_ti_case(("t", [32], MXFP4, 0), ("t", [32], MXFP4, 32)),
                         "'t' appears twice"),
    "5 dimensions": (_ti_case(("t", [32, 1, 1, 1, 1], MXFP4, 0)), "'t'"),
    "2^32 dimensions": (_ti_case(string("t") + struct.pack("<I", 2**32 - 1)), "'t'"),
    "a 2^63 dimension": (_ti_case(("t", [32, 2**63], MXFP4, 0)), "'t'"),
    "dimensions whose product wraps": (_ti_case(("t", [2**32, 2**31, 2**2], 24, 0)), "'t'"),
    "dimensions too large, no bytes": (_ti_case(("t", [32, 0, 2**62], MXFP4, 0)), "'t'"),
    "type 4 (removed)": (_ti_case(("t", [32], 4, 0)), "'t'"),
    "type 42": (_ti_case(("t", [32], 42, 0)), "'t'"),
    "type 2^32-1": (_ti_case(("t", [32], 2**32 - 1, 0)), "'t'"),
    "MXFP4 rows of 33": (_ti_case(("t", [33, 2], MXFP4, 0)), "'t'"),
    "an offset not aligned": (_ti_case(("t", [32], MXFP4, 16)), "'t'"),
    "an offset past the end": (_ti_case(("t", [32], MXFP4, 2**63)), "'t'"),
    "bytes past the end": (_ti_case(("t", [32, 65], MXFP4, 0)), "'t'"),
    "an empty tensor past the end": (_ti_case(("t", [32, 0], MXFP4, 2**40)), "'t'"),
    "overlapping tensors": (_ti_case(("t", [32, 4], MXFP4, 0), ("u", [32, 2], MXFP4, 64)),
                            "'t' and 'u'"),
    "not GGUF": (dict(magic=b"GGML"), "not a GGUF file"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_headers_are_value_errors_naming_file_and_entry(tmp_path, case):
    kwargs, names = CASES[case]
    _refused(_file(tmp_path / "bad.gguf", **kwargs), names)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 7, 23])
def test_short_files(tmp_path, size):
    path = str(tmp_path / "short.gguf")
    with open(path, "wb") as f:
        f.write(encode([], [], b"")[:size])
    _refused(path)


def test_every_truncation(tmp_path):
    """Cut anywhere: refused, or (cut in the trailing padding) every tensor whole."""
    path = _file(tmp_path / "whole.gguf")
    with open(path, "rb") as f:
        whole = f.read()
    accepted = 0
    for n in range(len(whole)):
        cut = str(tmp_path / "cut.gguf")
        with open(cut, "wb") as f:
            f.write(whole[:n])
        accepted += _check_file(cut)
    assert accepted <= 1  # the file ends with its last tensor: no padding to cut


def test_zero_sized_tensors_hold_no_bytes(tmp_path):
    path = _file(tmp_path / "z.gguf", infos=[("a", [32, 2], MXFP4, 0), ("z", [32, 0], MXFP4, 0),
                                              ("y", [0], F32, 32)], data=bytes(34))
    f = GGUFFile(path)
    assert f.get("z").shape == (0, 1, 17) and f.get("y").shape == (0,)
    assert f.get_rows("a", 1, 2).shape == (1, 1, 17) and f.get_rows("y", 0, 0).shape == (0,)


def test_non_utf8_string_values_are_kept_as_bytes(tmp_path):
    path = _file(tmp_path / "b.gguf", kvs=[ARCH, kv("tokens", ARRAY, (STRING, [b"\xff\xfe",
                                                                               "ok"]))])
    assert GGUFFile(path).metadata["tokens"] == [b"\xff\xfe", "ok"]


def test_a_read_cannot_leave_its_tensor(tmp_path):
    path = _file(tmp_path / "r.gguf")
    f = GGUFFile(path)
    t = f.tensor("f32")
    whole = np.fromfile(path, np.uint8)
    for begin, end in ((t.begin - 1, t.end - 1), (t.begin + 1, t.end + 1)):
        with pytest.raises(ValueError, match=r"r\.gguf.*'f32'.*leave"):
            f._view(t, whole[begin:end], begin, None)
    with pytest.raises(ValueError, match=r"r\.gguf.*'f32'.*rows"):
        f._view(t, whole, 0, (1, 4))
    with pytest.raises(ValueError, match="rows"):
        f.get_rows("f16", 0, 5)
    with pytest.raises(KeyError, match="absent"):
        f.get("absent")


def test_a_1d_block_tensor_has_no_rows(tmp_path):
    path = _file(tmp_path / "one.gguf", infos=[("v", [64], MXFP4, 0)], data=bytes(34))
    f = GGUFFile(path)
    assert f.get("v").shape == (2, 17) and f.dequantize("v").shape == (64,)
    with pytest.raises(ValueError, match=r"rows \[0, 1\) of 'v'"):
        f.get_rows("v", 0, 1)


_TRUNCATED_LATER = textwrap.dedent("""
    import sys
    from mxfp4x.checkpoints.gguf import GGUFFile
    f = GGUFFile(sys.argv[1])
    with open(sys.argv[1], "r+b") as fh:
        fh.truncate(200)  # the data section gone after the header was checked
    try:
        f.get("f32")
    except ValueError as exc:
        assert sys.argv[1] in str(exc), exc
        print("refused")
""")


def test_a_file_truncated_after_it_was_opened(tmp_path):
    # in a subprocess: a mapping past the end of a file is SIGBUS when read
    path = _file(tmp_path / "t.gguf")
    out = subprocess.run([sys.executable, "-c", _TRUNCATED_LATER, path], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "refused", (out.returncode, out.stderr)


# ---------------------------------------------------------------------------------------
# split sets


def _split(folder, n, no, count, tensors, names=("a",), split_kvs=None, stem="m"):
    kvs = [ARCH] if no == 0 else []
    if split_kvs is None:
        split_kvs = [kv("split.no", UINT16, no), kv("split.count", UINT16, count),
                     kv("split.tensors.count", INT32, tensors)]
    infos = [(f"{name}", [32], MXFP4, 32 * i) for i, name in enumerate(names)]
    return _file(os.path.join(folder, f"{stem}-{no + 1:05d}-of-{n:05d}.gguf"),
                 kvs=kvs + split_kvs, infos=infos, data=bytes(32 * len(names)))


def test_a_good_split_set(tmp_path):
    paths = [_split(tmp_path, 3, i, 3, 3, names=[f"t{i}"]) for i in range(3)]
    ck = GGUFCheckpoint(paths[1])
    assert sorted(ck.keys()) == ["t0", "t1", "t2"] and ck.byte_range("t2")[0] == paths[2]


@pytest.mark.parametrize("case", ["count", "no", "tensors", "type", "duplicate", "missing",
                                  "zero", "plain"])
def test_bad_split_sets(tmp_path, case):
    n = 2
    args = [dict(n=n, no=i, count=n, tensors=2, names=[f"t{i}"]) for i in range(n)]
    if case == "count":
        args[1]["count"] = 3
    elif case == "no":
        args[1]["no"], args[1]["stem"] = 0, "x"
    elif case == "tensors":
        args[0]["tensors"] = 3
    elif case == "type":
        args[1]["split_kvs"] = [kv("split.no", STRING, "1"), kv("split.count", UINT16, 2)]
    elif case == "duplicate":
        args[1]["names"] = ["t0"]
    paths = [_split(tmp_path, **a) for a in args]
    if case == "no":  # the second file says it is split 0
        os.rename(paths[1], os.path.join(tmp_path, "m-00002-of-00002.gguf"))
    if case == "missing":
        os.remove(paths[1])
    if case == "zero":
        os.rename(paths[0], paths[0].replace("00001-of", "00000-of"))
        paths[0] = paths[0].replace("00001-of", "00000-of")
    if case == "plain":
        os.rename(paths[0], os.path.join(tmp_path, "plain.gguf"))
        paths[0] = os.path.join(tmp_path, "plain.gguf")
    _refused(paths[0], {"count": "split.count", "no": "split.no", "tensors": "split.tensors",
                        "type": "'split.no' is a STRING", "duplicate": "'t0' is in both",
                        "missing": "m-00002-of-00002.gguf", "zero": "split 0 of 2",
                        "plain": "split.count"}[case], where=str(tmp_path))


# ---------------------------------------------------------------------------------------
# fuzzers: the property of every outcome


def _check_file(path):
    """Refused with a ValueError naming the file, or every tensor exactly its own bytes,
    inside the file, shared with no other; returns whether it was accepted."""
    try:
        f = GGUFCheckpoint(path)
    except ValueError as exc:
        assert path in str(exc), exc
        _event("refused")
        return False
    with open(path, "rb") as fh:
        raw = fh.read()
    infos = [f.tensor(n) for n in f.keys()]
    if currently_in_test_context():
        note(f"accepted: {infos}")
    spans = sorted((t.begin, t.end) for t in infos if t.end > t.begin)
    assert all(e0 <= b1 for (_, e0), (b1, _) in zip(spans, spans[1:], strict=False))
    for t in infos:
        assert 0 <= t.begin <= t.end <= len(raw)
        own = raw[t.begin:t.end]
        assert _bytes_of(f.get_raw(t.name)) == own
        got = f.get(t.name)
        if t.ggml_type == MXFP4 or t.ggml_type in (F32, F16, BF16, 24):
            assert _bytes_of(got) == own and tuple(got.shape) in (t.shape, t.byte_shape)
        if len(t.shape) >= 2 and t.shape[0]:
            n = t.shape[0]
            assert _bytes_of(f.get_rows(t.name, n // 2, n)) == own[n // 2 * t.row_bytes:]
    _event(f"accepted, {len(infos)} tensors")
    f.close()
    return True


def _fresh_dir():
    return tempfile.TemporaryDirectory(prefix="mxfp4x-gguf-hostile-")


BASE_FILE = encode(*(lambda k, i, d: (k, [tensor_info(*x) for x in i], d))(*_base()))
VALUES = [0, 1, 2, 3, 4, 7, 8, 9, 13, 17, 31, 32, 33, 39, 42, 63, 64, 255, 2**16, 2**31,
          2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
_bytes_level = st.one_of(
    st.tuples(st.just("u64"), st.integers(0, len(BASE_FILE) - 8), st.sampled_from(VALUES)),
    st.tuples(st.just("u32"), st.integers(0, len(BASE_FILE) - 4),
              st.sampled_from([v for v in VALUES if v < 2**32])),
    st.tuples(st.just("byte"), st.integers(0, len(BASE_FILE) - 1), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(BASE_FILE))),
    st.tuples(st.just("insert"), st.integers(0, len(BASE_FILE)), st.binary(min_size=1,
                                                                          max_size=9)),
    st.tuples(st.just("delete"), st.integers(0, len(BASE_FILE)), st.integers(1, 9)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
)


@given(changes=st.lists(_bytes_level, min_size=1, max_size=3))
def test_fuzz_header_bytes(changes):
    raw = bytearray(BASE_FILE)
    for kind, *args in changes:
        at = min(args[0], len(raw)) if kind != "append" else 0
        if kind == "u64" and at + 8 <= len(raw):
            raw[at:at + 8] = struct.pack("<Q", args[1])
        elif kind == "u32" and at + 4 <= len(raw):
            raw[at:at + 4] = struct.pack("<I", args[1])
        elif kind == "byte" and at < len(raw):
            raw[at] = args[1]
        elif kind == "cut":
            del raw[at:]
        elif kind == "insert":
            raw[at:at] = args[1]
        elif kind == "delete":
            del raw[at:at + args[1]]
        elif kind == "append":
            raw += args[0]
    with _fresh_dir() as d:
        path = os.path.join(d, "fuzz.gguf")
        with open(path, "wb") as f:
            f.write(raw)
        _check_file(path)


_names = st.sampled_from(["a", "b", "blk.0.ffn_gate_exps.weight", "a" * 63, "a" * 64, ""])
_dim = st.one_of(st.integers(0, 70), st.sampled_from(VALUES))
_type = st.sampled_from([MXFP4, F32, F16, BF16, 24, 8, 4, 42, 2**32 - 1])
_offset = st.one_of(st.integers(0, 20).map(lambda k: 32 * k), st.integers(0, 700),
                    st.sampled_from(VALUES))
_info = st.one_of(
    st.tuples(_names, st.lists(_dim, max_size=5), _type, _offset),
    # well-formed entries, so that accepted files with tensors are common too
    st.tuples(st.sampled_from(["w", "x", "blk.1.ffn_down_exps.weight"]),
              st.lists(st.integers(1, 3), min_size=1, max_size=3).map(
                  lambda d: [32 * d[0]] + d[1:]), st.sampled_from([MXFP4, F32, BF16]),
              st.integers(0, 24).map(lambda k: 32 * k)))
_scalar_kv = st.tuples(st.one_of(st.sampled_from(["k", "k2", "general.name"]),
                                 st.sampled_from(["general.alignment", "general.architecture",
                                                  "split.count", "split.no"])),
                       st.sampled_from([UINT8, UINT16, UINT32, INT32, UINT64, FLOAT32, BOOL,
                                        STRING]),
                       st.sampled_from([0, 1, 2, 3, 8, 32, 64, 2**31 - 1]))


def _encode_kv(key, vtype, v):
    if vtype == STRING:
        return kv(key, vtype, str(v))
    if vtype == BOOL:
        return string(key) + struct.pack("<IB", BOOL, v % 256)
    if vtype == FLOAT32:
        return kv(key, vtype, float(v))
    bits = {UINT8: 8, UINT16: 16, UINT32: 32, INT32: 31, UINT64: 64}[vtype]
    return kv(key, vtype, v % (2 ** bits))


# unique keys and names: repeated ones are refused (test_malformed_headers...), and would
# hide every other defect
@given(kvs=st.lists(_scalar_kv, max_size=3, unique_by=lambda k: k[0]),
       infos=st.lists(_info, max_size=4, unique_by=lambda i: i[0]),
       data=st.integers(0, 1024), alignment=st.sampled_from([32, 1, 8, 64]))
def test_fuzz_header_fields(kvs, infos, data, alignment):
    arch = [] if any(k[0] == "general.architecture" for k in kvs) else [ARCH]
    with _fresh_dir() as d:
        path = os.path.join(d, "fields.gguf")
        with open(path, "wb") as f:
            f.write(encode(arch + [_encode_kv(*k) for k in kvs],
                           [tensor_info(*i) for i in infos],
                           (bytes(range(256)) * 4)[:data], alignment=alignment))
        _check_file(path)


def test_deep_nesting_does_not_recurse(tmp_path):
    deep = string("k") + struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * (
        MAX_ARRAY_DEPTH - 1) + struct.pack("<IQ", UINT8, 1) + b"\x07"
    f = GGUFFile(_file(tmp_path / "deep.gguf", kvs=[ARCH, deep]))
    value = f.metadata["k"]
    for _ in range(MAX_ARRAY_DEPTH - 1):
        value = value[0]
    assert value.tolist() == [7]
