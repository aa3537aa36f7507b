"""Kimi K3 for tests and the ``layer`` job: a float64 reference of the block and random
checkpoints in the release's layout (config.json, sharded safetensors, the index)."""
from typing import List, Optional, Sequence

import numpy as np
import torch

from ..checkpoints.families import KIMI_K3
from ..models.kimi_k3 import K3_SIZES, KimiK3MoE

# ---- float64 reference --------------------------------------------------------------------

def _np64(t):
    return t.detach().to(torch.float64).numpy() if isinstance(t, torch.Tensor) else \
        np.asarray(t, dtype=np.float64)


def decode_gguf_expert(blocks) -> np.ndarray:
    """GGUF block_mxfp4 blocks (O, G, 17) or (O, G*17) -> the (O, 32*G) float64 matrix:
    each block's scale byte first, element j the low nibble of byte 1 + j, element j + 16
    its high nibble (scale byte 255 NaN, as mxfp4x's rule)."""
    from .._core.format import E2M1_TABLE, e8m0_to_float64
    b = np.asarray(blocks, dtype=np.uint8)
    b = b.reshape(b.shape[0], -1, 17)
    qs = b[..., 1:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
    values = E2M1_TABLE[codes] * e8m0_to_float64(b[..., 0])[..., None]
    return values.reshape(b.shape[0], -1)


class _Decoded(dict):
    """Expert matrices decoded to float64 on first use (a reference at model size decodes
    only the experts its tokens select); ``scales`` None: GGUF blocks."""

    def __init__(self, packed: Sequence[torch.Tensor],
                 scales: Optional[Sequence[torch.Tensor]]):
        super().__init__()
        self.packed, self.scales = packed, scales

    def __missing__(self, e):
        from .._core.reference import decode_expert
        p = self.packed[e]
        if self.scales is None:
            self[e] = w = decode_gguf_expert(p.numpy())
            return w
        s = self.scales[e]
        self[e] = w = decode_expert(p.reshape(p.shape[0], -1, 16).numpy(), s.numpy())
        return w


def kimi_k3_reference(block: KimiK3MoE, x, selected, weights, rows=None):
    """The block in float64 numpy, for the given routing (the router is checked on its
    own): every matrix (dense weights as stored, experts decoded exactly) and every
    activation in float64.  ``rows`` restricts the output columns computed."""
    x = _np64(x)
    sel = block.experts.local_ids(torch.as_tensor(selected)).numpy()
    p = _np64(weights)
    ex = block.experts
    gu_scales = ex.gate_up_scales
    w1 = _Decoded(ex.gate_up_packed[:ex.n_local],
                  None if gu_scales is None else gu_scales[:ex.n_local])
    w3 = _Decoded(ex.gate_up_packed[ex.n_local:],
                  None if gu_scales is None else gu_scales[ex.n_local:])
    w2 = _Decoded(ex.down_packed, ex.down_scales)
    b, bl = ex.beta, ex.linear_beta

    def situ64(g):
        return b * np.tanh(g / b) / (1 + np.exp(-g))

    def clip64(u):
        return u if bl is None else bl * np.tanh(u / bl)

    h = x @ _np64(block.down_proj).T
    y = np.zeros((x.shape[0], ex.down_packed[0].shape[0]))
    for t in range(x.shape[0]):
        for k in range(sel.shape[1]):
            e = sel[t, k]
            y[t] += p[t, k] * (w2[e] @ (situ64(w1[e] @ h[t]) * clip64(w3[e] @ h[t])))
    if block.norm_weight is not None:
        y = y / np.sqrt((y ** 2).mean(-1, keepdims=True) + block.norm_eps)
        y = y * _np64(block.norm_weight)
    up = _np64(block.up_proj)
    down = _np64(block.shared_down)
    if rows is not None:
        up, down = up[rows], down[rows]
    shared = (situ64(x @ _np64(block.shared_gate).T) * clip64(x @ _np64(block.shared_up).T)) \
        @ down.T
    return y @ up.T + shared



# ---- checkpoints in the release's layout (tests, the `layer` main job) ----------------------

def k3_config(**sizes) -> dict:
    """A config.json as Kimi K3's: the text model under ``text_config``, the
    compressed-tensors MXFP4 quantization config, ``sizes`` overriding the real ones."""
    text = dict(K3_SIZES, model_type="kimi_linear", hidden_act="situ",
                activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
                moe_router_activation_func="sigmoid", moe_renormalize=True,
                routed_scaling_factor=1.0, num_expert_group=1, topk_group=1,
                use_grouped_topk=True, latent_moe_use_norm=True, rms_norm_eps=1e-5,
                moe_layer_freq=1)
    text.update(sizes)
    text["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized", "targets": ["Linear"],
            "input_activations": None,
            "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                        "group_size": 32, "symmetric": True, "dynamic": False,
                        "scale_dtype": "torch.uint8"}}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"]}
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text}


def write_k3_checkpoint(folder: str, config: dict, layers: Sequence[int], seed: int = 0,
                        shards: int = 2, dense_dtype=torch.bfloat16, prefix="language_model.",
                        sparse: bool = False, packed_dtype=torch.uint8,
                        scale_dtype=torch.uint8, progress: bool = False) -> None:
    """Random MoE layers of a Kimi K3-layout checkpoint: ``config.json``, ``shards``
    safetensors files and ``model.safetensors.index.json``, the real tensor names.
    Written one tensor at a time (a full 14.8 GB layer never sits in memory);
    ``sparse`` leaves every tensor a hole in its file (all zero bytes, no disk used);
    ``packed_dtype`` / ``scale_dtype`` store the bytes typed as int8 / float8_e8m0fnu,
    as other files of the family do."""
    import json
    import os

    from .._core.files import atomic_write
    from ..checkpoints.safetensors import write_file

    text = config.get("text_config", config)
    hid, lat = text["hidden_size"], text["routed_expert_hidden_size"]
    n_exp, inter = text["num_experts"], text["moe_intermediate_size"]
    shared = inter * text["num_shared_experts"]
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    with atomic_write(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)

    def dense(shape, fan_in, scale=1.0):
        return lambda: torch.from_numpy(rng.standard_normal(shape) * (scale / fan_in ** 0.5)
                                        ).to(dense_dtype)

    def mxfp4(rows, cols):
        return (lambda: torch.from_numpy(rng.integers(0, 256, (rows, cols // 2), np.uint8)
                                         ).view(packed_dtype),
                lambda: torch.from_numpy(rng.integers(119, 126, (rows, cols // 32), np.uint8)
                                         ).view(scale_dtype))

    files: List[dict] = [{} for _ in range(shards)]
    names: dict = {}
    for layer in layers:
        base = prefix + KIMI_K3.block.format(layer=layer)
        block = {
            "gate.weight": (dense_dtype, (n_exp, hid), dense((n_exp, hid), hid)),
            "gate.e_score_correction_bias": (torch.float32, (n_exp,), lambda: torch.from_numpy(
                rng.standard_normal(n_exp) * 0.01).float()),
            "routed_expert_down_proj.weight": (dense_dtype, (lat, hid), dense((lat, hid), hid)),
            "routed_expert_up_proj.weight": (dense_dtype, (hid, lat), dense((hid, lat), lat)),
            "routed_expert_norm.weight": (dense_dtype, (lat,), lambda: torch.from_numpy(
                1 + 0.1 * rng.standard_normal(lat)).to(dense_dtype)),
            "shared_experts.gate_proj.weight": (dense_dtype, (shared, hid),
                                                dense((shared, hid), hid)),
            "shared_experts.up_proj.weight": (dense_dtype, (shared, hid),
                                              dense((shared, hid), hid)),
            "shared_experts.down_proj.weight": (dense_dtype, (hid, shared),
                                                dense((hid, shared), shared)),
        }
        for name, entry in block.items():
            files[0][base + name] = entry
        for e in range(n_exp):
            for proj, (rows, cols) in (("w1", (inter, lat)), ("w3", (inter, lat)),
                                       ("w2", (lat, inter))):
                make_p, make_s = mxfp4(rows, cols)
                stem = f"{base}experts.{e}.{proj}."
                files[e % shards][stem + "weight_packed"] = (packed_dtype, (rows, cols // 2),
                                                             make_p)
                files[e % shards][stem + "weight_scale"] = (scale_dtype, (rows, cols // 32),
                                                            make_s)
    for i, entries in enumerate(files):
        if sparse:
            entries = {k: (d, shape, lambda: None) for k, (d, shape, _) in entries.items()}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        if progress:
            print(f"writing {fname} ({len(entries)} tensors)", flush=True)
        write_file(os.path.join(folder, fname), entries)
        names.update({name: fname for name in entries})
    with atomic_write(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": names}, f)


