"""Hostile safetensors files and checkpoint indexes.

A file is untrusted input: whatever its header says, reading it either fails with a
``ValueError`` naming the file (and the entry), or gives tensors whose bytes are exactly
their own entry's ``data_offsets`` range of the file.  One regression test per defect of
the reliability report (Hugging Face cache layouts, wrapping shape products, overlapping
entries, duplicate keys, raw TypeError/RecursionError/... escapes, get_rows mutating the
shared header, writing a file in place), then hypothesis fuzzers over mutated headers and
indexes.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading

import numpy as np
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

from mxfp4x.checkpoints.safetensors import (
    SafeTensorsCheckpoint,
    SafeTensorsFile,
    save_file,
    write_file,
)

_NAMES = {torch.float32: "F32", torch.uint8: "U8", torch.bfloat16: "BF16", torch.int16: "I16",
          torch.int64: "I64", torch.bool: "BOOL", torch.float64: "F64"}

# a small file with several dtypes, an odd-sized tensor (later ones unaligned: copied), a
# boolean one and an empty one
BASE = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5,
        "b": torch.arange(5, dtype=torch.uint8) + 100,
        "c": torch.tensor([[1.5, -2], [3, 4]], dtype=torch.bfloat16),
        "e": torch.arange(6, dtype=torch.int16).reshape(3, 2) - 3,
        "f": torch.tensor([True, False, True]),
        "z": torch.zeros(0, 4, dtype=torch.int64)}


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _layout(tensors):
    """(header, data) of tensors stored back to back in the given order: built here, not by
    the writer under test."""
    header, data = {}, b""
    for name, t in tensors.items():
        raw = _bytes_of(t)
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return header, data


BASE_HEADER, BASE_DATA = _layout(BASE)


def _write_raw(path, header, data=b"", length=None):
    """A file from a header (an object, or JSON text / bytes as is) and data bytes."""
    text = header if isinstance(header, bytes) else (
        header.encode() if isinstance(header, str) else json.dumps(header).encode())
    with open(path, "wb") as f:
        f.write((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return str(path)


# ---------------------------------------------------------------------------------------
# (a) Hugging Face cache snapshots: every file a symlink into ../../blobs/


def _as_hf_snapshot(src_folder, cache):
    """The files of ``src_folder`` laid out as the Hugging Face hub cache does: content in
    blobs/<hash>, and snapshots/<revision>/<name> relative symlinks to it."""
    repo = os.path.join(cache, "models--org--tiny")
    blobs = os.path.join(repo, "blobs")
    snap = os.path.join(repo, "snapshots", "0123abcd")
    os.makedirs(blobs)
    os.makedirs(snap)
    for i, fname in enumerate(sorted(os.listdir(src_folder))):
        blob = f"{i:04d}" + "f" * 36
        shutil.copyfile(os.path.join(src_folder, fname), os.path.join(blobs, blob))
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snap, fname))
    return snap


def test_hf_cache_snapshot_is_a_checkpoint(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({k: BASE[k] for k in "abc"}, str(plain / "model-00001-of-00002.safetensors"))
    save_file({k: BASE[k] for k in "efz"}, str(plain / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if k in 'abc' else 2}-of-00002.safetensors" for k in BASE}
    with open(plain / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    snap = _as_hf_snapshot(str(plain), str(tmp_path / "hub"))
    ck = SafeTensorsCheckpoint(snap)
    for k, v in BASE.items():
        assert torch.equal(ck.get(k), v), k
    assert torch.equal(ck.get_many(["a", "e"])["e"], BASE["e"])
    assert torch.equal(ck.get_rows("a", 1, 2), BASE["a"][1:2])


def test_hf_cache_snapshot_of_a_kimi_k3_checkpoint(tmp_path, rng):
    from mxfp4x import nn
    from mxfp4x.testing.kimi_k3 import k3_config, write_k3_checkpoint

    plain = str(tmp_path / "plain")
    write_k3_checkpoint(plain, k3_config(
        hidden_size=64, routed_expert_hidden_size=64, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=32, num_shared_experts=1, num_hidden_layers=2), [1], seed=5,
        shards=2, dense_dtype=torch.float32)
    snap = _as_hf_snapshot(plain, str(tmp_path / "hub"))
    assert os.path.islink(os.path.join(snap, "model.safetensors.index.json"))
    want = nn.KimiK3MoE.from_checkpoint(plain, layer=1, progress=False)
    got = nn.KimiK3MoE.from_checkpoint(snap, layer=1, progress=False)
    x = torch.from_numpy(rng.standard_normal((5, 64))).float()
    assert torch.equal(got(x), want(x))


@pytest.mark.parametrize("name", ["../a.safetensors", "sub/../../a.safetensors", "",
                                  "/abs/a.safetensors", "a.safetensors/", "./a.safetensors",
                                  "a\0.safetensors", 3, None, ["a.safetensors"]])
def test_index_names_must_be_plain_relative_file_names(tmp_path, name):
    save_file({"w": BASE["a"]}, str(tmp_path / "a.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"w": name}}, f)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*'w'"):
        SafeTensorsCheckpoint(str(tmp_path))


def test_index_may_name_a_subfolder(tmp_path):
    (tmp_path / "sub").mkdir()
    save_file({"w": BASE["a"]}, str(tmp_path / "sub" / "a.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"w": "sub/a.safetensors"}}, f)
    assert torch.equal(SafeTensorsCheckpoint(str(tmp_path)).get("w"), BASE["a"])


# ---------------------------------------------------------------------------------------
# (b) sizes, offsets and types of a header


def test_a_shape_product_that_wraps_is_refused(tmp_path):
    # (2**58 + 1) * 2 * 2 * 16 = 2**64 + 64, which int64 arithmetic sees as 64 bytes
    header = {"big": {"dtype": "U8", "shape": [2**58 + 1, 2, 2, 16], "data_offsets": [0, 64]},
              "next": {"dtype": "U8", "shape": [64], "data_offsets": [64, 128]}}
    path = _write_raw(tmp_path / "wrap.safetensors", header, bytes(64) + bytes(range(64)))
    with pytest.raises(ValueError, match=r"wrap\.safetensors.*'big'"):
        SafeTensorsFile(path).get_rows("big", 1, 2)  # was: the bytes of "next"


def test_overlapping_entries_are_refused(tmp_path):
    header = {"x": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
              "y": {"dtype": "U8", "shape": [4], "data_offsets": [6, 10]},
              "zero": {"dtype": "U8", "shape": [0], "data_offsets": [3, 3]}}
    path = _write_raw(tmp_path / "overlap.safetensors", header, bytes(10))
    with pytest.raises(ValueError, match=r"overlap\.safetensors.*'x'.*'y'"):
        SafeTensorsFile(path)
    # the same bytes in any order are fine, and an empty tensor holds no byte
    header["y"]["data_offsets"] = [8, 12]
    path = _write_raw(tmp_path / "fine.safetensors", header, bytes(12))
    assert SafeTensorsFile(path).get("zero").shape == (0,)


@pytest.mark.parametrize("text", [
    '{"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, '
    '"t": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}',
    '{"t": {"dtype": "U8", "shape": [8], "shape": [4], "data_offsets": [0, 4]}}',
    '{"__metadata__": {"k": "1", "k": "2"}, '
    '"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
], ids=["tensor", "field", "metadata"])
def test_duplicate_keys_are_refused(tmp_path, text):
    path = _write_raw(tmp_path / "dup.safetensors", text, bytes(8))
    with pytest.raises(ValueError, match=r"dup\.safetensors.*duplicate key '(t|shape|k)'"):
        SafeTensorsFile(path)


def _entry(**change):
    return {"t": {"dtype": "U8", "shape": [2, 2], "data_offsets": [0, 4], **change}}


# each: (header object or JSON text, data, what the message must also name)
MALFORMED = {
    "list dtype": (_entry(dtype=["U8"]), bytes(4), "'t'"),
    "dict dtype": (_entry(dtype={"U8": 1}), bytes(4), "'t'"),
    "2**70 dim": (_entry(shape=[2**70, 0]), bytes(4), "'t'"),
    "2**70 dim, no bytes": (_entry(shape=[0, 2**70], data_offsets=[0, 0]), b"", "'t'"),
    "true dim": (_entry(shape=[True, 4]), bytes(4), "'t'"),
    "false dim": (_entry(shape=[4, False], data_offsets=[0, 0]), b"", "'t'"),
    "float dim": (_entry(shape=[2.0, 2]), bytes(4), "'t'"),
    "bool offset": (_entry(data_offsets=[False, 4]), bytes(4), "'t'"),
    "three offsets": (_entry(data_offsets=[0, 2, 4]), bytes(4), "'t'"),
    "entry a list": ({"t": [1, 2]}, bytes(4), "'t'"),
    "33 dims": (_entry(shape=[1] * 31 + [2, 2]), bytes(4), "'t'"),
    "metadata a list": ({"__metadata__": ["x"], **_entry()}, bytes(4), "__metadata__"),
    "metadata not strings": ({"__metadata__": {"k": 1}, **_entry()}, bytes(4), "__metadata__"),
    "deep nesting": ('{"__metadata__": ' + "[" * 100_000 + "]" * 100_000 + "}", b"", ""),
    "invalid UTF-8": (b'{"t\xff": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
                      bytes(4), ""),
    "UTF-16": ('{"t": {}}'.encode("utf-16"), b"", ""),
    "a 5000-digit dim": ('{"t": {"dtype": "U8", "shape": [' + "9" * 5000 + '], '
                         '"data_offsets": [0, 4]}}', bytes(4), ""),
    "header past the end": ("{}", b"", ""),  # written with a longer length below
    "header length 2**64 - 1": ("{}", b"", ""),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_headers_are_value_errors_naming_file_and_entry(tmp_path, case):
    header, data, entry = MALFORMED[case]
    length = {"header past the end": 100, "header length 2**64 - 1": 2**64 - 1}.get(case)
    path = _write_raw(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(ValueError) as info:
        SafeTensorsFile(path)
    assert path in str(info.value) and entry in str(info.value), info.value


@pytest.mark.parametrize("size", [0, 1, 7])
def test_a_file_shorter_than_8_bytes_is_refused(tmp_path, size):
    path = _write_raw(tmp_path / "short.safetensors", b"")
    with open(path, "wb") as f:
        f.write(bytes(size))
    with pytest.raises(ValueError, match="short.safetensors"):
        SafeTensorsFile(path)


INDEXES = {
    "a list": b'["weight_map"]',
    "no weight_map": b'{"metadata": {}}',
    "weight_map a list": b'{"weight_map": [["w", "a.safetensors"]]}',
    "a number as a file": b'{"weight_map": {"w": 7}}',
    "invalid UTF-8": b'{"weight_map": {"w\xc3(": "a.safetensors"}}',
    "deep nesting": b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "duplicate tensor": b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}',
    "not JSON": b"\x00\x01PK\x03\x04",
}


@pytest.mark.parametrize("case", sorted(INDEXES))
def test_malformed_indexes_are_value_errors_naming_the_index(tmp_path, case):
    save_file({"w": BASE["a"]}, str(tmp_path / "a.safetensors"))
    index = str(tmp_path / "model.safetensors.index.json")
    with open(index, "wb") as f:
        f.write(INDEXES[case])
    with pytest.raises(ValueError) as info:
        SafeTensorsCheckpoint(str(tmp_path))
    assert index in str(info.value), info.value


def test_an_index_naming_the_wrong_file(tmp_path):
    save_file({"w": BASE["a"]}, str(tmp_path / "a.safetensors"))
    save_file({"v": BASE["b"]}, str(tmp_path / "b.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"w": "b.safetensors", "v": "b.safetensors"}}, f)
    ck = SafeTensorsCheckpoint(str(tmp_path))
    assert torch.equal(ck.get("v"), BASE["b"])
    with pytest.raises(ValueError, match=r"'w'.*b\.safetensors"):
        ck.get("w")
    with pytest.raises(KeyError):
        ck.get("u")


def test_unknown_dtypes_and_empty_tensors(tmp_path):
    header, data = _layout(BASE)
    header["q"] = {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [len(data), len(data) + 2]}
    header["z0"] = {"dtype": "F32", "shape": [3, 0, 2**20], "data_offsets": [3, 3]}
    path = _write_raw(tmp_path / "mixed.safetensors", header, data + b"\x01\x02")
    f = SafeTensorsFile(path)
    with pytest.raises(ValueError, match=r"mixed\.safetensors.*'q'.*F8_E4M3"):
        f.get("q")
    with pytest.raises(TypeError):  # as before files were validated
        f.get_many(["a", "q"])
    for k, v in BASE.items():
        assert torch.equal(f.get(k), v), k
    assert f.get("z0").shape == (3, 0, 2**20)
    assert f.get_rows("z0", 1, 3).shape == (2, 0, 2**20)
    assert f.get_many(["z", "z0"])["z"].shape == (0, 4)
    assert f.get_rows("z", 0, 0).shape == (0, 4)


def test_a_read_cannot_leave_its_entry(tmp_path):
    path = _write_raw(tmp_path / "two.safetensors", *_layout(BASE))
    f = SafeTensorsFile(path)
    whole = np.fromfile(path, np.uint8)
    e = f._entries["b"]
    for begin, end in ((e.begin - 1, e.end - 1), (e.begin + 1, e.end + 1), (e.begin, e.end + 1)):
        with pytest.raises(ValueError, match=r"two\.safetensors.*'b'.*leave"):
            f._view("b", e, whole, 0, (end - begin,), begin, end)
    with pytest.raises(ValueError, match="rows"):
        f.get_rows("a", 1, 3)


# ---------------------------------------------------------------------------------------
# (c) concurrent readers


def test_concurrent_get_rows_never_mutate_the_header(tmp_path):
    tensors = {"stack": torch.arange(64 * 48, dtype=torch.int32).reshape(64, 48),
               "other": torch.ones(3)}
    path = str(tmp_path / "stack.safetensors")
    save_file(tensors, path)
    f = SafeTensorsFile(path)
    expected = set(tensors)
    errors, seen = [], set()
    start = threading.Barrier(5)
    done = threading.Event()

    def read(seed):
        rng = np.random.default_rng(seed)
        start.wait()
        try:
            for _ in range(300):
                lo = int(rng.integers(0, 64))
                hi = int(rng.integers(lo, 65))
                if not torch.equal(f.get_rows("stack", lo, hi), tensors["stack"][lo:hi]):
                    errors.append(f"rows [{lo}, {hi}) differ")
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(repr(exc))

    def watch():
        start.wait()
        while not done.is_set():
            try:
                seen.update(list(f.keys()) + list(f.header))
            except Exception as exc:  # noqa: BLE001 - "changed size during iteration"
                errors.append(repr(exc))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave the threads as often as possible
    try:
        readers = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        watcher = threading.Thread(target=watch)
        for t in readers + [watcher]:
            t.start()
        for t in readers:
            t.join()
        done.set()
        watcher.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:5]
    assert seen == expected, seen - expected


def test_concurrent_first_reads_share_one_file_and_keep_their_tensors_apart(tmp_path):
    save_file({k: BASE[k] for k in "abc"}, str(tmp_path / "x.safetensors"))
    save_file({k: BASE[k] for k in "ef"}, str(tmp_path / "y.safetensors"))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {**{k: "x.safetensors" for k in "abc"},
                                  **{k: "y.safetensors" for k in "ef"}}}, f)
    ck = SafeTensorsCheckpoint(str(tmp_path))
    start = threading.Barrier(8)
    got, errors = [], []

    def read(name):
        start.wait()
        try:
            got.append((name, ck.get(name)))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=read, args=(n,)) for n in "abcefabe"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(ck._files) == 2
    for name, t in got:
        assert torch.equal(t, BASE[name])
    for _, t in got:  # each call's tensor its own: a write to it reaches no other
        t.zero_()
    for name in "abcef":
        assert torch.equal(ck.get(name), BASE[name]), name


# ---------------------------------------------------------------------------------------
# (d) writing a file that is being read


_REWRITE = textwrap.dedent("""
    import sys, torch
    from mxfp4x.checkpoints.safetensors import SafeTensorsFile, save_file
    path = sys.argv[1]
    old = {"big": torch.arange(1 << 18, dtype=torch.float32), "small": torch.arange(7.0)}
    save_file(old, path)
    views = {k: SafeTensorsFile(path).get(k) for k in old}
    # the same path, from views of its own mapping, in a different layout
    save_file({"small": views["small"], "big": views["big"], "new": torch.ones(3)}, path)
    new = SafeTensorsFile(path)
    assert torch.equal(new.get("big"), old["big"]) and torch.equal(new.get("small"),
                                                                   old["small"])
    assert torch.equal(new.get("new"), torch.ones(3))
    assert all(torch.equal(views[k], old[k]) for k in old)  # the old file's pages live on
    print("ok")
""")


def test_rewriting_a_file_from_views_of_itself(tmp_path):
    # in a subprocess: writing in place truncated the mapped file, and reading the views
    # then is SIGBUS
    out = subprocess.run([sys.executable, "-c", _REWRITE, str(tmp_path / "f.safetensors")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr)
    assert os.listdir(tmp_path) == ["f.safetensors"]


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path):
    path = str(tmp_path / "keep.safetensors")
    save_file(BASE, path)
    with open(path, "rb") as f:
        before = f.read()

    def boom():
        raise RuntimeError("make failed")

    entries = {"a": (torch.float32, (2, 3), lambda: BASE["a"]),
               "x": (torch.uint8, (4,), boom),
               "b": (torch.uint8, (5,), lambda: BASE["b"])}
    with pytest.raises(RuntimeError, match="make failed"):
        write_file(path, entries)
    with open(path, "rb") as f:
        assert f.read() == before
    assert os.listdir(tmp_path) == ["keep.safetensors"]  # no temporary file left


def test_the_writer_refuses_what_the_reader_would(tmp_path):
    path = str(tmp_path / "w.safetensors")
    with pytest.raises(TypeError, match="metadata"):
        save_file({"a": BASE["a"]}, path, {"k": 1})
    with pytest.raises(ValueError, match="__metadata__"):
        save_file({"__metadata__": BASE["a"]}, path)
    assert not os.listdir(tmp_path)


# ---------------------------------------------------------------------------------------
# fuzzers: the property of every outcome


def _check_reads(f, path, name, info, raw, base):
    """get / get_many / get_rows of ``name``: an absent name is a KeyError, a refusal a
    ValueError naming the file and the entry, a tensor exactly its entry's bytes."""
    def attempt(read):
        try:
            return read()
        except KeyError:
            assert info is None, f"KeyError for {name!r}, which is in the header"
        except ValueError as exc:
            assert path in str(exc) and repr(name) in str(exc), exc
        return None

    t = attempt(lambda: f.get(name))
    many = attempt(lambda: f.get_many([name, name]))
    assert (t is None) == (many is None)
    if t is None:
        return False
    begin, end = info["data_offsets"]
    own = raw[base + begin:base + end]
    assert _bytes_of(t) == own and _bytes_of(many[name]) == own
    if t.dim() == 0:
        assert attempt(lambda: f.get_rows(name, 0, 1)) is None
        return True
    n, row = t.shape[0], len(own) // max(t.shape[0], 1)
    for lo, hi in {(0, n), (0, min(1, n)), (n // 2, n), (n, n)}:
        r = f.get_rows(name, lo, hi)
        assert r.dtype == t.dtype and tuple(r.shape) == (hi - lo,) + tuple(t.shape[1:])
        assert _bytes_of(r) == own[lo * row:hi * row]
    assert attempt(lambda: f.get_rows(name, 0, n + 1)) is None
    assert attempt(lambda: f.get_rows(name, 1, 0)) is None
    return True


def _opened(open_, path):
    """``open_()``, or None when it refuses with a ValueError naming ``path`` (counted)."""
    try:
        return open_()
    except ValueError as exc:
        assert path in str(exc), exc
        event("refused")
        return None


def _check_file(path):
    """The property for one file: refused with a ValueError naming it, or every read
    within its own entry."""
    f = _opened(lambda: SafeTensorsFile(path), path)
    if f is None:
        return
    with open(path, "rb") as fh:
        raw = fh.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])  # accepted: plain JSON, no repeated keys
    note(f"accepted: {header}")
    try:
        readable = [name for name in [*f.keys(), "absent"]
                    if _check_reads(f, path, name, header.get(name), raw, 8 + n)]
        event(f"accepted, {len(readable)} read")
        for k, t in f.get_many(readable).items():  # one window over all of them
            begin, end = header[k]["data_offsets"]
            assert _bytes_of(t) == raw[8 + n + begin:8 + n + end]
    finally:
        f.close()


HUGE = [2**31, 2**32, 2**58 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 2**70, -1, -2**63]
DTYPES = ["F64", "F32", "F16", "BF16", "F8_E8M0", "I64", "I32", "I16", "I8", "U8", "BOOL",
          "F8_E4M3", "", "f32"]
_scalar = st.one_of(st.none(), st.booleans(), st.sampled_from(HUGE), st.integers(-3, 70),
                    st.floats(), st.text(max_size=4), st.sampled_from(DTYPES))
_value = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6)
_dim = st.one_of(st.integers(0, 8), st.sampled_from(HUGE + [True, False, 1.0, 0.5, "2", None]))
_offset = st.one_of(st.integers(-2, len(BASE_DATA) + 2), st.sampled_from(HUGE + [True, 2.0]))
_names = st.sampled_from(sorted(BASE_HEADER))


# mutations that keep a file valid, so that the reads of mutated files are exercised too
_valid_mutation = st.one_of(
    st.tuples(st.just("reshape"), _names, st.integers(0, 20)),
    st.tuples(st.just("as bytes"), _names, st.integers(0, 8)),  # a tail, retyped as U8
    st.tuples(st.just("empty"), _names, st.integers(0, 3)),
    st.tuples(st.just("dtype"), _names, st.just("F8_E4M3")),  # unknown: unreadable, no more
    st.tuples(st.just("metadata"), st.dictionaries(st.text(max_size=3), st.text(max_size=3))),
)
_mutation = st.one_of(
    st.tuples(st.just("dtype"), _names, st.one_of(st.sampled_from(DTYPES), _value)),
    st.tuples(st.just("shape"), _names, st.one_of(st.lists(_dim, max_size=5), _value)),
    st.tuples(st.just("offsets"), _names, st.one_of(st.lists(_offset, min_size=2, max_size=2),
                                                     st.lists(_offset, max_size=4), _value)),
    st.tuples(st.just("drop"), _names, st.sampled_from(["dtype", "shape", "data_offsets"])),
    st.tuples(st.just("entry"), _names, _value),
    st.tuples(st.just("overlap"), _names, _names, st.integers(-3, 3)),
    st.tuples(st.just("metadata"), _value),
    st.tuples(st.just("add"), st.text(max_size=3), st.sampled_from(DTYPES),
              st.lists(_dim, max_size=3), st.lists(_offset, min_size=2, max_size=2)),
)


def _int_list(x, size=None):
    return (isinstance(x, list) and all(type(d) is int for d in x)
            and (size is None or len(x) == size))


def _mutate(header, mutation):
    kind, *args = mutation
    if kind == "metadata":
        header["__metadata__"] = args[0]
        return
    if kind == "add":
        name, dtype, shape, offsets = args
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        return
    name = args[0]
    info = header.get(name)
    if not isinstance(info, dict):
        return
    offsets = info.get("data_offsets")
    if kind == "dtype":
        info["dtype"] = args[1]
    elif kind == "shape":
        info["shape"] = args[1]
    elif kind == "offsets":
        info["data_offsets"] = args[1]
    elif kind == "reshape" and _int_list(info.get("shape")):
        count = int(np.prod(info["shape"]))
        shapes = [[count], [count, 1], [1, count]] + [[d, count // d] for d in range(
            2, count) if count % d == 0] if count else [[0], [0, 5], [3, 0, 2]]
        info["shape"] = shapes[args[1] % len(shapes)]
    elif kind == "as bytes" and _int_list(offsets, 2):
        begin = min(offsets[0] + args[1], offsets[1])
        info.update(dtype="U8", shape=[offsets[1] - begin], data_offsets=[begin, offsets[1]])
    elif kind == "empty" and _int_list(offsets, 2):
        info.update(shape=[0, args[1]], data_offsets=[offsets[0]] * 2)
    elif kind == "drop":
        info.pop(args[1], None)
    elif kind == "entry":
        header[name] = args[1]
    elif kind == "overlap" and isinstance(header.get(args[1]), dict):
        other = header[args[1]].get("data_offsets")
        if _int_list(other, 2):
            info["data_offsets"] = [other[0] + args[2], other[1] + args[2]]


def _fresh_dir():
    return tempfile.TemporaryDirectory(prefix="mxfp4x-hostile-")


@given(valid=st.lists(_valid_mutation, max_size=3), hostile=st.lists(_mutation, max_size=2),
       pad=st.integers(0, 7))
def test_fuzz_header_fields(valid, hostile, pad):
    header = json.loads(json.dumps(BASE_HEADER))
    for m in valid + hostile:
        _mutate(header, m)
    with _fresh_dir() as d:
        _check_file(_write_raw(os.path.join(d, "fuzz.safetensors"), json.dumps(header)
                               + " " * pad, BASE_DATA))


_bytes_level = st.one_of(
    st.tuples(st.just("cut header"), st.integers(0, 400), st.booleans()),
    st.tuples(st.just("length"), st.one_of(st.integers(0, 1000),
                                           st.sampled_from([2**63, 2**64 - 1, 2**32 + 5]))),
    st.tuples(st.just("cut file"), st.integers(0, 600)),
    st.tuples(st.just("random header"), st.binary(max_size=64)),
    st.tuples(st.just("insert"), st.integers(0, 400),
              st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x00", b"\\ud800", b"{",
                               b"[", b",", b'"', b"NaN", b"-", b"9" * 5000, b"1e999"])),
    st.tuples(st.just("deep"), st.integers(1, 100_000), st.sampled_from(["[", '{"k":'])),
    st.tuples(st.just("duplicate"), _names, st.sampled_from(["top", "field", "metadata"])),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("encoding"), st.sampled_from(["utf-16", "utf-32", "utf-8-sig"])),
)


def _deep(depth, opener):
    closer = "]" if opener == "[" else "}"
    return opener * depth + "0" + closer * depth


@given(change=_bytes_level, field_mutation=st.none() | _valid_mutation | _mutation)
def test_fuzz_header_bytes(change, field_mutation):
    header = json.loads(json.dumps(BASE_HEADER))
    if field_mutation is not None:
        _mutate(header, field_mutation)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    data, length = BASE_DATA, None
    kind, *args = change
    if kind == "cut header":
        text = text[:args[0]]
        length = None if args[1] else len(json.dumps(header))
    elif kind == "length":
        length = args[0]
    elif kind == "random header":
        text = args[0]
    elif kind == "insert":
        at = args[0] % (len(text) + 1)
        text = text[:at] + args[1] + text[at:]
    elif kind == "deep":
        text = text.replace(b'{"format": "pt"}', _deep(*args).encode())
    elif kind == "duplicate":
        name, level = args
        entry = json.dumps(BASE_HEADER[name])
        if level == "top":
            text = b"{" + f'"{name}": {entry}, '.encode() + text[1:]
        elif level == "field":
            text = text.replace(f'"{name}": {{'.encode(),
                                f'"{name}": {{"dtype": "U8", '.encode(), 1)
        else:
            text = text.replace(b'{"format": "pt"}', b'{"format": "pt", "format": "np"}')
    elif kind == "append":
        data = data + args[0]
    elif kind == "encoding":
        text = json.dumps(header).encode(args[0])
    with _fresh_dir() as d:
        path = _write_raw(os.path.join(d, "fuzz.safetensors"), text, data, length)
        if kind == "cut file":
            with open(path, "r+b") as f:
                f.truncate(args[0])
        _check_file(path)


# the checkpoint behind the index fuzzer: two shards, one in a subfolder
_SHARDS = {"a.safetensors": ["a", "b", "c"], "sub/b.safetensors": ["e", "f", "z"]}
_BAD_FILE_NAMES = ["", "/abs/a.safetensors", "../a.safetensors", "sub/../a.safetensors",
                   "./a.safetensors", "a.safetensors/", "sub//b.safetensors", "a\0b", 3, None,
                   True, ["a.safetensors"], {"f": "a.safetensors"}]
_index_change = st.one_of(
    st.tuples(st.just("file"), _names, st.sampled_from(sorted(_SHARDS) + _BAD_FILE_NAMES)),
    st.tuples(st.just("weight_map"), _value),
    st.tuples(st.just("document"), _value),
    st.tuples(st.just("drop"), _names),
    st.tuples(st.just("add"), st.text(max_size=3), st.sampled_from(sorted(_SHARDS))),
    st.tuples(st.just("text"), st.sampled_from(["duplicate", "bad utf-8", "deep", "cut"]),
              st.integers(0, 200)),
    st.tuples(st.just("random"), st.binary(max_size=48)),
)


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    (folder / "sub").mkdir()
    for fname, names in _SHARDS.items():
        save_file({k: BASE[k] for k in names}, str(folder / fname))
    return folder


@given(changes=st.lists(_index_change, min_size=1, max_size=3))
def test_fuzz_index(shard_folder, changes):
    doc = {"metadata": {"total_size": 1},
           "weight_map": {k: fname for fname, names in _SHARDS.items() for k in names}}
    text = None
    for kind, *args in changes:
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if kind == "file" and isinstance(wm, dict):
            wm[args[0]] = args[1]
        elif kind == "weight_map" and isinstance(doc, dict):
            doc["weight_map"] = args[0]
        elif kind == "document":
            doc = args[0]
        elif kind == "drop" and isinstance(wm, dict):
            wm.pop(args[0], None)
        elif kind == "add" and isinstance(wm, dict):
            wm[args[0]] = args[1]
        elif kind == "text":
            how, at = args
            text = json.dumps(doc).encode()
            if how == "duplicate" and text.startswith(b'{"metadata"'):
                text = b'{"weight_map": {"b": "a.safetensors"}, ' + text[1:]
            elif how == "bad utf-8":
                text = text[:at] + b"\xff\xfe" + text[at:]
            elif how == "deep":
                text = b'{"weight_map": ' + _deep(at * 500 + 1, "[").encode() + b"}"
            else:
                text = text[:at]
        elif kind == "random":
            text = args[0]
    with _fresh_dir() as d:
        for fname in _SHARDS:
            os.makedirs(os.path.dirname(os.path.join(d, fname)), exist_ok=True)
            os.symlink(shard_folder / fname, os.path.join(d, fname))
        index = os.path.join(d, "model.safetensors.index.json")
        with open(index, "wb") as f:
            f.write(json.dumps(doc).encode() if text is None else text)
        ck = _opened(lambda: SafeTensorsCheckpoint(d), index)
        if ck is None:
            return
        note(f"accepted: {doc if text is None else text}")
        event("accepted")
        for name in [*ck._where, "absent"]:
            try:
                t = ck.get(name)
            except KeyError:
                assert name not in ck
            except ValueError as exc:  # an index that names the wrong shard
                assert d in str(exc) and repr(name) in str(exc), exc
            except OSError:  # a shard that is not there: opened lazily (partial downloads)
                assert not os.path.isfile(ck._where[name])
            else:
                assert torch.equal(t, BASE[name])  # never another tensor's bytes
        for f in ck._files.values():
            f.close()


def test_a_folder_without_index_refuses_a_name_in_two_files(tmp_path):
    # which of the two tensors would be read was a guess (the later file, by name)
    from mxfp4x.checkpoints.safetensors import SafeTensorsCheckpoint, save_file
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="'w' is in both 'a.safetensors' and 'b.safetensors'"):
        SafeTensorsCheckpoint(str(tmp_path))
