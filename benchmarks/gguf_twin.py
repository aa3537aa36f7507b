"""The GGUF twin of bench_generate.py's random gpt-oss model: the same checkpoint written as
llama.cpp's converter writes gpt-oss (the ``gguf`` package: its names, types and metadata; the
MXFP4 experts as block_mxfp4 with the same codes and scales), and the check, through mxfp4x's
readers of both files, that the two hold the same experts."""
import json
import math
import os
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------
# the GGUF file


def _gguf_entries(ckpt, cfg):
    """(GGUF name, numpy shape, numpy dtype, GGML type or None, make) of every tensor, in
    the order written; ``make()`` gives the data (views of the checkpoint's mapping where
    the bytes are kept as they are).  Names and types as llama.cpp's converter gives them
    (gguf's tensor map for gpt-oss; gate and up split from gate_up's interleaved rows;
    1-D tensors, norms, biases and the router float32, the other weights bf16)."""
    import gguf
    import torch

    from mxfp4x.models.gpt_oss import tensor_names
    from mxfp4x.testing.layers import gguf_blocks_of

    n_layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, n_layers)
    experts = {layer: tensor_names("", layer) for layer in range(n_layers)}
    skip = {n for t in experts.values() for n in t.values()}
    out = []

    def dense(name):
        new = names.get_name(name + ".weight" if name.endswith("sinks") else name,
                             try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"{name}: no GGUF name for it in gguf's tensor map of gpt-oss")
        shape = ckpt.shape(name)
        if len(shape) <= 1 or new.endswith(("_norm.weight", ".bias", "ffn_gate_inp.weight")):
            out.append((new, shape, np.float32, None,
                        lambda: ckpt.get(name).float().numpy()))
        else:  # the bf16 bytes as they are
            out.append((new, shape[:-1] + (2 * shape[-1],), np.uint8,
                        gguf.GGMLQuantizationType.BF16,
                        lambda: ckpt.get(name).view(torch.uint8).numpy()))

    def blocks(name_b, name_s, rows, new):
        e, o, g, _ = ckpt.shape(name_b)
        o = len(range(o)[rows])

        def make():
            b, s = ckpt.get(name_b)[:, rows], ckpt.get(name_s)[:, rows]
            data = np.empty((e, o, g * 17), np.uint8)
            for i in range(e):  # an expert at a time: the memory of one
                data[i] = gguf_blocks_of(b[i].numpy(), s[i].numpy()).reshape(o, g * 17)
            return data
        out.append((new, (e, o, g * 17), np.uint8, gguf.GGMLQuantizationType.MXFP4, make))

    def bias(name, rows, new):
        shape = ckpt.shape(name)
        out.append((new, (shape[0], len(range(shape[1])[rows])), np.float32, None,
                    lambda: ckpt.get(name)[:, rows].float().numpy()))

    order = sorted(n for n in ckpt.keys() if n not in skip)
    for name in order:
        if ".layers." not in name and "lm_head" not in name and "model.norm" not in name:
            dense(name)  # the embedding first
    for layer in range(n_layers):
        for name in order:
            if f".layers.{layer}." in name:
                dense(name)
        t = experts[layer]
        for role, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
            blocks(t["gate_up_blocks"], t["gate_up_scales"], rows,
                   f"blk.{layer}.ffn_{role}_exps.weight")
            bias(t["gate_up_bias"], rows, f"blk.{layer}.ffn_{role}_exps.bias")
        blocks(t["down_blocks"], t["down_scales"], slice(None), f"blk.{layer}.ffn_down_exps.weight")
        bias(t["down_bias"], slice(None), f"blk.{layer}.ffn_down_exps.bias")
    for name in order:
        if "lm_head" in name or "model.norm" in name:
            dense(name)
    return out


def _tokenizer_metadata(w, folder, cfg):
    """The checkpoint's tokenizer as llama.cpp reads a gpt-oss one ("gpt2" BPE, gpt-oss's
    pre-tokenizer "gpt-4o"): every token by id, special ones CONTROL, the special ids."""
    import gguf

    with open(os.path.join(folder, "tokenizer.json")) as fh:
        tok = json.load(fh)
    tokens = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [int(gguf.TokenType.UNUSED)] * cfg["vocab_size"]
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, int(gguf.TokenType.NORMAL)
    for t in tok.get("added_tokens", []):
        tokens[t["id"]] = t["content"]
        types[t["id"]] = int(gguf.TokenType.CONTROL if t.get("special") else
                             gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types(types)
    # llama.cpp refuses a BPE vocabulary without merges, and gguf's writer leaves an empty
    # list out: the random tokenizer has none, so one (of two byte symbols) stands in
    merges = tok["model"].get("merges") or ["\u0120 \u0120"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if isinstance(cfg.get(key), int):
            add(cfg[key])


# the hyperparameters llama.cpp reads of a gpt-oss file (its load_hparams and
# llama_model_openai_moe's), as the converter writes them: gguf writer method, config key
_METADATA = (("add_block_count", "num_hidden_layers"),
             ("add_context_length", "max_position_embeddings"),
             ("add_embedding_length", "hidden_size"),
             ("add_feed_forward_length", "intermediate_size"),
             ("add_expert_feed_forward_length", "intermediate_size"),
             ("add_head_count", "num_attention_heads"),
             ("add_head_count_kv", "num_key_value_heads"),
             ("add_key_length", "head_dim"), ("add_value_length", "head_dim"),
             ("add_layer_norm_rms_eps", "rms_norm_eps"),
             ("add_expert_count", "num_local_experts"),
             ("add_expert_used_count", "num_experts_per_tok"),
             ("add_sliding_window", "sliding_window"))


def write_gguf(folder, path):
    """The GGUF file llama.cpp's converter (``convert_hf_to_gguf.py``, class GptOssModel)
    makes of the gpt-oss checkpoint in ``folder``, written with the ``gguf`` package
    (llama.cpp's own writer) one tensor at a time, to a temporary file renamed to
    ``path`` when complete."""
    import gguf

    from mxfp4x.checkpoints import SafeTensorsCheckpoint

    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    ckpt = SafeTensorsCheckpoint(folder)
    entries = _gguf_entries(ckpt, cfg)
    w = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    w.add_name("gpt-oss random weights (mxfp4x benchmark)")
    for method, key in _METADATA:
        getattr(w, method)(cfg[key])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if key in rope:
                add(rope[key])
    w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta")))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer_metadata(w, folder, cfg)
    for name, shape, dtype, raw, _ in entries:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    part = path + ".part"
    try:
        w.write_header_to_file(Path(part))
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, _, _, _, make in entries:
            w.write_tensor_data(make())
        w.close()
        os.replace(part, path)
    finally:
        w.close()
        if os.path.exists(part):
            os.remove(part)


def check_same_experts(folder, path, tokens=4, seed=0):
    """The first and last layer's experts read by mxfp4x from both files, on the same
    tokens and routing, agree (the arrangements differ, so within float32 rounding, not
    bit for bit): returns the largest difference relative to the largest output."""
    import torch

    from mxfp4x.nn import GptOssExperts

    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    for layer in sorted({0, cfg["num_hidden_layers"] - 1}):
        a = GptOssExperts.from_checkpoint(folder, layer)
        b = GptOssExperts.from_checkpoint(path, layer)
        x = torch.randn(tokens, cfg["hidden_size"], generator=gen)
        idx = torch.stack([torch.randperm(cfg["num_local_experts"], generator=gen)[
            :cfg["num_experts_per_tok"]] for _ in range(tokens)])
        p = torch.softmax(torch.randn(idx.shape, generator=gen), -1)
        ya, yb = a(x, idx, p), b(x, idx, p)
        worst = max(worst, float((ya - yb).abs().max() / ya.abs().max()))
    if not worst <= 1e-4:
        raise AssertionError(f"{path}: its experts differ from {folder}'s by {worst:.3g} "
                             f"of the largest output")
    return worst
