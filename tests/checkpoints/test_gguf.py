"""GGUF files read in place: against the gguf package (its writer makes the files, its
reader and dequantizers are the reference), the MXFP4 blocks handed out as views of the
mapped file, expert ranges mapped alone, dense types, split sets, and the names llama.cpp
gives gpt-oss's and Kimi's tensors."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from mxfp4x.checkpoints import families
from mxfp4x.checkpoints.gguf import (
    GGML_TYPES,
    MXFP4,
    GGUFCheckpoint,
    GGUFFile,
    decode_mxfp4_blocks,
    split_files,
)

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402 (after the skip: the helpers import gguf)
    BF16,
    Q8_0,
    gpt_oss_tensors,
    kimi_tensors,
    mxfp4_stack,
    write_gguf,
)


def _raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def gpt_oss(tmp_path, rng):
    tensors = gpt_oss_tensors(rng)
    (path,) = write_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", tensors,
                         metadata=[("gpt-oss.expert_count", 3, 4)])
    return path, tensors


def _written(t):
    """What write_gguf was given for a tensor, as bytes."""
    return (t[0] if isinstance(t, tuple) else t).tobytes()


def test_every_tensor_is_its_bytes_in_the_file_as_gguf_reads_them(gpt_oss):
    path, tensors = gpt_oss
    f = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    with open(path, "rb") as fh:
        data = fh.read()
    assert f.version == 3 and f.architecture == "gpt-oss" and f.alignment == 32
    assert f.metadata["gpt-oss.expert_count"] == 3
    assert list(f.tensors) == [t.name for t in reader.tensors] == list(tensors)
    for rt in reader.tensors:
        t = f.tensor(rt.name)
        assert t.ggml_type == int(rt.tensor_type) and t.type_name == rt.tensor_type.name
        assert t.shape == tuple(int(d) for d in reversed(rt.shape))  # GGUF: fastest first
        assert (t.begin, t.n_bytes) == (rt.data_offset, rt.n_bytes)
        assert _raw(f.get_raw(rt.name)) == data[t.begin:t.end] == rt.data.tobytes() \
            == _written(tensors[rt.name])
        assert f.byte_range(rt.name) == (t.begin, t.end)


def test_mxfp4_experts_are_zero_copy_blocks(gpt_oss, monkeypatch):
    path, tensors = gpt_oss
    f = GGUFFile(path)
    maps = []
    real = f._map
    monkeypatch.setattr(f, "_map", lambda *args: maps.append(real(*args)) or maps[-1])
    name = "blk.1.ffn_gate_exps.weight"
    blocks = f.get(name)
    assert blocks.dtype == torch.uint8 and blocks.shape == (3, 37, 3, 17)
    assert f.tensor(name).shape == (3, 37, 96) and f.tensor(name).byte_shape == (3, 37, 3, 17)
    assert np.array_equal(blocks.numpy().reshape(3, 37, 51), tensors[name][0])
    (mapped,) = maps  # a view of a mapping of just its bytes, not a copy
    assert len(mapped) == f.tensor(name).n_bytes
    assert blocks.data_ptr() == mapped.ctypes.data
    down = f.get("blk.0.ffn_down_exps.weight")
    assert down.shape == (3, 96, 2, 17)  # d_out = 3 * 32 rows of 2 groups


def test_an_expert_range_maps_only_those_experts(gpt_oss, monkeypatch):
    path, tensors = gpt_oss
    ckpt = GGUFCheckpoint(path)
    f = ckpt.files[0]
    maps = []
    real = f._map
    monkeypatch.setattr(f, "_map", lambda b, e, *rest: maps.append((b, e)) or real(b, e, *rest))
    got = families.load_gguf_experts(ckpt, 1, (1, 3))
    assert set(got) == {"gate", "up", "down"}
    for role, t in got.items():
        name = f"blk.1.ffn_{role}_exps.weight"
        info = f.tensor(name)
        full = tensors[name][0]
        assert t.dtype == torch.uint8 and t.shape == (2,) + info.byte_shape[1:]
        assert np.array_equal(t.numpy().reshape(2, *full.shape[1:]), full[1:3])
        row = info.n_bytes // 3
        assert (info.begin + row, info.begin + 3 * row) in maps  # these experts' bytes only
    assert len(maps) == 3
    assert families.load_gguf_experts(ckpt, 0, range(0, 0))["down"].shape == (0, 96, 2, 17)
    with pytest.raises(ValueError, match="expert_range"):
        families.load_gguf_experts(ckpt, 0, (2, 4))
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_inp\.weight.*F32.*MXFP4"):
        families.load_gguf_experts(ckpt, 0, roles=["gate_inp"], naming=families.GGUFExpertNaming(
            "x", (), {}, experts="blk.{layer}.ffn_{proj}.weight"))


def test_get_rows_of_every_type(gpt_oss):
    path, tensors = gpt_oss
    f = GGUFFile(path)
    for name in tensors:
        whole = f.get(name)
        n = whole.shape[0]
        for lo, hi in {(0, n), (0, 1), (n // 2, n), (n, n)}:
            assert torch.equal(f.get_rows(name, lo, hi), whole[lo:hi]), (name, lo, hi)
        for lo, hi in ((0, n + 1), (1, 0), (-1, 1)):
            with pytest.raises(ValueError, match="rows"):
                f.get_rows(name, lo, hi)


def test_mxfp4_values_are_gguf_dequantize_except_scale_255(rng, tmp_path):
    blocks = mxfp4_stack(rng, 3, 37, 3)
    (path,) = write_gguf(tmp_path / "m.gguf", "gpt-oss", {"w": (blocks, MXFP4)})
    ours = GGUFFile(path).dequantize("w").numpy()
    with np.errstate(over="ignore"):  # scales past float32's range: inf, as ours
        theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
    assert ours.shape == theirs.shape == (3, 37, 96) and ours.dtype == np.float32
    scale = np.repeat(blocks.reshape(3, 37, 3, 17)[..., 0], 32, axis=-1)
    assert (scale == 0).any() and (scale == 255).any()
    assert np.array_equal(ours[scale != 255], theirs[scale != 255])  # inf where both overflow
    assert np.isnan(ours[scale == 255]).all()  # ggml reads 255 as 2^127; we as NaN


def test_the_block_arrangement_by_hand():
    # one block: scale 2^(128-127) = 2; byte j holds code j (low) and code 15 - j (high):
    # element j is code j, element j + 16 code 15 - j
    qs = np.array([j | ((15 - j) << 4) for j in range(16)], np.uint8)
    block = np.concatenate([[128], qs]).astype(np.uint8)
    e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    want = [2 * e2m1[j] for j in range(16)] + [2 * e2m1[15 - j] for j in range(16)]
    assert decode_mxfp4_blocks(block).tolist() == want
    assert decode_mxfp4_blocks(block[None]).tolist() == want
    theirs = gguf.quants.dequantize(block[None], gguf.GGMLQuantizationType.MXFP4)
    assert theirs.reshape(-1).tolist() == want
    assert decode_mxfp4_blocks(np.zeros((0, 2, 17), np.uint8)).shape == (0, 64)


def test_gpt_oss_repacked_as_the_converter_does_decodes_to_the_same_matrix(rng):
    """The converter's rule, as the module docs state it: gate rows 0::2, up rows 1::2 of
    the released gate_up, each group as its scale byte then element j in the low and
    j + 16 in the high nibble of byte j; the same values as the safetensors layout."""
    import mxfp4x

    e, two_f, g = 2, 6, 3
    packed = torch.from_numpy(rng.integers(0, 256, (e, two_f, g, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(110, 140, (e, two_f, g), dtype=np.uint8))
    want = mxfp4x.dequantize(packed, scales, torch.float64).numpy()  # (e, 2F, 32 g)
    codes = np.stack([packed.numpy() & 15, packed.numpy() >> 4], -1).reshape(e, two_f, g, 32)
    ggml = np.concatenate([scales.numpy()[..., None],
                           codes[..., :16] | (codes[..., 16:] << 4)], -1).astype(np.uint8)
    gate, up = decode_mxfp4_blocks(ggml[:, 0::2]), decode_mxfp4_blocks(ggml[:, 1::2])
    assert np.array_equal(gate, want[:, 0::2]) and np.array_equal(up, want[:, 1::2])


def test_dense_types_are_views_or_the_gguf_dequantization(rng, tmp_path):
    tensors = kimi_tensors(rng)
    (path,) = write_gguf(tmp_path / "k.gguf", "kimi-k3", tensors)
    f = GGUFFile(path)
    p = "blk.1."
    q8 = f.get(p + "ffn_gate_shexp.weight")
    assert f.tensor(p + "ffn_gate_shexp.weight").type_name == "Q8_0"
    assert q8.dtype == torch.float32 and q8.shape == (64, 96)
    assert np.array_equal(q8.numpy(), gguf.quants.dequantize(
        tensors[p + "ffn_gate_shexp.weight"][0], gguf.GGMLQuantizationType.Q8_0))
    f16 = f.get(p + "ffn_up_shexp.weight")
    assert f16.dtype == torch.float16 and np.array_equal(f16.numpy(),
                                                         tensors[p + "ffn_up_shexp.weight"])
    bf16 = f.get(p + "ffn_down_shexp.weight")
    raw = tensors[p + "ffn_down_shexp.weight"][0]
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (96, 64)
    assert np.array_equal(bf16.float().numpy(), gguf.quants.dequantize(
        raw, gguf.GGMLQuantizationType.BF16))
    assert torch.equal(f.dequantize(p + "ffn_down_shexp.weight"), bf16.float())
    f32 = f.get(p + "exp_probs_b.bias")
    assert torch.equal(f32, torch.from_numpy(tensors[p + "exp_probs_b.bias"]))
    assert f.get_rows(p + "ffn_gate_shexp.weight", 3, 5).shape == (2, 96)
    assert torch.equal(f.get_rows(p + "ffn_gate_shexp.weight", 3, 5), q8[3:5])


def test_a_q8_0_tensor_without_the_gguf_package(rng, tmp_path, monkeypatch):
    tensors = kimi_tensors(rng)
    (path,) = write_gguf(tmp_path / "k.gguf", "kimi-k3", tensors)
    f = GGUFFile(path)
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install gguf"):
        f.get("blk.1.ffn_gate_shexp.weight")
    assert f.get("blk.1.ffn_gate_exps.weight").shape == (5, 37, 3, 17)  # MXFP4: no gguf
    assert f.get("blk.1.ffn_down_shexp.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("alignment", [1, 8, 64])
def test_custom_alignment(rng, tmp_path, alignment):
    tensors = {"odd": rng.integers(0, 100, 7).astype(np.int8),
               "w": (mxfp4_stack(rng, 3, 5, 1), MXFP4),
               "f": rng.standard_normal((3, 5), np.float32)}
    (path,) = write_gguf(tmp_path / "a.gguf", "gpt-oss", tensors, alignment=alignment)
    f = GGUFFile(path)
    assert f.alignment == alignment and f.value_types["general.alignment"] == 4
    assert torch.equal(f.get("f"), torch.from_numpy(tensors["f"]))  # copied if unaligned
    assert torch.equal(f.get("odd"), torch.from_numpy(tensors["odd"]))
    assert _raw(f.get("w")) == tensors["w"][0].tobytes()


def test_a_split_set_is_one_checkpoint(rng, tmp_path):
    tensors = gpt_oss_tensors(rng, n_layers=(0, 1, 2))
    paths = write_gguf(tmp_path / "m.gguf", "gpt-oss", tensors, split_max_tensors=4)
    assert len(paths) == 7 and os.path.basename(paths[2]) == "m-00003-of-00007.gguf"
    assert split_files(paths[4]) == paths
    for given in (paths[0], paths[5]):
        ck = GGUFCheckpoint(given)
        assert ck.paths == paths and ck.architecture == "gpt-oss"
        assert sorted(ck.keys()) == sorted(tensors)
        for name, t in tensors.items():
            file_path, begin, end = ck.byte_range(name)
            with open(file_path, "rb") as fh:
                fh.seek(begin)
                assert fh.read(end - begin) == _written(t) == _raw(ck.get_raw(name))
        assert families.gguf_expert_tensors(ck) == {
            layer: {r: f"blk.{layer}.ffn_{r}_exps.weight" for r in ("down", "gate", "up")}
            for layer in (0, 1, 2)}
    first = GGUFFile(paths[0])
    assert (first.metadata["split.no"], first.metadata["split.count"],
            first.metadata["split.tensors.count"]) == (0, 7, len(tensors))
    assert GGUFFile(paths[3]).metadata["split.no"] == 3
    os.remove(paths[6])
    with pytest.raises(ValueError, match=r"m-00007-of-00007\.gguf.*missing"):
        GGUFCheckpoint(paths[0])


def test_the_names_are_llama_cpps():
    """The facts mxfp4x keeps, against the gguf package's constants."""
    from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES

    names = {TENSOR_NAMES[t] + ".weight" for t in (MODEL_TENSOR.FFN_GATE_EXP,
                                                    MODEL_TENSOR.FFN_UP_EXP,
                                                    MODEL_TENSOR.FFN_DOWN_EXP,
                                                    MODEL_TENSOR.FFN_GATE_UP_EXP)}
    assert {n.format(bid=4) for n in names} == {
        f"blk.4.ffn_{p}_exps.weight" for p in ("gate", "up", "down", "gate_up")}
    assert all(families.GGUF_EXPERT_NAME.fullmatch(n.format(bid=12)) for n in names)
    for naming in (families.GGUF_GPT_OSS, families.GGUF_KIMI_K3, families.GGUF_DEEPSEEK2):
        assert {naming.tensor(4, r) for r in ("gate", "up", "down")} < {
            n.format(bid=4) for n in names}
        assert naming.router == TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_INP].replace(
            "{bid}", "{layer}") + ".weight"
    assert families.GGUF_KIMI_K3.shared == TENSOR_NAMES[MODEL_TENSOR.FFN_GATE_SHEXP].replace(
        "{bid}", "{layer}").replace("gate", "{proj}") + ".weight"
    assert families.GGUF_DEEPSEEK2.router_bias == TENSOR_NAMES[
        MODEL_TENSOR.FFN_EXP_PROBS_B].replace("{bid}", "{layer}") + ".bias"
    assert MODEL_ARCH_NAMES[MODEL_ARCH.GPT_OSS] == "gpt-oss"
    assert MODEL_ARCH_NAMES[MODEL_ARCH.DEEPSEEK2] == "deepseek2"
    assert MODEL_ARCH_NAMES[MODEL_ARCH.KIMI_LINEAR] == "kimi-linear"
    assert families.gguf_naming("gpt-oss") is families.GGUF_GPT_OSS
    assert families.gguf_naming("qwen3moe").tensor(0, "up") == "blk.0.ffn_up_exps.weight"


def test_the_format_facts_are_the_gguf_packages():
    from gguf import constants as c

    assert int(c.GGMLQuantizationType.MXFP4) == MXFP4
    assert c.GGML_QUANT_SIZES[c.GGMLQuantizationType.MXFP4] == (32, 17)
    for t, (block, size) in c.GGML_QUANT_SIZES.items():
        if int(t) in GGML_TYPES or int(t) <= 41:  # every type this reader knows, and more
            assert GGML_TYPES[int(t)] == (t.name, block, size), t
    assert (c.Keys.Split.LLM_KV_SPLIT_NO, c.Keys.Split.LLM_KV_SPLIT_COUNT,
            c.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT) == ("split.no", "split.count",
                                                         "split.tensors.count")
    assert c.Keys.General.ALIGNMENT == "general.alignment" and c.GGUF_DEFAULT_ALIGNMENT == 32
    assert c.Keys.General.ARCHITECTURE == "general.architecture"
    assert int(Q8_0) == int(c.GGMLQuantizationType.Q8_0) and BF16 == int(
        c.GGMLQuantizationType.BF16)


_RSS = textwrap.dedent("""
    import os, struct, sys
    sys.path.insert(0, sys.argv[2])
    from gguf_files import encode, kv, tensor_info, STRING
    from mxfp4x.checkpoints.gguf import GGUFCheckpoint
    from mxfp4x.checkpoints.families import load_gguf_experts

    E, O, G = 16, 2880, 90  # 3 x 16 experts x 2880 x 2880: a layer of ~ 200 MB
    path = sys.argv[1]
    expert = O * G * 17
    infos = [tensor_info(f"blk.0.ffn_{p}_exps.weight", [G * 32, O, E], 39, i * E * expert)
             for i, p in enumerate(("gate", "up", "down"))]
    head = encode([kv("general.architecture", STRING, "gpt-oss")], infos, b"")
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + 3 * E * expert)  # sparse: written quickly, no disk used

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

    ck = GGUFCheckpoint(path)
    import torch
    torch.ones(8).sum().item()  # the first torch op maps code and pools: not the file's
    before = rss()
    layer = load_gguf_experts(ck, 0)
    whole = ck.get("blk.0.ffn_up_exps.weight")
    some = load_gguf_experts(ck, 0, (3, 5))
    assert layer["gate"].shape == (E, O, G, 17) and some["down"].shape == (2, O, G, 17)
    grown = rss() - before
    some["gate"][1, 7].sum().item()  # one row read: one page or two
    print(3 * E * expert, grown, rss() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_mapping_a_layer_does_not_read_it(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _RSS, str(tmp_path / "big.gguf"), tests],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    size, grown, after_read = map(int, out.stdout.split())
    assert size > 200e6
    assert grown < 8 << 20 and after_read < 8 << 20, (grown, after_read)


def test_a_kimi_shaped_file_has_the_names_of_its_entry(rng, tmp_path):
    tensors = kimi_tensors(rng, n_layers=(1, 2))
    (path,) = write_gguf(tmp_path / "k.gguf", "kimi-k3", tensors)
    ckpt = GGUFCheckpoint(path)
    naming = families.gguf_naming(ckpt.architecture)
    assert naming is families.GGUF_KIMI_K3
    for layer in (1, 2):
        names = [naming.tensor(layer, r) for r in ("gate", "up", "down")]
        names += [naming.router.format(layer=layer), naming.router_bias.format(layer=layer)]
        names += [naming.shared.format(layer=layer, proj=p) for p in ("gate", "up", "down")]
        assert all(n in ckpt for n in names), names
        experts = families.load_gguf_experts(ckpt, layer, (2, 5))
        assert {r: tuple(t.shape) for r, t in experts.items()} == {
            "gate": (3, 37, 3, 17), "up": (3, 37, 3, 17), "down": (3, 96, 2, 17)}
        for role, t in experts.items():
            assert np.array_equal(t.numpy().reshape(3, -1), tensors[naming.tensor(
                layer, role)][0][2:5].reshape(3, -1))
    assert families.gguf_expert_tensors(ckpt) == {
        layer: {r: f"blk.{layer}.ffn_{r}_exps.weight" for r in ("down", "gate", "up")}
        for layer in (1, 2)}
