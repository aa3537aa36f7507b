"""Small GGUF files for the tests: written by the gguf package's own writer
(``gguf.GGUFWriter``), so that the reader is checked against the format as llama.cpp's
tools write it, plus a byte-level encoder of headers for hostile ones."""
import struct

import numpy as np

# GGUF value types (gguf.GGUFValueType), for the byte-level encoder
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL = range(8)
STRING, ARRAY, UINT64, INT64, FLOAT64 = 8, 9, 10, 11, 12
_FMT = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i",
        FLOAT32: "f", BOOL: "?", UINT64: "Q", INT64: "q", FLOAT64: "d"}
MXFP4, Q8_0, F32, F16, BF16, I8 = 39, 8, 0, 1, 30, 24


def mxfp4_stack(rng, n_experts, d_out, n_groups):
    """Random GGUF MXFP4 blocks uint8 (n_experts, d_out, n_groups * 17), scale bytes
    spanning 0..255 (0 and 255 included)."""
    blocks = rng.integers(0, 256, (n_experts, d_out, n_groups, 17), dtype=np.uint8)
    scales = blocks[..., 0].reshape(-1)
    scales[:2] = (0, 255)
    scales[2:] = rng.integers(100, 140, scales.size - 2)  # mostly finite, moderate
    scales[2::7] = rng.integers(0, 256, scales[2::7].size)
    return blocks.reshape(n_experts, d_out, n_groups * 17)


def write_gguf(path, arch, tensors, metadata=(), alignment=None, split_max_tensors=0):
    """Write ``tensors`` (name -> array, or (uint8 bytes array, GGML type id)) with the
    gguf package; ``metadata``: (key, value, GGUFValueType or None) triples.  Returns
    the paths written (several when split)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype in metadata:
        w.add_key_value(key, value, gguf.GGUFValueType(vtype) if vtype is not None else
                        gguf.GGUFValueType.get_type(value),
                        sub_type=gguf.GGUFValueType.get_type(value[0])
                        if isinstance(value, list) and value else None)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            w.add_tensor(name, t[0], raw_dtype=gguf.GGMLQuantizationType(t[1]))
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    paths = [str(p) for p in w.format_shard_names(w.path)]
    w.close()
    return paths


def gpt_oss_tensors(rng, n_layers=(0, 1), n_experts=3, d_out=37, n_groups=3):
    """A gpt-oss-shaped model as llama.cpp's converter writes it: per layer the stacked
    MXFP4 gate and up experts (d_out rows of d_in = n_groups * 32) and down (d_in rows of
    whole groups past d_out), their F32 biases, the router and the sinks in F32."""
    d_in = n_groups * 32
    d_ff = d_out
    down_groups = -(-d_ff // 32)
    out = {}
    for layer in n_layers:
        p = f"blk.{layer}."
        out[p + "ffn_gate_exps.weight"] = (mxfp4_stack(rng, n_experts, d_ff, n_groups), MXFP4)
        out[p + "ffn_up_exps.weight"] = (mxfp4_stack(rng, n_experts, d_ff, n_groups), MXFP4)
        out[p + "ffn_down_exps.weight"] = (mxfp4_stack(rng, n_experts, d_in, down_groups),
                                           MXFP4)
        out[p + "ffn_gate_exps.bias"] = rng.standard_normal((n_experts, d_ff), np.float32)
        out[p + "ffn_up_exps.bias"] = rng.standard_normal((n_experts, d_ff), np.float32)
        out[p + "ffn_down_exps.bias"] = rng.standard_normal((n_experts, d_in), np.float32)
        out[p + "ffn_gate_inp.weight"] = rng.standard_normal((n_experts, d_in), np.float32)
        out[p + "ffn_gate_inp.bias"] = rng.standard_normal(n_experts, np.float32)
        out[p + "attn_sinks.weight"] = rng.standard_normal(5, np.float32)
    return out


def kimi_tensors(rng, n_layers=(1,), n_experts=5, d_ff=37, n_groups=3, shared_ff=64):
    """A Kimi K3 / DeepSeek-V3-shaped model: stacked MXFP4 experts, shared experts and
    the router in dense types (Q8_0, F16, BF16 bits, F32), the score-correction bias."""
    import gguf

    d_in = n_groups * 32
    out = {}
    for layer in n_layers:
        p = f"blk.{layer}."
        out[p + "ffn_gate_exps.weight"] = (mxfp4_stack(rng, n_experts, d_ff, n_groups), MXFP4)
        out[p + "ffn_up_exps.weight"] = (mxfp4_stack(rng, n_experts, d_ff, n_groups), MXFP4)
        out[p + "ffn_down_exps.weight"] = (mxfp4_stack(rng, n_experts, d_in, 2), MXFP4)
        q8 = gguf.quants.quantize(rng.standard_normal((shared_ff, d_in), np.float32),
                                  gguf.GGMLQuantizationType.Q8_0)
        out[p + "ffn_gate_shexp.weight"] = (q8, Q8_0)
        out[p + "ffn_up_shexp.weight"] = rng.standard_normal((shared_ff, d_in)).astype(
            np.float16)
        bf16 = rng.standard_normal((d_in, shared_ff), np.float32).view(np.uint32) >> 16
        out[p + "ffn_down_shexp.weight"] = (bf16.astype(np.uint16).view(np.uint8), BF16)
        out[p + "ffn_gate_inp.weight"] = rng.standard_normal((n_experts, d_in), np.float32)
        out[p + "exp_probs_b.bias"] = rng.standard_normal(n_experts, np.float32)
    return out


# ---------------------------------------------------------------------------------------
# the byte-level encoder


def string(s):
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def value(vtype, v):
    """The bytes of a value (no type prefix); an array is (element type, items)."""
    if vtype == STRING:
        return string(v)
    if vtype == ARRAY:
        etype, items = v
        return struct.pack("<IQ", etype, len(items)) + b"".join(value(etype, x) for x in items)
    return struct.pack("<" + _FMT[vtype], v)


def kv(key, vtype, v):
    return string(key) + struct.pack("<I", vtype) + value(vtype, v)


def tensor_info(name, ne, ggml_type, offset):
    return (string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d)
                                                                 for d in ne)
            + struct.pack("<IQ", ggml_type, offset))


def encode(kvs, infos, data, alignment=32, version=3, n_kv=None, n_tensors=None,
           magic=b"GGUF"):
    """A GGUF file: ``kvs`` and ``infos`` encoded entries (bytes), padding to
    ``alignment``, ``data``; the counts default to the entries'."""
    head = magic + struct.pack("<IQQ", version,
                               len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    head += bytes(-len(head) % alignment)
    return head + data


def tiny_gguf(path, arch="gpt-oss", layers=(0, 1), n_experts=3, d_out=37, n_groups=3,
              seed=0, types=None, split=1):
    """A small GGUF model built byte by byte (no gguf package): per layer stacked MXFP4
    gate/up/down experts (``types``: names of some stored as I8 instead, 1-D, the same
    bytes) and an F32 router; ``split`` > 1 writes that many files
    ``stem-0000i-of-0000N.gguf`` (one layer's tensors or more each).  Returns the paths."""
    rng = np.random.default_rng(seed)
    tensors = []
    for layer in layers:
        for proj in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{proj}_exps.weight"
            raw = mxfp4_stack(rng, n_experts, d_out, n_groups).tobytes()
            if name in (types or ()):
                tensors.append((name, [len(raw)], I8, raw))
            else:
                tensors.append((name, [n_groups * 32, d_out, n_experts], MXFP4, raw))
        router = rng.standard_normal((n_experts, n_groups * 32), np.float32)
        tensors.append((f"blk.{layer}.ffn_gate_inp.weight", [n_groups * 32, n_experts], F32,
                        router.tobytes()))
    chunks = [tensors[i::split] for i in range(split)]
    stem = str(path)[:-len(".gguf")] if str(path).endswith(".gguf") else str(path)
    paths = []
    for i, chunk in enumerate(chunks):
        kvs = [kv("general.architecture", STRING, arch)] if i == 0 else []
        if split > 1:
            kvs += [kv("split.no", UINT16, i), kv("split.count", UINT16, split),
                    kv("split.tensors.count", INT32, len(tensors))]
        infos, data = [], b""
        for name, ne, t, raw in chunk:
            data += bytes(-len(data) % 32)
            infos.append(tensor_info(name, ne, t, len(data)))
            data += raw
        p = f"{stem}-{i + 1:05d}-of-{split:05d}.gguf" if split > 1 else str(path)
        with open(p, "wb") as f:
            f.write(encode(kvs, infos, data))
        paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------
# a Kimi K3 layer as llama.cpp's converter writes it, and the same layer as safetensors

K3_METADATA = {  # kimi-k3.* keys (llama.cpp gguf-py Keys) -> (value, GGUF value type)
    "expert_weights_scale": (2.5, FLOAT32),
    "expert_weights_norm": (True, BOOL),
    "expert_gating_func": (2, UINT32),
    "attention.layer_norm_rms_epsilon": (1e-5, FLOAT32),
    "activation.situ_beta": (4.0, FLOAT32),
    "activation.situ_linear_beta": (25.0, FLOAT32),
}


def k3_layer(rng, n_experts=6, hidden=96, latent=64, d_ff=64, shared_ff=64):
    """Random weights of one K3 MoE layer: the experts as split-layout bytes (packed
    (E, O, G, 16) in gpt-oss's arrangement and scale bytes (E, O, G), as the released
    checkpoint), the dense parts as float32 values."""
    def experts(d_out, d_in):
        g = d_in // 32
        return (rng.integers(0, 256, (n_experts, d_out, g, 16), np.uint8),
                rng.integers(119, 126, (n_experts, d_out, g), np.uint8))

    def dense(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / shape[-1] ** 0.5).astype(np.float32)

    return dict(
        w1=experts(d_ff, latent), w3=experts(d_ff, latent), w2=experts(latent, d_ff),
        router=dense(n_experts, hidden), bias=(rng.standard_normal(n_experts) * 0.01).astype(
            np.float32),
        down=dense(latent, hidden), up=dense(hidden, latent),
        norm=(1 + 0.1 * rng.standard_normal(latent)).astype(np.float32),
        shared_gate=dense(shared_ff, hidden), shared_up=dense(shared_ff, hidden),
        shared_down=dense(hidden, shared_ff))


def _bf16_bits(a):
    """float32 -> bfloat16 bytes (truncated), as (..., 2 * n) uint8 for raw_dtype BF16."""
    bits = (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits.view(np.uint8)


def write_k3_gguf(path, weights, layer=1, arch="kimi-k3", metadata=None, omit=(),
                  split_max_tensors=0):
    """A GGUF file of one K3 MoE layer named as llama.cpp's ``conversion/kimi_k3.py``
    names it: the experts repacked into MXFP4 blocks (scale byte first, element j / j+16
    in byte j's low / high nibble), the dense parts in F32, F16, BF16 and Q8_0.  ``omit``:
    tensor suffixes or metadata keys left out.  Returns the paths written."""
    import gguf

    from mxfp4x.testing.layers import gguf_blocks_of

    p = f"blk.{layer}."
    q8 = gguf.quants.quantize(weights["shared_gate"], gguf.GGMLQuantizationType.Q8_0)
    tensors = {}
    for proj, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        packed, scales = weights[w]
        blocks = gguf_blocks_of(packed, scales)
        tensors[f"ffn_{proj}_exps.weight"] = (blocks.reshape(blocks.shape[:2] + (-1,)), MXFP4)
    tensors.update({
        "ffn_gate_inp.weight": weights["router"],
        "exp_probs_b.bias": weights["bias"],
        "ffn_routed_down.weight": (_bf16_bits(weights["down"]), BF16),
        "ffn_routed_up.weight": weights["up"].astype(np.float16),
        "ffn_routed_norm.weight": weights["norm"],
        "ffn_gate_shexp.weight": (q8, Q8_0),
        "ffn_up_shexp.weight": weights["shared_up"].astype(np.float16),
        "ffn_down_shexp.weight": (_bf16_bits(weights["shared_down"]), BF16),
    })
    n_experts = weights["router"].shape[0]
    meta = dict(K3_METADATA, expert_count=(n_experts, UINT32), expert_used_count=(2, UINT32),
                expert_latent_length=(weights["down"].shape[0], UINT32),
                embedding_length=(weights["down"].shape[1], UINT32))
    meta.update(metadata or {})
    kvs = [(f"{arch}.{k}", v, t) for k, (v, t) in meta.items() if k not in omit]
    return write_gguf(path, arch, {p + k: v for k, v in tensors.items() if k not in omit},
                      kvs, split_max_tensors=split_max_tensors)


def write_k3_safetensors(folder, gguf_path, weights, layer=1, config=None):
    """The same layer as a checkpoint in the release's layout: the experts' split-layout
    bytes as they were before the repacking, the dense parts as the GGUF file holds them
    (its F16, BF16 and Q8_0 values, as float32), config.json from the file's metadata."""
    import json
    import os

    import torch

    from mxfp4x.checkpoints.gguf import GGUFCheckpoint
    from mxfp4x.checkpoints.safetensors import write_file
    from mxfp4x.testing.kimi_k3 import k3_config

    ckpt = GGUFCheckpoint(gguf_path)
    n_experts, _, _, _ = weights["w1"][0].shape
    hidden, latent = weights["router"].shape[1], weights["down"].shape[0]
    d_ff, shared_ff = weights["w1"][0].shape[1], weights["shared_gate"].shape[0]
    cfg = k3_config(hidden_size=hidden, routed_expert_hidden_size=latent,
                    num_experts=n_experts, num_experts_per_token=2,
                    moe_intermediate_size=d_ff, num_shared_experts=shared_ff // d_ff,
                    routed_scaling_factor=2.5, rms_norm_eps=float(np.float32(1e-5)),
                    num_hidden_layers=layer + 1, **(config or {}))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    base = f"model.layers.{layer}.block_sparse_moe."
    g = f"blk.{layer}."
    dense = {"gate.weight": "ffn_gate_inp.weight",
             "gate.e_score_correction_bias": "exp_probs_b.bias",
             "routed_expert_down_proj.weight": "ffn_routed_down.weight",
             "routed_expert_up_proj.weight": "ffn_routed_up.weight",
             "routed_expert_norm.weight": "ffn_routed_norm.weight",
             "shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
             "shared_experts.up_proj.weight": "ffn_up_shexp.weight",
             "shared_experts.down_proj.weight": "ffn_down_shexp.weight"}
    entries = {}
    for name, gname in dense.items():
        t = ckpt.dequantize(g + gname).contiguous()
        entries[base + name] = (torch.float32, tuple(t.shape), lambda t=t: t)
    for w in ("w1", "w3", "w2"):
        packed, scales = weights[w]
        for e in range(n_experts):
            p = torch.from_numpy(packed[e].reshape(packed.shape[1], -1).copy())
            s = torch.from_numpy(scales[e].copy())
            stem = f"{base}experts.{e}.{w}."
            entries[stem + "weight_packed"] = (torch.uint8, tuple(p.shape), lambda p=p: p)
            entries[stem + "weight_scale"] = (torch.uint8, tuple(s.shape), lambda s=s: s)
    ckpt.close()
    write_file(os.path.join(folder, "model.safetensors"), entries)
    return folder
