"""gpt-oss layers for the ``layer`` main job: a checkpoint writer in the released layout
(stacked MXFP4 experts ``model.layers.L.mlp.experts.{gate_up,down}_proj_{blocks,scales,
bias}`` and the router ``model.layers.L.mlp.router.{weight,bias}``), the router, and a
float64 reference of the experts block."""
import json
import os
from typing import Optional

import numpy as np
import torch

from ..checkpoints.families import GPT_OSS
from ..models.gpt_oss import GPT_OSS_20B, tensor_names


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
    n = tensor_names("", layer)  # the release's names, from the families registry
    router = [pattern.format(layer=layer) for pattern in (GPT_OSS.router, str(GPT_OSS.router_bias))]

    def u8(*shape, lo=0, hi=256):
        return lambda: torch.from_numpy(rng.integers(lo, hi, shape, np.uint8))

    def bf16(*shape, scale=1.0):
        return lambda: torch.from_numpy(rng.standard_normal(shape) * scale).bfloat16()

    entries = {
        router[0]: (torch.bfloat16, (e, h), bf16(e, h, scale=h ** -0.5)),
        router[1]: (torch.bfloat16, (e,), bf16(e, scale=0.1)),
        n["gate_up_blocks"]: (torch.uint8, (e, 2 * f, h // 32, 16), u8(e, 2 * f, h // 32, 16)),
        n["gate_up_scales"]: (torch.uint8, (e, 2 * f, h // 32),
                              u8(e, 2 * f, h // 32, lo=118, hi=124)),
        n["gate_up_bias"]: (torch.bfloat16, (e, 2 * f), bf16(e, 2 * f, scale=0.1)),
        n["down_blocks"]: (torch.uint8, (e, h, f // 32, 16), u8(e, h, f // 32, 16)),
        n["down_scales"]: (torch.uint8, (e, h, f // 32), u8(e, h, f // 32, lo=118, hi=124)),
        n["down_bias"]: (torch.bfloat16, (e, h), bf16(e, h, scale=0.1)),
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


GPT_OSS_20B_MODEL = dict(num_hidden_layers=24, num_local_experts=32, vocab_size=201088)
"""transformers' ``GptOssConfig`` defaults (gpt-oss-120b) with these, as released."""


def write_gpt_oss_model(folder: str, seed: int = 0, layers_per_file: int = 4,
                        progress=None, **config) -> dict:
    """A whole gpt-oss checkpoint with random weights in the released layout, loadable by
    transformers (``config.json`` from its ``GptOssConfig``: gpt-oss-20b's configuration,
    ``config`` overriding any field; ``quantization_config`` mxfp4 as released): the
    experts MXFP4 (random bytes, scales 118..123), everything else random bf16 (norm
    weights near 1). Written one tensor at a time, ``layers_per_file`` layers to a file
    with a ``model.safetensors.index.json``: memory stays at one tensor whatever the model
    size. ``progress(done, total)`` is called after each file. Returns the config dict."""
    import warnings

    import transformers

    from .._io import atomic_write
    from ..checkpoints.safetensors import write_file

    cfg = transformers.GptOssConfig(**{**GPT_OSS_20B_MODEL, **config})
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        shapes = {k: (v.dtype, tuple(v.shape)) for k, v in
                  transformers.GptOssForCausalLM(cfg).state_dict().items()}
    e, h, f = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        n = tensor_names("", layer)  # the release's names, from the families registry
        # transformers' dense names: the projections' weights (the blocks' name without
        # its kind) and the biases
        for role in ("gate_up", "down"):
            shapes.pop(n[f"{role}_blocks"].rsplit("_", 1)[0], None)
            shapes.pop(n[f"{role}_bias"], None)
        for role, (o, i) in (("gate_up", (2 * f, h)), ("down", (h, f))):
            shapes[n[f"{role}_blocks"]] = (torch.uint8, (e, o, i // 32, 16))
            shapes[n[f"{role}_scales"]] = (torch.uint8, (e, o, i // 32))
            shapes[n[f"{role}_bias"]] = (torch.bfloat16, (e, o))
    rng = np.random.default_rng(seed)

    def make(name, dtype, shape):
        def tensor():
            if dtype == torch.uint8:
                lo, hi = (118, 124) if name.endswith("_scales") else (0, 256)
                return torch.from_numpy(rng.integers(lo, hi, shape, np.uint8))
            x = rng.standard_normal(shape, np.float32)
            if name.endswith("norm.weight"):
                return torch.from_numpy(1 + 0.1 * x).bfloat16()
            fan_in = shape[-1] if len(shape) > 1 else 1
            scale = 0.02 if name.endswith(("embed_tokens.weight", "sinks")) else fan_in ** -0.5
            return torch.from_numpy(x * scale).bfloat16()
        return dtype if dtype == torch.uint8 else torch.bfloat16, shape, tensor

    def file_of(name):
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers":
            return int(parts[2]) // layers_per_file
        return -1  # embeddings, final norm, head: their own file
    groups: dict = {}
    for name in sorted(shapes):
        groups.setdefault(file_of(name), []).append(name)
    os.makedirs(folder, exist_ok=True)
    order = sorted(groups)
    names = {g: f"model-{i + 1:05d}-of-{len(order):05d}.safetensors" for i, g in enumerate(order)}
    total = 0
    for done, g in enumerate(order, 1):
        entries = {n: make(n, *shapes[n]) for n in groups[g]}
        total += sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size()
                     for d, s, _ in entries.values())
        write_file(os.path.join(folder, names[g]), entries, {"format": "pt"})
        if progress is not None:
            progress(done, len(order))
    index = {"metadata": {"total_size": total},
             "weight_map": {n: names[g] for g in order for n in groups[g]}}
    with atomic_write(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh, indent=1)
    out = cfg.to_dict()
    out["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with atomic_write(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return out
