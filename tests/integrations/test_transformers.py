"""mxfp4x.integrations.transformers: a tiny random gpt-oss MXFP4 checkpoint in the released
layout, loaded with its experts kept MXFP4, against transformers' own dequantized model."""
import json
import os
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs Hugging Face transformers")
pytest.importorskip("accelerate", reason="transformers' own mxfp4 loader (the baseline) "
                                         "wants accelerate")

from safetensors import safe_open  # noqa: E402  (transformers' dependency)
from safetensors.torch import save_file  # noqa: E402

import mxfp4x.integrations.transformers as mxt  # noqa: E402

EXPERT_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                  "down_proj_blocks", "down_proj_scales", "down_proj_bias")
SIZES = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=64, num_local_experts=4,
             num_experts_per_tok=2, vocab_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
             sliding_window=8)


def _write_checkpoint(folder, seed=0):
    """config.json (transformers' GptOssConfig, quant_method mxfp4 as released) and one
    model.safetensors: random dense non-expert weights, and per layer the experts as the
    released checkpoints store them, blocks (E, out, in/32, 16) and scales (E, out, in/32)
    uint8, biases bf16."""
    config = transformers.GptOssConfig(**SIZES)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = transformers.GptOssForCausalLM(config)
    rng = np.random.default_rng(seed)
    e, h, f = config.num_local_experts, config.hidden_size, config.intermediate_size
    tensors = {k: v.detach().to(torch.bfloat16).contiguous()
               for k, v in dense.state_dict().items() if ".mlp.experts." not in k}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        for proj, (o, i) in (("gate_up_proj", (2 * f, h)), ("down_proj", (h, f))):
            tensors[p + proj + "_blocks"] = torch.from_numpy(
                rng.integers(0, 256, (e, o, i // 32, 16), np.uint8))
            tensors[p + proj + "_scales"] = torch.from_numpy(
                rng.integers(120, 126, (e, o, i // 32), np.uint8))
            tensors[p + proj + "_bias"] = torch.from_numpy(
                rng.standard_normal((e, o)) * 0.1).to(torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _write_checkpoint(str(tmp_path_factory.mktemp("gpt_oss_mxfp4")))


def _dense(path):
    """transformers' own load: on a CPU it dequantizes the experts (fp32)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _ours(path, **kwargs):
    kwargs.setdefault("dtype", torch.float32)
    return mxt.from_pretrained(path, **kwargs)


def test_loads_with_mxfp4_experts(checkpoint):
    model = _ours(checkpoint)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, mxt.GptOssMxfp4Experts)
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        assert torch.equal(experts.gate_up_proj_blocks,
                           f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks"))
