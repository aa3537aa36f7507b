"""gpt-oss layers for the ``layer`` main job: a checkpoint writer in the released layout
(stacked MXFP4 experts ``model.layers.L.mlp.experts.{gate_up,down}_proj_{blocks,scales,
bias}`` and the router ``model.layers.L.mlp.router.{weight,bias}``), the router, and a
float64 reference of the experts block."""
import json
import os
from typing import Optional

import numpy as np
import torch

from ..models.gpt_oss import GPT_OSS_20B


def write_gpt_oss_layer(folder: str, layer: int = 0, seed: int = 0, **sizes) -> dict:
    """One random gpt-oss MoE layer (gpt-oss-20b sizes unless ``sizes`` say otherwise) and
    its ``config.json``; written one tensor at a time."""
    from .._io import atomic_write
    from ..checkpoints.safetensors import write_file

    cfg = dict(GPT_OSS_20B, model_type="gpt_oss", **sizes)
    e, h, f = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    with atomic_write(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    p = f"model.layers.{layer}.mlp."

    def u8(*shape, lo=0, hi=256):
        return lambda: torch.from_numpy(rng.integers(lo, hi, shape, np.uint8))

    def bf16(*shape, scale=1.0):
        return lambda: torch.from_numpy(rng.standard_normal(shape) * scale).bfloat16()

    entries = {
        p + "router.weight": (torch.bfloat16, (e, h), bf16(e, h, scale=h ** -0.5)),
        p + "router.bias": (torch.bfloat16, (e,), bf16(e, scale=0.1)),
        p + "experts.gate_up_proj_blocks": (torch.uint8, (e, 2 * f, h // 32, 16),
                                            u8(e, 2 * f, h // 32, 16)),
        p + "experts.gate_up_proj_scales": (torch.uint8, (e, 2 * f, h // 32),
                                            u8(e, 2 * f, h // 32, lo=118, hi=124)),
        p + "experts.gate_up_proj_bias": (torch.bfloat16, (e, 2 * f), bf16(e, 2 * f, scale=0.1)),
        p + "experts.down_proj_blocks": (torch.uint8, (e, h, f // 32, 16),
                                         u8(e, h, f // 32, 16)),
        p + "experts.down_proj_scales": (torch.uint8, (e, h, f // 32),
                                         u8(e, h, f // 32, lo=118, hi=124)),
        p + "experts.down_proj_bias": (torch.bfloat16, (e, h), bf16(e, h, scale=0.1)),
    }
    write_file(os.path.join(folder, "model.safetensors"), entries)
    return cfg


def gpt_oss_reference(block, h, idx, w, rows: Optional[slice] = None) -> np.ndarray:
    """The experts block (``mxfp4x.nn.GptOssExperts``) in float64, for the given routing;
    ``rows`` restricts the output columns."""
    from .._reference import decode_expert

    h = h.double().numpy()
    rows = slice(None) if rows is None else rows
    n_out = block.down_blocks.shape[1]
    out = np.zeros((h.shape[0], len(range(n_out)[rows])))
    cache: dict = {}
    for t in range(h.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e not in cache:
                cache[e] = (decode_expert(block.gate_up_blocks[e].numpy(),
                                          block.gate_up_scales[e].numpy()),
                            decode_expert(block.down_blocks[e][rows].numpy(),
                                          block.down_scales[e][rows].numpy()))
            wgu, wd = cache[e]
            gu = wgu @ h[t] + block.gate_up_bias[e].double().numpy()
            gate = np.minimum(gu[0::2], block.limit)
            up = np.clip(gu[1::2], -block.limit, block.limit)
            act = (up + 1) * gate / (1 + np.exp(-block.alpha * gate))
            out[t] += float(w[t, k]) * (wd @ act + block.down_bias[e][rows].double().numpy())
    return out
