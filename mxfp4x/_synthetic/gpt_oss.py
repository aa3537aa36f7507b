"""gpt-oss checkpoints with random weights for the ``layer`` main job and the tests: a
layer writer and a whole-model writer in the released layout (names from the families
registry, ``mxfp4x.checkpoints.families.GPT_OSS``: stacked MXFP4 experts
``model.layers.L.mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}`` and the router
``model.layers.L.mlp.router.{weight,bias}``), a tokenizer for them, and a float64
reference of the experts block.  Both writers draw and write each tensor a piece at a
time (:data:`CHUNK` elements): their memory does not grow with the model, nor with its
largest tensor."""
import json
import math
import os
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

from ..checkpoints.families import GPT_OSS
from ..models.gpt_oss import GPT_OSS_20B, tensor_names

ARCHITECTURES = ["GptOssForCausalLM"]  # config.json's, as released (llama.cpp, vLLM read it)
CHUNK = 1 << 22  # elements drawn at once: 16 MiB of float32 draws


def _pieces(shape: Tuple[int, ...], draw: Callable[[Tuple[int, ...]], torch.Tensor]
            ) -> Callable[[], Any]:
    """``make`` of ``write_file`` for a tensor of ``shape``: its pieces of whole rows, about
    :data:`CHUNK` elements each, ``draw(piece_shape)`` making each when it is written."""
    shape = tuple(int(d) for d in shape)

    def make():
        if not shape:
            return draw(())
        step = max(1, CHUNK // max(1, math.prod(shape[1:])))
        return (draw((min(step, shape[0] - r),) + shape[1:])
                for r in range(0, shape[0], step))
    return make


def _bytes(rng, lo: int = 0, hi: int = 256):
    return lambda shape: torch.from_numpy(rng.integers(lo, hi, shape, np.uint8))


def _bf16(rng, scale: float = 1.0, offset: float = 0.0):
    """Normal draws times ``scale`` plus ``offset``, in bfloat16 (drawn in float32)."""
    def draw(shape):
        t = torch.from_numpy(rng.standard_normal(shape, np.float32)).mul_(scale)
        return (t.add_(offset) if offset else t).bfloat16()
    return draw


def write_gpt_oss_layer(folder: str, layer: int = 0, seed: int = 0, **sizes) -> dict:
    """One random gpt-oss MoE layer (gpt-oss-20b sizes unless ``sizes`` say otherwise,
    under any of their config names) and its ``config.json``, with the release's keys
    (``num_experts_per_tok`` and ``experts_per_token`` both, ``architectures``); written
    a piece of a tensor at a time.  Returns the config."""
    from .._core.files import atomic_write
    from ..checkpoints.safetensors import write_file

    cfg = GPT_OSS.config(dict(GPT_OSS_20B, **GPT_OSS.config(sizes, "sizes")), "sizes")
    cfg.update(model_type="gpt_oss", architectures=ARCHITECTURES,
               experts_per_token=cfg[GPT_OSS.top_k_key])
    e, h, f = cfg[GPT_OSS.n_experts_key], cfg["hidden_size"], cfg["intermediate_size"]
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    with atomic_write(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    n = tensor_names("", layer)  # the release's names, from the families registry
    router = [p.format(layer=layer) for p in (GPT_OSS.router, str(GPT_OSS.router_bias))]
    shapes = {router[0]: (torch.bfloat16, (e, h), _bf16(rng, h ** -0.5)),
              router[1]: (torch.bfloat16, (e,), _bf16(rng, 0.1)),
              n["gate_up_blocks"]: (torch.uint8, (e, 2 * f, h // 32, 16), _bytes(rng)),
              n["gate_up_scales"]: (torch.uint8, (e, 2 * f, h // 32), _bytes(rng, 118, 124)),
              n["gate_up_bias"]: (torch.bfloat16, (e, 2 * f), _bf16(rng, 0.1)),
              n["down_blocks"]: (torch.uint8, (e, h, f // 32, 16), _bytes(rng)),
              n["down_scales"]: (torch.uint8, (e, h, f // 32), _bytes(rng, 118, 124)),
              n["down_bias"]: (torch.bfloat16, (e, h), _bf16(rng, 0.1))}
    write_file(os.path.join(folder, "model.safetensors"),
               {name: (dtype, shape, _pieces(shape, draw))
                for name, (dtype, shape, draw) in shapes.items()})
    return cfg


def gpt_oss_reference(block, h, idx, w, rows: Optional[slice] = None) -> np.ndarray:
    """The experts block (``mxfp4x.nn.GptOssExperts``) in float64, for the given routing;
    ``rows`` restricts the output columns."""
    from .._core.reference import decode_expert

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


def released_quantization_config() -> Dict[str, Any]:
    """config.json's ``quantization_config`` as gpt-oss is released: MXFP4 experts, the
    attention, the router, the embeddings and the head left dense (a new dict each call)."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}


GPT_OSS_20B_MODEL = dict(num_hidden_layers=24, num_local_experts=32, vocab_size=201088)
"""transformers' ``GptOssConfig`` defaults (gpt-oss-120b) with these, as released."""

# gpt-oss's special tokens (its o200k_harmony encoding's), by the role of the first three
SPECIAL_TOKENS = {"bos_token": "<|startoftext|>", "pad_token": "<|endoftext|>",
                  "eos_token": "<|return|>"}
HARMONY_TOKENS = ("<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
                  "<|call|>")


def write_tokenizer(folder: str, vocab_size: int, model_max_length: int) -> Dict[str, int]:
    """A small valid tokenizer of exactly ``vocab_size`` tokens for a random checkpoint,
    loadable by ``transformers.AutoTokenizer.from_pretrained(folder)``: byte-level BPE
    over the 256 byte symbols (any text encodes, and decodes back exactly), gpt-oss's
    special tokens, and the other ids reserved tokens ``<|reserved_i|>`` (as gpt-oss
    reserves its unused ids), so that every row of the embedding is a token.  Writes
    ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` (each
    through a temporary file); returns the special tokens' ids by config.json's names
    (``bos_token_id``, ``eos_token_id``, ``pad_token_id``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from .._core.files import atomic_write

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = list(SPECIAL_TOKENS.values()) + list(HARMONY_TOKENS)
    if vocab_size < len(symbols) + len(specials):
        raise ValueError(f"vocab_size: at least {len(symbols) + len(specials)} (the 256 "
                         f"byte symbols and {len(specials)} special tokens), got "
                         f"{vocab_size}")
    vocab = {t: i for i, t in enumerate(symbols + specials)}
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in specials])
    files = {"tokenizer.json": tok.to_str(pretty=False),
             "special_tokens_map.json": json.dumps(SPECIAL_TOKENS, indent=1),
             "tokenizer_config.json": json.dumps(dict(
                 SPECIAL_TOKENS, tokenizer_class="PreTrainedTokenizerFast",
                 model_max_length=model_max_length, clean_up_tokenization_spaces=False),
                 indent=1)}
    for name, text in files.items():
        with atomic_write(os.path.join(folder, name), "w") as fh:
            fh.write(text)
    return {f"{role}_id": vocab[token] for role, token in SPECIAL_TOKENS.items()}


def write_gpt_oss_model(folder: str, seed: int = 0, layers_per_file: int = 4,
                        progress=None, **config) -> dict:
    """A whole gpt-oss checkpoint with random weights in the released layout, loadable by
    transformers, llama.cpp's converter and vLLM: ``config.json`` from transformers'
    ``GptOssConfig`` (gpt-oss-20b's configuration, ``config`` overriding any field;
    ``architectures`` ``["GptOssForCausalLM"]``, ``quantization_config`` mxfp4, as
    released; the special tokens' ids those of the tokenizer), a tokenizer of
    ``vocab_size`` tokens (:func:`write_tokenizer`), the experts MXFP4 (random bytes,
    scales 118..123), everything else random bf16 (norm weights near 1).  Each tensor is
    drawn and written a piece of :data:`CHUNK` elements at a time, ``layers_per_file``
    layers to a file with a ``model.safetensors.index.json``: the memory it takes is a
    piece's, whatever the model's size or its largest tensor's (the embedding).
    ``progress(done, total)`` is called after each file. Returns the config dict."""
    import warnings

    import transformers

    from .._core.files import atomic_write
    from ..checkpoints.safetensors import write_file

    config = GPT_OSS.config(config, "config")  # any of the keys' names, as transformers
    vocab_size = config.get("vocab_size", GPT_OSS_20B_MODEL["vocab_size"])
    os.makedirs(folder, exist_ok=True)
    cfg = transformers.GptOssConfig(**{**GPT_OSS_20B_MODEL, "architectures": ARCHITECTURES,
                                       **config})
    tokens = write_tokenizer(folder, vocab_size, cfg.max_position_embeddings)
    for key, token_id in tokens.items():
        if config.get(key) is None:
            setattr(cfg, key, token_id)
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
        if dtype == torch.uint8:
            draw = _bytes(rng, *((118, 124) if name.endswith("_scales") else (0, 256)))
        elif name.endswith("norm.weight"):
            draw = _bf16(rng, 0.1, offset=1.0)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            draw = _bf16(rng, 0.02 if name.endswith(("embed_tokens.weight", "sinks"))
                         else fan_in ** -0.5)
        return dtype if dtype == torch.uint8 else torch.bfloat16, shape, _pieces(shape, draw)

    def file_of(name):
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers":
            return int(parts[2]) // layers_per_file
        return -1  # embeddings, final norm, head: their own file
    groups: dict = {}
    for name in sorted(shapes):
        groups.setdefault(file_of(name), []).append(name)
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
    out["quantization_config"] = released_quantization_config()
    with atomic_write(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return out
